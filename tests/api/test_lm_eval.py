"""lm-evaluation-harness as the acceptance test: the real `lm_eval` CLI (`local-completions`, the server's own
tokenizer through `tokenizer_backend=remote`, no local tokenizer file, nothing from a hub) scores the tiny GPT on a
multiple-choice task and a perplexity task (`loglikelihood_rolling`), both local YAML files with local data
(tests/fixtures/lm_eval). lm-eval's requests are `/tokenize` for every text and `/v1/completions` with the ids,
`echo`, `logprobs: 1` and `max_tokens: 1` for every (context, continuation).

Its numbers are checked against the graph itself: every log-likelihood it logs (each choice's, each speech's) is
the sum of the continuation's log-probabilities in one full forward pass of the tiny GPT's ONNX graph here, over
the windows lm-eval's own windowing makes (`lm_eval.utils.get_rolling_token_windows`), and every `is_greedy` says
whether each continuation token was the graph's most likely one.

`export.verify_served`'s GPT check scores the validation text over the same kind of windows (with `max_tokens` 0, a
whole context each): its windows are checked against lm-eval's function, and its figure against the model card.
"""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from export.verify_served import rolling_windows, verify_gpt
from service.engines import onnx_schema as schema
from service.engines.gpt import GPTEngine
from service.engines.kv_cache import KVCache
from service.engines.runtime import RuntimeOptions
from service.repository import ModelRepository
from tests.support import ROOT

pytestmark = pytest.mark.slow

TASKS_DIR = ROOT / "tests" / "fixtures" / "lm_eval"
MULTIPLE_CHOICE, PERPLEXITY = "shakespeare_word_order", "shakespeare_speeches"
# A log-likelihood summed over a continuation's tokens: the server's prompt pass against the full forward pass here
# (same graph, same ids; ONNX Runtime may group its float32 reductions differently with other threads), per token.
TOLERANCE_PER_TOKEN = 1e-5
RUN_TIMEOUT_S = 600
OFFLINE = {"HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1"}


@pytest.fixture(scope="module")
def server(server_factory):
    with server_factory("lm-eval server", models='["gpt"]') as process:
        yield process


@pytest.fixture(scope="module")
def engine(tiny_repository) -> GPTEngine:
    """The server's tiny GPT, loaded here too: the reference."""
    return GPTEngine(ModelRepository(tiny_repository).get("gpt"), RuntimeOptions(intra_op_threads=1))


@pytest.fixture(scope="module")
def run(server, engine, tmp_path_factory) -> dict:
    """`lm_eval` run once on both tasks against the server: {"results": ..., "samples": {task: [sample, ...]}}."""
    out, home = tmp_path_factory.mktemp("lm-eval-out"), tmp_path_factory.mktemp("lm-eval-home")
    model_args = (f"model=gpt,base_url={server.url}/v1/completions,tokenizer_backend=remote,"
                  f"max_length={engine.context_length},max_retries=1,timeout=60")
    command = [str(Path(sys.executable).parent / "lm_eval"), "run", "--model", "local-completions",
               "--model_args", model_args, "--tasks", f"{MULTIPLE_CHOICE},{PERPLEXITY}", "--include_path", ".",
               "--batch_size", "1", "--output_path", str(out), "--log_samples"]
    env = {**os.environ, **OFFLINE, "HF_HOME": str(home)}  # no hub, and a datasets cache of its own
    done = subprocess.run(command, cwd=TASKS_DIR, env=env, capture_output=True, text=True, timeout=RUN_TIMEOUT_S)
    assert done.returncode == 0, f"lm_eval failed:\n{done.stdout[-4000:]}\n{done.stderr[-8000:]}"
    (results_file,) = out.glob("*/results_*.json")
    samples = {task: [json.loads(line) for line in next(out.glob(f"*/samples_{task}_*.jsonl")).read_text().splitlines()]
               for task in (MULTIPLE_CHOICE, PERPLEXITY)}
    return {"results": json.loads(results_file.read_text())["results"], "samples": samples}


def _log_probs(engine: GPTEngine, ids: list[int]) -> tuple[np.ndarray, np.ndarray]:
    """One full forward pass over `ids` (no cache, no batch): (log p(ids[i+1] | ids[:i+1]), whether ids[i+1] was
    the most likely token) for every i."""
    n = len(ids)
    feeds = {schema.INPUT_IDS: np.asarray([ids], np.int64), schema.POSITION_IDS: np.arange(n, dtype=np.int64)[None],
             schema.ATTENTION_MASK: np.ones((1, n), np.int64),
             **KVCache.empty(1, engine.n_layers, engine.n_heads, engine.head_dim).feeds()}
    logits = engine.session.run([schema.LOGITS], feeds)[0][0, :-1].astype(np.float64)  # (n - 1, V)
    peak = logits.max(axis=-1)
    log_norm = np.log(np.exp(logits - peak[:, None]).sum(axis=-1)) + peak
    chosen = logits[np.arange(n - 1), ids[1:]]
    return chosen - log_norm, chosen == peak


