"""Golden tests: `service.decoding` searches vs Hugging Face ``generate()`` on tiny random models.

Two tiny models are built from configs with random weights (no download): a GPT-2 (decoder-only) and a BART
(encoder-decoder). A large init range makes the next-token distributions peaked enough to avoid near-ties, and
the EOS logit is biased up so that hypotheses end both by EOS and by length (guarded by a test).

Our searches are driven by `run_search` with a step function that recomputes every row's full decoder sequence
without a cache (correctness over speed). HF runs with its KV cache:
* GPT-2: HF is run per prompt (no padding), because left padding puts pad tokens into ``input_ids``, which
  HF's n-gram blocking then sees, so padded HF output would depend on the batch shape. Our searches for all
  prompts still run together as one batch through `run_search`.
* BART: HF runs the whole batch with right-padded sources and an attention mask (the padding only touches the
  encoder, which is masked), so HF's batched beam search (finished items frozen while others run) is covered.
Token sequences must match exactly and scores within 1e-4 (HF: ``sequences_scores`` for beam search; for
greedy the sum of log-softmax(raw logits) of the chosen tokens from ``output_logits``).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

from service.decoding import (  # noqa: E402
    BeamSearch,
    GreedySearch,
    Hypothesis,
    SamplingSearch,
    TokenLogprob,
    apply_repetition_penalty,
    apply_temperature,
    run_search,
    top_k_filter,
    top_p_filter,
)

VOCAB = 40
MAX_NEW = 10
ATOL = 1e-4
TOP_N = 5  # greedy: HF hypotheses carry the top-N raw log-probs of every generated token (from output_logits)

# decoder-only ids
GPT_BOS, GPT_EOS, GPT_PAD = 0, 1, 2
# encoder-decoder ids (BART convention: decoder_start == eos)
BART_BOS, BART_PAD, BART_EOS, BART_START = 0, 1, 2, 2


@dataclass
class Harness:
    """A tiny HF model plus the glue to drive our searches and HF generate on the same inputs."""

    kind: str  # "gpt2" | "bart"
    model: object
    eos: int
    inputs: list[list[int]]  # prompts (gpt2) or sources (bart)
    _enc: list = field(default_factory=list)  # bart: encoder output (1, S, D) per source

    def prefix(self, i: int) -> list[int]:
        """Tokens HF's processors see in ``input_ids`` before the first generated token."""
        return list(self.inputs[i]) if self.kind == "gpt2" else [BART_START]

    @torch.no_grad()
    def _decoder_logits(self, i: int, seqs: list[list[int]]) -> np.ndarray:
        """Last-position logits (len(seqs), V) of full decoder sequences ``seqs`` for input ``i``."""
        ids = torch.tensor(seqs, dtype=torch.long)
        if self.kind == "gpt2":
            out = self.model(input_ids=ids, attention_mask=torch.ones_like(ids))
        else:
            enc = self._enc[i].expand(len(seqs), -1, -1)
            out = self.model(encoder_outputs=(enc,), decoder_input_ids=ids)
        return out.logits[:, -1, :].float().numpy()

    @torch.no_grad()
    def run_ours(self, searches) -> None:
        """Drive ``searches[i]`` (one per input) with `run_search`, no KV cache."""
        if self.kind == "bart":
            self._enc = [
                self.model.get_encoder()(input_ids=torch.tensor([src])).last_hidden_state for src in self.inputs
            ]
        rows = [(i, self.prefix(i)) for i in range(len(searches))]  # prefill rows: (input index, sequence)
        first = [self._decoder_logits(i, [seq])[0] for i, seq in rows]

        def step_fn(tokens: np.ndarray, parents: np.ndarray) -> np.ndarray:
            nonlocal rows
            rows = [(rows[p][0], rows[p][1] + [int(t)]) for t, p in zip(tokens, parents)]
            out, start = [], 0
            while start < len(rows):  # rows of one input are contiguous and of equal length
                end = start
                while end < len(rows) and rows[end][0] == rows[start][0]:
                    end += 1
                out.append(self._decoder_logits(rows[start][0], [s for _, s in rows[start:end]]))
                start = end
            return np.concatenate(out)

        run_search(searches, first, step_fn)

    @torch.no_grad()
    def run_hf(self, num_return_sequences: int = 1, **gen_kwargs) -> list[list[Hypothesis]]:
        """HF generate; per input a list of hypotheses (tokens without prompt/start/EOS, score, reason)."""
        kw = dict(
            do_sample=False,
            max_new_tokens=MAX_NEW,
            num_return_sequences=num_return_sequences,
            output_scores=True,
            output_logits=True,
            return_dict_in_generate=True,
        )
        kw.update(gen_kwargs)
        if self.kind == "gpt2":
            outs = []
            for prompt in self.inputs:
                ids = torch.tensor([prompt])
                out = self.model.generate(input_ids=ids, attention_mask=torch.ones_like(ids), **kw)
                outs.append(self._parse(out, len(prompt), 1, num_return_sequences, kw["num_beams"])[0])
            return outs
        longest = max(len(s) for s in self.inputs)
        ids = torch.tensor([s + [BART_PAD] * (longest - len(s)) for s in self.inputs])
        mask = torch.tensor([[1] * len(s) + [0] * (longest - len(s)) for s in self.inputs])
        out = self.model.generate(input_ids=ids, attention_mask=mask, **kw)
        return self._parse(out, 1, len(self.inputs), num_return_sequences, kw["num_beams"])

    def _parse(self, out, skip: int, batch: int, nrs: int, num_beams: int) -> list[list[Hypothesis]]:
        seqs = out.sequences[:, skip:].tolist()  # (batch * nrs, generated)
        if num_beams > 1:
            scores = out.sequences_scores.tolist()
        else:  # greedy: sum of raw log-probs of the chosen tokens, up to and including EOS
            lp = torch.stack([torch.log_softmax(x.double(), -1) for x in out.logits], 1)  # (B, T, V)
            scores = []
            for b, seq in enumerate(seqs):
                n = seq.index(self.eos) + 1 if self.eos in seq else len(seq)
                scores.append(float(sum(lp[b, j, seq[j]] for j in range(n))))
        hyps = []
        for b, (seq, score) in enumerate(zip(seqs, scores)):
            if self.eos in seq:
                hyps.append(Hypothesis(seq[: seq.index(self.eos)], score, "eos"))
            else:
                assert len(seq) == MAX_NEW
                hyps.append(Hypothesis(seq, score, "length"))
            if num_beams == 1:  # OpenAI-style logprobs of the raw distribution (output_logits are unprocessed)
                hyps[-1].logprobs = []
                for j, tok in enumerate(hyps[-1].tokens):
                    top = torch.topk(lp[b, j], TOP_N)
                    hyps[-1].logprobs.append(TokenLogprob(
                        tok, float(lp[b, j, tok]), list(zip(top.indices.tolist(), top.values.tolist()))))
        return [hyps[i * nrs : (i + 1) * nrs] for i in range(batch)]


