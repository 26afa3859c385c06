"""The export parity checks (`export.checks`) without an export: the "graph" is the PyTorch model itself behind an
ONNX-session-like `run(outputs, feeds)` that reads its inputs by their schema names (`service.engines.onnx_schema`),
so a faithful graph passes, and one that is off by more than `ATOL`, or decodes other tokens, or flips a near-tie
argmax, fails with `ExportCheckError` saying by how much or on how many inputs. The quality measures
(`gpt_validation_loss`, `vit_test_accuracy`) are checked against the definitions computed in PyTorch.

Random-init tiny models (the `tiny` presets' shapes), a second or two in all.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from export import checks
from export.checks import ATOL, ExportCheckError, check_gpt, check_translation, check_vit, gpt_validation_loss, \
    left_padded, vit_test_accuracy
from models.config import get_preset
from models.generate import generate_ids
from models.gpt import GPT
from models.tasks.translation import pad
from models.transformer import EncoderDecoderTransformer
from models.translate import default_max_new_tokens, translate_ids
from service.engines import onnx_schema as schema
from service.engines.translation import EncodedSources


@pytest.fixture(scope="module")
def gpt():
    torch.manual_seed(0)
    config = get_preset("gpt", "tiny")[0]
    return GPT(config).eval(), config


# what a graph may put at a padded position: anything (a check must compare the real positions only)
PADDING_GARBAGE = 1e3


class TorchGPTSession:
    """The GPT decoder graph's contract (inputs by name, `[logits, *presents]` out) computed by the PyTorch model;
    `offset` is added to the logits of the prompt pass, `step_offset` to those of a cached step; the logits of the
    padded positions are garbage, as a graph may leave them. Records each call's batch size."""

    def __init__(self, model, n_layers: int, offset: float = 0.0, step_offset: float = 0.0):
        self.model, self.n_layers, self.offset, self.step_offset = model, n_layers, offset, step_offset
        self.calls = 0
        self.batch_sizes: list[int] = []

    @torch.no_grad()
    def run(self, outputs, feeds):
        self.calls += 1
        names = [n for i in range(self.n_layers) for n in schema.past_names(i)]
        # the graph's input types and shapes, as ONNX Runtime enforces them
        for name in (schema.INPUT_IDS, schema.POSITION_IDS, schema.ATTENTION_MASK):
            assert feeds[name].dtype == np.int64, (name, feeds[name].dtype)
        ids = feeds[schema.INPUT_IDS]
        assert feeds[schema.POSITION_IDS].shape == ids.shape, feeds[schema.POSITION_IDS].shape
        assert set(np.unique(feeds[schema.ATTENTION_MASK])) <= {0, 1}
        self.batch_sizes.append(len(ids))
        for name in names:
            assert feeds[name].dtype == np.float32, (name, feeds[name].dtype)
        flat = [torch.from_numpy(feeds[n]) for n in names]
        past = [(flat[2 * i], flat[2 * i + 1]) for i in range(self.n_layers)]
        logits, presents = self.model(torch.from_numpy(feeds[schema.INPUT_IDS]),
                                      torch.from_numpy(feeds[schema.POSITION_IDS]),
                                      torch.from_numpy(feeds[schema.ATTENTION_MASK]).bool(), past)
        offset = self.offset if past[0][0].shape[2] == 0 else self.step_offset
        logits = logits.numpy() + np.float32(offset)
        new_mask = feeds[schema.ATTENTION_MASK][:, -ids.shape[1]:]
        logits[new_mask == 0] = PADDING_GARBAGE
        out = [logits, *(t.numpy() for kv in presents for t in kv)]
        return out if outputs is None else [out[0]] if outputs == [schema.LOGITS] else pytest.fail(outputs)


class FakeGPTEngine:
    """What `check_gpt` reads of a `GPTEngine`; `generate` decodes with `decoder` (default: the model itself)."""

    def __init__(self, model, config, decoder=None, **offsets):
        self.n_heads, self.n_layers = config.n_heads, config.n_layers
        self.head_dim, self.eos_id = config.d_model // config.n_heads, config.eos_id
        self.context_length = config.context_length
        self.session = TorchGPTSession(model, config.n_layers, **offsets)
        self.decoder = decoder or model

    def generate(self, prompts, make):
        return generate_ids(self.decoder, prompts, make)


PROMPTS = [[5, 9, 14, 3], [7], [30, 31, 32, 33, 34, 35, 36], [2, 2], [100, 50, 25], [8, 6, 4, 2, 1],
           [11, 12], [40, 41, 42], [60, 61, 62, 63]]


