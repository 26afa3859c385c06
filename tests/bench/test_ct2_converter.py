"""The engine benchmark's CTranslate2 peer runs OUR translator's weights (bench/enginebench/ct2.py): converted into
CTranslate2's TransformerSpec, a random-weight translator (the tiny preset's shapes) gives the same greedy and beam
translations as our PyTorch model and the same teacher-forced log-probabilities (within float32 rounding), so the
benchmark's ratios compare two engines on one model. And the benchmark's own CTranslate2 system returns exactly
the tokens asked for, equal to our engine's on the same weights."""

from __future__ import annotations

import sys

import numpy as np
import pytest
import torch

from tests.support import ROOT

BENCH = ROOT / "bench"
if str(BENCH) not in sys.path:
    sys.path.insert(0, str(BENCH))

import ctranslate2  # noqa: E402 - the dev extra's

from enginebench.ct2 import convert  # noqa: E402 - after the sys.path set-up

from models.config import TranslationConfig  # noqa: E402
from models.tasks.translation import pad  # noqa: E402
from models.transformer import EncoderDecoderTransformer  # noqa: E402
from models.translate import translate_ids  # noqa: E402

MAX_POSITIONS = 64
# float32 arithmetic in two engines: the log-probabilities agree to a few ulps of their size (measured: 2e-6)
LOGPROB_ATOL = 1e-4


@pytest.fixture(scope="module")
def pair(tmp_path_factory):
    torch.manual_seed(0)
    config = TranslationConfig(vocab_size=500, d_model=64, n_heads=4, n_encoder_layers=2, n_decoder_layers=2,
                               d_ff=128, dropout=0.0, max_positions=MAX_POSITIONS)
    model = EncoderDecoderTransformer(config).eval()
    folder = convert(model, tmp_path_factory.mktemp("ct2") / "model")
    return model, ctranslate2.Translator(str(folder), device="cpu", intra_threads=1)


def sources() -> list[list[int]]:
    rng = np.random.default_rng(0)
    return [[int(t) for t in rng.integers(3, 500, size=n)] + [2] for n in (4, 9, 13, 7, 1)]


def tokens(ids) -> list[str]:
    return [str(i) for i in ids]


@pytest.mark.parametrize("num_beams", [1, 4])
def test_translations_equal_our_models(pair, num_beams):
    model, translator = pair
    for source in sources():
        room = min(2 * len(source) + 10, MAX_POSITIONS - 1)  # models.translate.default_max_new_tokens
        ours = translate_ids(model, [source], num_beams=num_beams)[0].results()[0].tokens
        theirs = translator.translate_batch([tokens(source)], beam_size=num_beams, max_decoding_length=room,
                                           length_penalty=0.0 if num_beams == 1 else 1.0)[0].hypotheses[0]
        assert [int(t) for t in theirs] == ours, source


def test_teacher_forced_log_probabilities_equal_our_models(pair):
    model, translator = pair
    for source in sources():
        target = translate_ids(model, [source])[0].results()[0].tokens
        (scored,) = translator.score_batch([tokens(source)], [tokens(target)])
        src, src_mask = pad([source], 0)
        decoder_input = torch.tensor([[model.config.bos_id] + target])
        with torch.no_grad():
            logits = model(src, decoder_input, src_mask, torch.ones_like(decoder_input).bool())
        expected = torch.log_softmax(logits[0], -1)[torch.arange(len(target) + 1),
                                                     torch.tensor(target + [model.config.eos_id])]
        np.testing.assert_allclose(scored.log_probs, expected.numpy(), atol=LOGPROB_ATOL)