@pytest.fixture(scope="session")
def harnesses():
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # tiny models: threads only add overhead on a shared machine
    torch.manual_seed(1234)
    rng = np.random.default_rng(0)

    gpt = transformers.GPT2LMHeadModel(
        transformers.GPT2Config(
            n_layer=2, n_head=2, n_embd=32, n_inner=64, vocab_size=VOCAB, n_positions=64,
            bos_token_id=GPT_BOS, eos_token_id=GPT_EOS, pad_token_id=GPT_PAD, tie_word_embeddings=False,
            initializer_range=0.3,
        )
    ).eval()
    with torch.no_grad():  # bias the EOS logit: ln_f.bias along the EOS output row adds a constant to it
        w = gpt.lm_head.weight[GPT_EOS]
        gpt.transformer.ln_f.bias.copy_(3.0 * w / w.dot(w))
    gpt.generation_config = transformers.GenerationConfig(
        bos_token_id=GPT_BOS, eos_token_id=GPT_EOS, pad_token_id=GPT_PAD
    )
    prompts = [[GPT_BOS] + rng.integers(3, VOCAB, size=n).tolist() for n in (2, 5, 8)]

    bart = transformers.BartForConditionalGeneration(
        transformers.BartConfig(
            vocab_size=VOCAB, d_model=32, encoder_layers=1, decoder_layers=2, encoder_attention_heads=2,
            decoder_attention_heads=2, encoder_ffn_dim=64, decoder_ffn_dim=64, max_position_embeddings=64,
            bos_token_id=BART_BOS, pad_token_id=BART_PAD, eos_token_id=BART_EOS,
            decoder_start_token_id=BART_START, forced_eos_token_id=None, forced_bos_token_id=None,
            init_std=0.3,
        )
    ).eval()
    with torch.no_grad():
        bart.final_logits_bias[0, BART_EOS] += 5.5  # the tied EOS row starts far below
    bart.generation_config = transformers.GenerationConfig(
        bos_token_id=BART_BOS, eos_token_id=BART_EOS, pad_token_id=BART_PAD, decoder_start_token_id=BART_START
    )
    sources = [rng.integers(3, VOCAB, size=n).tolist() + [BART_EOS] for n in (3, 6, 4)]
    yield {
        "gpt2": Harness("gpt2", gpt, GPT_EOS, prompts),
        "bart": Harness("bart", bart, BART_EOS, sources),
    }
    torch.set_num_threads(threads)