@pytest.mark.parametrize("prompts, ids, mask, positions", [
    ([[4, 5, 6], [7]], [[4, 5, 6], [0, 0, 7]], [[1, 1, 1], [0, 0, 1]], [[0, 1, 2], [0, 0, 0]]),
    ([[1], [2, 3]], [[0, 1], [2, 3]], [[0, 1], [1, 1]], [[0, 0], [0, 1]]),
])
def test_left_padded_puts_each_prompt_at_the_end_of_its_row(prompts, ids, mask, positions):
    got = left_padded(prompts)
    for array, expected in zip(got, (ids, mask, positions)):
        assert array.dtype == np.int64
        np.testing.assert_array_equal(array, expected)


def test_a_faithful_gpt_graph_passes_with_its_figures(gpt):
    model, config = gpt
    engine = FakeGPTEngine(model, config)
    result = check_gpt(model, engine, PROMPTS, max_new_tokens=6)
    assert result["greedy_identical"] == f"{len(PROMPTS)}/{len(PROMPTS)}"
    assert 0 <= result["logits_max_abs_diff_prompt"] <= ATOL and 0 <= result["logits_max_abs_diff_step"] <= ATOL
    assert engine.session.calls == 2  # the prompt pass and one cached step
    assert engine.session.batch_sizes == [8, 8]  # the first 8 prompts, left-padded together


@pytest.mark.parametrize("offsets", [{"offset": 2 * ATOL}, {"step_offset": 2 * ATOL}])
def test_gpt_logits_off_by_more_than_atol_fail(gpt, offsets):
    """Either pass off by 2 x ATOL: the prompt's logits or those of a step through the cache."""
    model, config = gpt
    with pytest.raises(ExportCheckError, match=r"^GPT logits differ from PyTorch by 2\.\d\de-04 \(> 0\.0001\)$"):
        check_gpt(model, FakeGPTEngine(model, config, **offsets), PROMPTS, max_new_tokens=6)


def test_gpt_logits_within_atol_pass(gpt):
    model, config = gpt
    result = check_gpt(model, FakeGPTEngine(model, config, offset=ATOL / 2, step_offset=ATOL / 2), PROMPTS,
                       max_new_tokens=6)
    assert ATOL / 4 < result["logits_max_abs_diff_prompt"] <= ATOL
    assert ATOL / 4 < result["logits_max_abs_diff_step"] <= ATOL


def test_a_gpt_graph_that_decodes_other_tokens_fails_naming_how_many(gpt):
    model, config = gpt
    torch.manual_seed(1)
    other = GPT(config).eval()

    def make(_):
        from service.decoding import GreedySearch
        return GreedySearch(max_new_tokens=6, eos_token_id=config.eos_id)

    ours = [s.results()[0].tokens for s in generate_ids(model, PROMPTS, make)]
    theirs = [s.results()[0].tokens for s in generate_ids(other, PROMPTS, make)]
    differ = sum(a != b for a, b in zip(ours, theirs))
    assert differ > 0
    with pytest.raises(ExportCheckError, match=rf"^greedy GPT outputs differ from PyTorch on {differ} of "
                                               rf"{len(PROMPTS)} prompts$"):
        check_gpt(model, FakeGPTEngine(model, config, decoder=other), PROMPTS, max_new_tokens=6)


def test_gpt_validation_loss_is_the_mean_next_token_loss_over_context_windows(gpt):
    model, config = gpt
    T = config.context_length
    ids = np.random.default_rng(0).integers(0, config.vocab_size, 3 * T + 5).astype(np.int64)
    engine = FakeGPTEngine(model, config)
    loss = gpt_validation_loss(engine, ids, batch_size=2)  # two batches: 2 windows and 1
    windows = torch.from_numpy(ids[: 3 * T].reshape(3, T)), torch.from_numpy(ids[1 : 3 * T + 1].reshape(3, T))
    with torch.no_grad():
        logits, _ = model(windows[0])
    expected = F.cross_entropy(logits.double().reshape(-1, config.vocab_size), windows[1].reshape(-1)).item()
    assert loss == pytest.approx(expected, rel=1e-5)
    assert engine.session.calls == 2


class FixedLogits(torch.nn.Module):
    """A "ViT" whose logits are a fixed table, one row per image (`image[0, 0, 0]` holds its index / 255)."""

    def __init__(self, table: np.ndarray):
        super().__init__()
        self.table = torch.from_numpy(table)

    def forward(self, pixels):
        return self.table[(pixels[:, 0, 0, 0] * 255).round().long()]