def _continuation(engine: GPTEngine, context: list[int], continuation: list[int]) -> tuple[float, bool]:
    """(log-likelihood, is_greedy) of `continuation` after `context`, as lm-eval defines them."""
    log_probs, greedy = _log_probs(engine, context + continuation)
    return float(log_probs[len(context) - 1:].sum()), bool(greedy[len(context) - 1:].all())


def test_lm_eval_runs_both_tasks_to_the_end(run):
    results = run["results"]
    assert 0.0 <= results[MULTIPLE_CHOICE]["acc,none"] <= 1.0 and len(run["samples"][MULTIPLE_CHOICE]) == 8
    speeches = results[PERPLEXITY]
    assert len(run["samples"][PERPLEXITY]) == 3
    assert 1.0 < speeches["byte_perplexity,none"] < 257.0  # between certainty and the uniform byte distribution
    assert speeches["bits_per_byte,none"] == pytest.approx(math.log2(speeches["byte_perplexity,none"]))


def test_each_choices_log_likelihood_is_the_graphs(run, engine):
    tokenizer = engine.tokenizer
    for sample in run["samples"][MULTIPLE_CHOICE]:
        doc = sample["doc"]
        context = tokenizer.encode(doc["context"]).ids
        for choice, (log_likelihood, greedy) in zip(doc["choices"], sample["filtered_resps"]):
            whole = tokenizer.encode(f"{doc['context']} {choice}").ids  # lm-eval's target delimiter: a space
            expected, expected_greedy = _continuation(engine, context, whole[len(context):])
            assert float(log_likelihood) == pytest.approx(expected, abs=TOLERANCE_PER_TOKEN * len(whole)), choice
            assert greedy == str(expected_greedy)
        best = int(np.argmax([float(ll) for ll, _ in sample["filtered_resps"]]))
        assert sample["acc"] == float(best == doc["label"])


def test_each_speechs_rolling_log_likelihood_is_the_graphs_over_lm_evals_windows(run, engine):
    from lm_eval.utils import get_rolling_token_windows, make_disjoint_window

    for sample in run["samples"][PERPLEXITY]:
        ids = engine.tokenizer.encode(sample["doc"]["text"]).ids
        assert len(ids) > engine.context_length  # more than one window
        # local-completions: max_length - 1 tokens a request (one is generated), one of them the window's context
        windows = [make_disjoint_window(w) for w in get_rolling_token_windows(
            ids, prefix_token=engine.eos_id, max_seq_len=engine.context_length - 2, context_len=1)]
        assert sum(len(continuation) for _, continuation in windows) == len(ids)  # every token scored once
        expected = sum(_continuation(engine, context, continuation)[0] for context, continuation in windows)
        (log_likelihood,) = sample["filtered_resps"]
        assert float(log_likelihood) == pytest.approx(expected, abs=TOLERANCE_PER_TOKEN * len(ids))


@pytest.mark.parametrize("n_tokens,context", [(1, 4), (3, 4), (4, 4), (10, 4), (11, 64), (500, 64), (63, 64), (64, 64)])
def test_verify_served_windows_are_lm_evals(n_tokens, context):
    from lm_eval.utils import get_rolling_token_windows, make_disjoint_window

    ids = list(range(1, n_tokens + 1))
    sequence = [0] + ids  # the prefix token, then the text's
    theirs = [make_disjoint_window(w) for w in get_rolling_token_windows(ids, 0, context - 1, 1)]
    ours = rolling_windows(n_tokens, context)
    assert [(sequence[begin:end], scored) for begin, end, scored in ours] == \
        [(window_context + continuation, len(continuation)) for window_context, continuation in theirs]
    assert all(end - begin <= context for begin, end, _ in ours)


def test_verify_served_gives_the_cards_nats_per_character(server, tiny_repository, data_dir):
    card = json.loads((tiny_repository / "gpt" / "1" / "metrics.json").read_text())
    result = verify_gpt(server.url, card, data_dir)
    assert result["ok"] and abs(result["delta"]) <= result["tolerance"], result
    assert result["tokens"] == result["characters"] == card["val_tokens"]  # byte tokens of ASCII text
    worse = verify_gpt(server.url, {**card, "val_loss": card["val_loss"] - 2 * result["tolerance"]}, data_dir)
    assert not worse["ok"] and worse["served"] == result["served"]