def _assert_same(ours: list[list[Hypothesis]], hf: list[list[Hypothesis]]) -> None:
    assert len(ours) == len(hf)
    for i, (o, h) in enumerate(zip(ours, hf)):
        assert [x.tokens for x in o] == [x.tokens for x in h], f"input {i}"
        assert [x.finish_reason for x in o] == [x.finish_reason for x in h], f"input {i}"
        np.testing.assert_allclose([x.score for x in o], [x.score for x in h], atol=ATOL, rtol=0)


def _beam(h: Harness, **kw) -> list[list[Hypothesis]]:
    searches = [BeamSearch(max_new_tokens=MAX_NEW, eos_token_id=h.eos, prefix=h.prefix(i), **kw)
                for i in range(len(h.inputs))]
    h.run_ours(searches)
    assert all(s.done and s.num_rows == 0 for s in searches)
    return [s.results() for s in searches]


@pytest.mark.parametrize("kind", ["gpt2", "bart"])
@pytest.mark.parametrize("min_new_tokens", [0, 4])
def test_greedy_matches_hf(harnesses, kind, min_new_tokens):
    h = harnesses[kind]
    searches = [GreedySearch(MAX_NEW, h.eos, min_new_tokens=min_new_tokens) for _ in h.inputs]
    h.run_ours(searches)
    ours = [s.results() for s in searches]
    hf = h.run_hf(num_beams=1, min_new_tokens=min_new_tokens)
    _assert_same(ours, hf)


@pytest.mark.parametrize("kind", ["gpt2", "bart"])
@pytest.mark.parametrize("min_new_tokens", [0, 4])
def test_greedy_logprobs_match_hf(harnesses, kind, min_new_tokens):
    """Recorded logprobs == log-softmax of HF's raw ``output_logits``: the chosen token and the top N, best first
    (with min_new_tokens the EOS masking changes the choice, not the recorded distribution). Temperature-0
    sampling with the OpenAI penalties at 0 records the same."""
    h = harnesses[kind]
    hf = h.run_hf(num_beams=1, min_new_tokens=min_new_tokens)
    greedy = [GreedySearch(MAX_NEW, h.eos, min_new_tokens=min_new_tokens, logprobs=TOP_N) for _ in h.inputs]
    sampled = [SamplingSearch(MAX_NEW, h.eos, temperature=0.0, min_new_tokens=min_new_tokens, logprobs=TOP_N,
                              presence_penalty=0.0, frequency_penalty=0.0, seed=0) for _ in h.inputs]
    h.run_ours(greedy)
    h.run_ours(sampled)
    ours = [s.results() for s in greedy]
    _assert_same(ours, hf)
    assert [s.results() for s in sampled] == ours
    for i, ((o,), (r,)) in enumerate(zip(ours, hf)):
        assert len(o.logprobs) == len(o.tokens) == len(r.logprobs), f"input {i}"
        for j, (a, b) in enumerate(zip(o.logprobs, r.logprobs)):
            assert a.token_id == b.token_id, (i, j)
            assert a.logprob == pytest.approx(b.logprob, abs=ATOL), (i, j)
            assert [t for t, _ in a.top] == [t for t, _ in b.top], (i, j)
            np.testing.assert_allclose([x for _, x in a.top], [x for _, x in b.top], atol=ATOL, rtol=0)
        chosen = sum(x.logprob for x in o.logprobs)
        if o.finish_reason == "eos":
            assert chosen > o.score  # the score also holds the EOS log-prob, which is not a generated token
        else:
            assert chosen == pytest.approx(o.score, abs=1e-9)
    if min_new_tokens:  # the masked EOS still shows in the recorded raw distribution: it is not renormalised away
        assert any(h.eos in [t for t, _ in x.top] for (o,) in ours for x in o.logprobs[:min_new_tokens])