class FakeViTEngine:
    def __init__(self, table: np.ndarray):
        self.table = table
        self.batches: list[int] = []

    def preprocess(self, image):
        return (np.asarray(image, np.float32) / 255)[None]  # (1, H, W)

    def logits(self, batch):
        self.batches.append(len(batch))
        return self.table[np.rint(batch[:, 0, 0, 0] * 255).astype(int)]


def images(n: int) -> np.ndarray:
    out = np.zeros((n, 4, 4), np.uint8)
    out[:, 0, 0] = np.arange(n)
    return out


def test_a_faithful_vit_graph_passes_in_batches_of_250():
    table = np.random.default_rng(0).standard_normal((255, 10)).astype(np.float32)
    engine = FakeViTEngine(table)
    result = check_vit(FixedLogits(table), engine, images(255))
    assert result == {"logits_max_abs_diff": 0.0, "argmax_identical": "255/255"}
    assert engine.batches == [250, 5]


def test_vit_logits_off_by_more_than_atol_fail():
    table = np.random.default_rng(0).standard_normal((20, 10)).astype(np.float32)
    off = table.copy()
    off[3, 2] += 3 * ATOL
    with pytest.raises(ExportCheckError, match=r"^ViT logits differ from PyTorch by 3\.\d\de-04 \(> 0\.0001\)$"):
        check_vit(FixedLogits(table), FakeViTEngine(off), images(20))


def test_a_flipped_near_tie_fails_the_argmax_check_within_atol():
    """Two classes within ATOL of each other: the logits pass, the predictions must still be the same."""
    table = np.zeros((20, 10), np.float32)
    table[:, 1], table[:, 2] = 1.0, 1.0 - ATOL / 4
    flipped = table.copy()
    flipped[[4, 9], 2] = 1.0 + ATOL / 4  # class 2 now wins on two images, by ATOL / 2 in all
    with pytest.raises(ExportCheckError, match=r"^ViT argmax differs from PyTorch on 2 of 20 images$"):
        check_vit(FixedLogits(table), FakeViTEngine(flipped), images(20))


def test_vit_test_accuracy_is_the_percent_of_top1_hits():
    table = np.zeros((8, 3), np.float32)
    table[np.arange(8), [0, 1, 2, 0, 1, 2, 0, 1]] = 1.0
    labels = np.array([0, 1, 2, 0, 0, 0, 0, 0])  # 5 of 8 right
    assert vit_test_accuracy(FakeViTEngine(table), images(8), labels) == 62.5


def test_max_diff_reads_tensors_and_arrays():
    a = np.array([1.0, 2.0, 3.0], np.float32)
    assert checks._max_diff(a, torch.tensor([1.0, 2.5, 2.0])) == 1.0
    assert checks._max_diff(a, np.array([1.0, 2.0, 3.25], np.float32)) == 0.25


@pytest.mark.parametrize("length, windows", [(3 * 64, 2), (3 * 64 + 1, 3)])
def test_gpt_validation_loss_scores_only_whole_windows_with_a_next_token(gpt, length, windows):
    """3 x T tokens hold two windows that have a next token for every position; one token more makes three."""
    model, config = gpt
    assert config.context_length == 64
    ids = np.random.default_rng(1).integers(0, config.vocab_size, length).astype(np.int64)
    engine = FakeGPTEngine(model, config)
    loss = gpt_validation_loss(engine, ids, batch_size=windows)  # one call of all the windows
    T = config.context_length
    x, y = torch.from_numpy(ids[: windows * T].reshape(windows, T)), torch.from_numpy(ids[1 : windows * T + 1])
    with torch.no_grad():
        logits, _ = model(x)
    assert loss == pytest.approx(F.cross_entropy(logits.double().reshape(-1, config.vocab_size), y).item(), rel=1e-5)
    assert engine.session.calls == 1


def test_gpt_validation_loss_runs_32_windows_a_call_by_default(gpt):
    model, config = gpt
    ids = np.random.default_rng(2).integers(0, config.vocab_size, 33 * config.context_length + 1).astype(np.int64)
    engine = FakeGPTEngine(model, config)
    gpt_validation_loss(engine, ids)
    assert engine.session.calls == 2  # 32 windows, then 1