def _repeats_ngram(seq: list[int], n: int) -> bool:
    grams = [tuple(seq[j : j + n]) for j in range(len(seq) - n + 1)]
    return len(grams) != len(set(grams))


def _with_eos(h: Harness, i: int, hyp: Hypothesis) -> list[int]:
    """The full sequence HF's n-gram processor saw: prefix + generated (+ EOS, which is subject to the ban too)."""
    return h.prefix(i) + hyp.tokens + ([h.eos] if hyp.finish_reason == "eos" else [])


@pytest.mark.parametrize("kind", ["gpt2", "bart"])
@pytest.mark.parametrize("min_new_tokens", [0, 4])
@pytest.mark.parametrize("no_repeat_ngram_size", [1, 2, 3])
def test_greedy_no_repeat_ngram_matches_hf(harnesses, kind, min_new_tokens, no_repeat_ngram_size):
    """Greedy (and temperature-0 sampling) with the n-gram ban == HF generate(do_sample=False, num_beams=1)."""
    h, n = harnesses[kind], no_repeat_ngram_size
    plain = [GreedySearch(MAX_NEW, h.eos, min_new_tokens=min_new_tokens) for _ in h.inputs]
    h.run_ours(plain)
    plain_seqs = [_with_eos(h, i, s.results()[0]) for i, s in enumerate(plain)]
    # not vacuous: without the ban some output repeats an n-gram of this size
    assert any(_repeats_ngram(seq, n) for seq in plain_seqs)

    searches = [GreedySearch(MAX_NEW, h.eos, min_new_tokens=min_new_tokens, no_repeat_ngram_size=n,
                             prefix=h.prefix(i)) for i in range(len(h.inputs))]
    h.run_ours(searches)
    ours = [s.results() for s in searches]
    _assert_same(ours, h.run_hf(num_beams=1, min_new_tokens=min_new_tokens, no_repeat_ngram_size=n))
    seqs = [_with_eos(h, i, hyps[0]) for i, hyps in enumerate(ours)]
    assert seqs != plain_seqs  # the ban changed something
    for i, seq in enumerate(seqs):
        assert not _repeats_ngram(seq, n), f"input {i}"  # the prompts have no repeated n-grams themselves

    sampled = [SamplingSearch(MAX_NEW, h.eos, temperature=0.0, min_new_tokens=min_new_tokens, prefix=h.prefix(i),
                              no_repeat_ngram_size=n, seed=0) for i in range(len(h.inputs))]
    h.run_ours(sampled)
    assert [s.results() for s in sampled] == ours


@pytest.mark.parametrize("kind", ["gpt2", "bart"])
@pytest.mark.parametrize("num_return_sequences", [1, 3])
@pytest.mark.parametrize("early_stopping", [True, False, "never"])
@pytest.mark.parametrize("length_penalty", [0.6, 1.0, 2.0])
def test_beam_matches_hf(harnesses, kind, length_penalty, early_stopping, num_return_sequences):
    h = harnesses[kind]
    kw = dict(num_beams=4, length_penalty=length_penalty, early_stopping=early_stopping,
              num_return_sequences=num_return_sequences)
    ours = _beam(h, **kw)
    _assert_same(ours, h.run_hf(**kw))


@pytest.mark.parametrize("kind", ["gpt2", "bart"])
@pytest.mark.parametrize("early_stopping", [True, False, "never"])
@pytest.mark.parametrize(("no_repeat_ngram_size", "min_new_tokens"), [(2, 0), (0, 4), (3, 3), (1, 0)])
def test_beam_processors_match_hf(harnesses, kind, early_stopping, no_repeat_ngram_size, min_new_tokens):
    h = harnesses[kind]
    kw = dict(num_beams=4, length_penalty=1.0, early_stopping=early_stopping, num_return_sequences=3,
              no_repeat_ngram_size=no_repeat_ngram_size, min_new_tokens=min_new_tokens)
    ours = _beam(h, **kw)
    _assert_same(ours, h.run_hf(**kw))
    for i, hyps in enumerate(ours):
        for hyp in hyps:
            if hyp.finish_reason == "eos":
                assert len(hyp.tokens) >= min_new_tokens
            if no_repeat_ngram_size:
                seq = h.prefix(i) + hyp.tokens
                grams = [tuple(seq[j : j + no_repeat_ngram_size]) for j in range(len(seq) - no_repeat_ngram_size + 1)]
                assert len(grams) == len(set(grams))


@pytest.mark.parametrize("kind", ["gpt2", "bart"])
@pytest.mark.parametrize(
    ("num_beams", "length_penalty", "early_stopping"),
    [(2, -0.5, "never"), (3, 0.0, "never"), (2, 1.0, True), (5, 1.5, False), (3, 0.6, True)],
)
def test_beam_other_widths_match_hf(harnesses, kind, num_beams, length_penalty, early_stopping):
    h = harnesses[kind]
    kw = dict(num_beams=num_beams, length_penalty=length_penalty, early_stopping=early_stopping,
              num_return_sequences=2)
    _assert_same(_beam(h, **kw), h.run_hf(**kw))


@pytest.mark.parametrize("kind", ["gpt2", "bart"])
def test_golden_setup_exercises_eos_and_length(harnesses, kind):
    """Guard against vacuous goldens: the models must produce both EOS-ended and length-ended hypotheses."""
    h = harnesses[kind]
    reasons = set()
    for es in (True, False, "never"):
        for hyps in _beam(h, num_beams=4, early_stopping=es, num_return_sequences=4):
            reasons.update(x.finish_reason for x in hyps)
    greedy = [GreedySearch(MAX_NEW, h.eos) for _ in h.inputs]
    h.run_ours(greedy)
    reasons.update(s.results()[0].finish_reason for s in greedy)
    assert reasons == {"eos", "length"}


# --- sampling filters vs HF logits processors (HF's torch RNG is not reproduced, so the draws are not compared) ---


def _random_logits(seed: int, shape=(6, 50)) -> np.ndarray:
    return (np.random.default_rng(seed).standard_normal(shape) * 3.0).astype(np.float32)