def test_gpt_validation_loss_is_stable_per_window_whatever_the_logits_scale():
    """Each position's log-sum-exp is shifted by its own max: a window of logits near 1000 next to one near 0 (a
    graph whose outputs drift) still gives every position its exact loss."""
    T, V = 2, 3
    levels = np.array([1000.0, 0.0], np.float32)  # window 0 near 1000, window 1 near 0

    class Session:
        def run(self, outputs, feeds):
            rows = len(feeds[schema.INPUT_IDS])
            return [np.broadcast_to(levels[:rows, None, None] + np.arange(V, dtype=np.float32), (rows, T, V)).copy()]

    engine = type("Engine", (), {"context_length": T, "n_layers": 1, "n_heads": 1, "head_dim": 2,
                                 "session": Session()})()
    ids = np.array([0, 1, 2, 0, 1], np.int64)  # targets 1, 2 | 0, 1
    per_position = np.log(np.exp(np.arange(V)).sum()) - np.array([1, 2, 0, 1])
    assert gpt_validation_loss(engine, ids) == pytest.approx(per_position.mean(), rel=1e-6)


def test_pad_ids_right_pads_each_sequence_to_the_length():
    np.testing.assert_array_equal(checks._pad_ids([[5, 6], [7]], 3), [[5, 6, 0], [7, 0, 0]])
    assert checks._pad_ids([[1]], 2).dtype == np.int64


# --- check_translation: the encoder and decoder graphs' contracts computed by the PyTorch translator ----------------

@pytest.fixture(scope="module")
def translator():
    torch.manual_seed(0)
    config = get_preset("translation", "tiny")[0]
    return EncoderDecoderTransformer(config).eval(), config


class TorchDecoderSession:
    """The translation decoder graph's contract (inputs by name: each row's sentence by `encoder_row` into the
    cross K/V and the source mask; `[logits, *presents]` out) computed by the PyTorch model, `offset` added to the
    logits."""

    def __init__(self, model, n_layers: int, offset: float = 0.0):
        self.model, self.n_layers, self.offset = model, n_layers, offset

    @torch.no_grad()
    def run(self, outputs, feeds):
        for name in (schema.INPUT_IDS, schema.POSITION_IDS, schema.ATTENTION_MASK, schema.ENCODER_ATTENTION_MASK,
                     schema.ENCODER_ROW):
            assert feeds[name].dtype == np.int64, (name, feeds[name].dtype)
        ids, mask = feeds[schema.INPUT_IDS], feeds[schema.ATTENTION_MASK]
        assert feeds[schema.POSITION_IDS].shape == ids.shape and len(feeds[schema.ENCODER_ROW]) == len(ids)
        assert set(np.unique(mask)) <= {0, 1} and set(np.unique(feeds[schema.ENCODER_ATTENTION_MASK])) <= {0, 1}
        rows = torch.from_numpy(feeds[schema.ENCODER_ROW])

        def pairs(names):
            return [tuple(torch.from_numpy(feeds[n]) for n in names(i)) for i in range(self.n_layers)]

        cross = [(k[rows], v[rows]) for k, v in pairs(schema.cross_names)]
        src_mask = torch.from_numpy(feeds[schema.ENCODER_ATTENTION_MASK])[rows].bool()
        logits, presents = self.model.decode_step(torch.from_numpy(feeds[schema.INPUT_IDS]),
                                                  torch.from_numpy(feeds[schema.POSITION_IDS]),
                                                  torch.from_numpy(feeds[schema.ATTENTION_MASK]).bool(), cross,
                                                  src_mask, pairs(schema.past_names))
        logits = logits.numpy() + np.float32(self.offset)
        logits[mask[:, -ids.shape[1]:] == 0] = PADDING_GARBAGE  # what a graph leaves at padded targets: anything
        out = [logits, *(t.numpy() for kv in presents for t in kv)]
        return out if outputs is None else pytest.fail(outputs)


class FakeTranslationEngine:
    """What `check_translation` reads of a `TranslationEngine`: `encode` (cross K/V + `encoder_offset`), the
    decoder session (+ `decoder_offset`), the default room, and `translate_ids` decoding with `decoder`'s weights
    (default: the model itself) and the searches `make` gives."""

    def __init__(self, model, config, decoder=None, encoder_offset: float = 0.0, decoder_offset: float = 0.0):
        self.model, self.config, self.encoder_offset = model, config, encoder_offset
        self.n_layers, self.n_heads = config.n_decoder_layers, config.n_heads
        self.head_dim = config.d_model // config.n_heads
        self.bos_id, self.eos_id = config.bos_id, config.eos_id
        self.decoder = TorchDecoderSession(model, config.n_decoder_layers, decoder_offset)
        self.decoding_model = decoder or model

    @torch.no_grad()
    def encode(self, sources):
        src, src_mask = pad(sources, self.config.pad_id)
        cross = self.model.cross_attention_kv(self.model.encode(src, src_mask))
        flat = [t.numpy() + np.float32(self.encoder_offset) for pair in cross for t in pair]
        return EncodedSources(flat, src_mask.numpy().astype(np.int64))

    def default_max_new_tokens(self, source_length: int) -> int:
        return default_max_new_tokens(source_length, self.config.max_positions)

    def translate_ids(self, sources, make):
        return translate_ids(self.decoding_model, sources, searches=[make(i) for i in range(len(sources))])


SOURCES = [[5 + i % 7, 40 + 3 * i, 9, 100 + i][: 1 + i % 4] + [2] for i in range(9)]
TARGETS = [[6 + j for j in range(2 + i)] for i in range(9)]  # 2 to 10 tokens: prefixes of 3 to 7 are cut


def test_a_faithful_translation_graph_pair_passes_with_its_figures(translator):
    model, config = translator
    result = check_translation(model, FakeTranslationEngine(model, config), SOURCES, TARGETS)
    assert result["greedy_identical"] == f"{len(SOURCES)}/{len(SOURCES)}"
    assert 0 <= result["cross_kv_max_abs_diff"] <= ATOL and 0 <= result["logits_max_abs_diff"] <= ATOL


@pytest.mark.parametrize("offsets, worst", [
    ({"encoder_offset": 2 * ATOL}, r"\d\.\d\de-04"),  # the K/V's offset carries on into the decoder's logits
    ({"decoder_offset": 2 * ATOL}, r"2\.\d\de-04"),
])
def test_translation_graphs_off_by_more_than_atol_fail(translator, offsets, worst):
    """Either graph off by 2 x ATOL: the cross-attention K/V the encoder gives, or the decoder's logits."""
    model, config = translator
    with pytest.raises(ExportCheckError, match=rf"^translation graphs differ from PyTorch by {worst} \(> 0\.0001\)$"):
        check_translation(model, FakeTranslationEngine(model, config, **offsets), SOURCES, TARGETS)


@pytest.mark.parametrize("offsets, figure, share", [
    ({"encoder_offset": ATOL / 10}, "cross_kv_max_abs_diff", 1 / 10),
    ({"decoder_offset": ATOL / 2}, "logits_max_abs_diff", 1 / 2),
])
def test_translation_graphs_within_atol_pass_with_each_difference_reported(translator, offsets, figure, share):
    model, config = translator
    result = check_translation(model, FakeTranslationEngine(model, config, **offsets), SOURCES, TARGETS)
    assert ATOL * share * 0.9 < result[figure] <= ATOL * share * 1.1
    assert result["greedy_identical"] == f"{len(SOURCES)}/{len(SOURCES)}"


def test_a_translator_that_decodes_other_tokens_fails_naming_how_many(translator):
    model, config = translator
    torch.manual_seed(1)
    other = EncoderDecoderTransformer(config).eval()
    ours = [s.results()[0].tokens for s in translate_ids(model, SOURCES)]
    theirs = [s.results()[0].tokens for s in translate_ids(other, SOURCES)]
    differ = sum(a != b for a, b in zip(ours, theirs))
    assert differ > 0
    with pytest.raises(ExportCheckError, match=rf"^greedy translations differ from PyTorch on {differ} of "
                                               rf"{len(SOURCES)} sentences$"):
        check_translation(model, FakeTranslationEngine(model, config, decoder=other), SOURCES, TARGETS)


def test_the_greedy_comparison_decodes_with_the_engines_default_room(translator):
    """The engine's searches get `default_max_new_tokens` of each source: an engine with less room than PyTorch's
    default (at random weights no sentence ends early) decodes shorter outputs, so every sentence differs."""
    model, config = translator

    class ShortRoom(FakeTranslationEngine):
        def default_max_new_tokens(self, source_length: int) -> int:
            return super().default_max_new_tokens(source_length) - 1

    ours = [s.results()[0].tokens for s in translate_ids(model, SOURCES)]
    assert all(len(t) == default_max_new_tokens(len(s), config.max_positions) for s, t in zip(SOURCES, ours))
    with pytest.raises(ExportCheckError, match=rf"on {len(SOURCES)} of {len(SOURCES)} sentences$"):
        check_translation(model, ShortRoom(model, config), SOURCES, TARGETS)