def _assert_same_filtered(ours: np.ndarray, hf: torch.Tensor) -> None:
    hf = hf.numpy()
    np.testing.assert_array_equal(np.isneginf(ours), np.isneginf(hf))  # same kept sets
    kept = ~np.isneginf(hf)
    assert kept.any(axis=-1).all()
    np.testing.assert_allclose(ours[kept], hf[kept], rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("top_k", [1, 2, 7, 50, 80])
def test_top_k_matches_hf(top_k):
    x = _random_logits(top_k)
    x[0, :4] = x[0, 10]  # ties at the boundary are all kept by both
    _assert_same_filtered(top_k_filter(x, top_k), transformers.TopKLogitsWarper(top_k)(None, torch.from_numpy(x)))


@pytest.mark.parametrize("min_tokens_to_keep", [1, 3])
@pytest.mark.parametrize("top_p", [1e-6, 0.1, 0.5, 0.9, 0.999])
def test_top_p_matches_hf(top_p, min_tokens_to_keep):
    x = _random_logits(int(top_p * 1000) + min_tokens_to_keep)
    x[1, 5:] = -np.inf  # already-filtered tokens (e.g. by top-k) stay removed
    hf = transformers.TopPLogitsWarper(top_p, min_tokens_to_keep=min_tokens_to_keep)(None, torch.from_numpy(x))
    _assert_same_filtered(top_p_filter(x, top_p, min_tokens_to_keep), hf)


@pytest.mark.parametrize("penalty", [0.5, 1.3, 2.0])
def test_repetition_penalty_matches_hf(penalty):
    x = _random_logits(7)
    ids = np.random.default_rng(8).integers(0, x.shape[1], size=(x.shape[0], 12))
    seen = np.zeros(x.shape, dtype=bool)
    np.put_along_axis(seen, ids, True, axis=1)
    hf = transformers.RepetitionPenaltyLogitsProcessor(penalty)(torch.from_numpy(ids), torch.from_numpy(x))
    _assert_same_filtered(apply_repetition_penalty(x, seen, penalty).astype(np.float32), hf)


@pytest.mark.parametrize("temperature", [0.3, 1.0, 1.7])
def test_temperature_matches_hf(temperature):
    x = _random_logits(9)
    hf = transformers.TemperatureLogitsWarper(temperature)(None, torch.from_numpy(x))
    _assert_same_filtered(apply_temperature(x, temperature), hf)


def _hf_sampling_processors(temperature, top_k, top_p, penalty, ngram=0, min_new_tokens=0, prompt_len=0, eos=1):
    """HF's processor list for generate(do_sample=True), in ``_get_logits_processor`` order."""
    procs = transformers.LogitsProcessorList()
    if penalty != 1.0:
        procs.append(transformers.RepetitionPenaltyLogitsProcessor(penalty))
    if ngram:
        procs.append(transformers.NoRepeatNGramLogitsProcessor(ngram))
    if min_new_tokens:
        procs.append(transformers.MinNewTokensLengthLogitsProcessor(prompt_len, min_new_tokens, eos))
    procs.append(transformers.TemperatureLogitsWarper(temperature))
    if top_k:
        procs.append(transformers.TopKLogitsWarper(top_k))
    if top_p < 1.0:
        procs.append(transformers.TopPLogitsWarper(top_p))
    return procs


@pytest.mark.parametrize(
    ("temperature", "top_k", "top_p", "penalty"), [(0.7, 10, 0.9, 1.2), (1.0, 0, 0.5, 1.0), (1.5, 5, 1.0, 0.8)]
)
def test_sampling_pipeline_matches_hf_processor_list(temperature, top_k, top_p, penalty):
    """SamplingSearch's processed logits == HF's processor list in generate()'s order on the same input_ids."""
    x = _random_logits(10, shape=(1, 50))
    prefix = [3, 4, 4, 17, 30]
    hf = _hf_sampling_processors(temperature, top_k, top_p, penalty)(torch.tensor([prefix]), torch.from_numpy(x))
    search = SamplingSearch(5, eos_token_id=1, temperature=temperature, top_k=top_k, top_p=top_p,
                            repetition_penalty=penalty, prefix=prefix, seed=0)
    ours = search.process_logits(x[0].astype(np.float64))[None, :].astype(np.float32)
    _assert_same_filtered(ours, hf)


@pytest.mark.parametrize("no_repeat_ngram_size", [1, 2, 3])
@pytest.mark.parametrize(
    ("temperature", "top_k", "top_p", "penalty", "min_new_tokens"),
    [(0.7, 10, 0.9, 1.2, 0), (1.0, 0, 0.5, 1.0, 3), (1.5, 5, 1.0, 0.8, 2), (1.0, 0, 1.0, 1.3, 0)],
)
def test_sampling_pipeline_with_no_repeat_ngram_matches_hf(temperature, top_k, top_p, penalty, min_new_tokens,
                                                           no_repeat_ngram_size):
    """Step by step, with the n-gram ban over prefix + generated tokens: processed logits == HF's processor list
    on the same input_ids. The logits favour a few tokens so the generated tokens keep completing n-grams."""
    v, eos, favoured = 50, 1, [4, 17, 30]
    prefix = [3, 4, 17, 30, 4, 4, 17, 4, 17]  # repeated n-grams of every size 1..3 in the prefix already
    procs = _hf_sampling_processors(temperature, top_k, top_p, penalty, ngram=no_repeat_ngram_size,
                                    min_new_tokens=min_new_tokens, prompt_len=len(prefix), eos=eos)
    search = SamplingSearch(8, eos_token_id=eos, temperature=temperature, top_k=top_k, top_p=top_p,
                            repetition_penalty=penalty, min_new_tokens=min_new_tokens, prefix=prefix, seed=0,
                            no_repeat_ngram_size=no_repeat_ngram_size)
    ban_only = transformers.NoRepeatNGramLogitsProcessor(no_repeat_ngram_size)
    ids, banned_favoured, step = list(prefix), 0, 0
    while not search.done:
        x = _random_logits(100 + step, shape=(1, v))
        x[0, favoured] += 8.0
        hf = procs(torch.tensor([ids]), torch.from_numpy(x))
        ours = search.process_logits(x[0].astype(np.float64))
        _assert_same_filtered(ours[None, :].astype(np.float32), hf)
        banned = np.isneginf(ban_only(torch.tensor([ids]), torch.zeros(1, v)).numpy()[0])
        banned_favoured += int(banned[favoured].sum())
        # drive the search: the best surviving token, forced by one-hot logits
        tok = int(np.argmax(ours))
        forced = np.zeros((1, v), dtype=np.float32)
        forced[0, tok] = 60.0
        res = search.step(forced)
        if not res.done:
            assert res.tokens.tolist() == [tok]
        ids.append(tok)
        step += 1
    # not vacuous: the sequence ran several steps and the ban hit a favoured (otherwise top) token every other step
    assert step >= 4 and banned_favoured >= step // 2
