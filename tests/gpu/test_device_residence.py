"""The KV cache resident in GPU memory (`service.engines.device_cache`) under the CUDA provider: the released GPT
and translator keep every key/value tensor on the GPU from the prompt pass to the last step, bind no KV byte in host
memory (counted, `HostTransfers`), and decode exactly what the same CUDA kernels decode over a host cache copied in
every step (the same graphs on the same device: only where the cache lives differs)."""

from __future__ import annotations

import numpy as np
import pytest

from service.engines.gpt import GPTEngine
from service.engines.runtime import CUDA, RuntimeOptions
from service.engines.translation import TranslationEngine
from service.repository import ModelRepository
from tests.support import ROOT

pytestmark = pytest.mark.gpu

RELEASE = ROOT / "model_repository"
STEPS = 48
ROWS = 8
# the same kernels on the same inputs; cuBLAS may still pick another algorithm for buffers at other addresses
# (alignment), which reassociates float32 sums: ~1e-6 relative on logits of magnitude ~10-20
LOGITS_ATOL = 1e-4


def _greedy(engine, state, first, step_kwargs):
    """STEPS greedy steps, the rows swapping halfway -> every step's logits."""
    logits = first.logits if step_kwargs else first
    seen, tokens = [logits], logits.argmax(-1)
    for step in range(STEPS):
        if step == STEPS // 2:
            order = np.roll(np.arange(len(tokens)), 1)
            state, tokens = engine.select(state, order), tokens[order]
        out = engine.step(state, tokens, **step_kwargs)
        logits = out.logits if step_kwargs else out
        seen.append(logits)
        tokens = logits.argmax(-1)
    return seen, state


def _assert_same_decoding(host: list[np.ndarray], device: list[np.ndarray]) -> None:
    assert len(host) == len(device) == STEPS + 1
    for want, got in zip(host, device):
        np.testing.assert_allclose(got, want, rtol=0, atol=LOGITS_ATOL)
        np.testing.assert_array_equal(got.argmax(-1), want.argmax(-1))


def test_the_gpt_keeps_its_cache_on_the_gpu_and_binds_no_kv_byte_on_the_host():
    model = ModelRepository(RELEASE).get("gpt")
    engines = {r: GPTEngine(model, RuntimeOptions(device="cuda", kv_residence=r)) for r in ("auto", "host")}
    assert engines["auto"].provider == CUDA and engines["auto"].kv_residence == "device"
    prompts = [list(f"ROMEO {i}:".encode()) for i in range(ROWS)]
    runs = {}
    for residence, engine in engines.items():
        first, cache = engine.prefill(prompts)
        runs[residence], cache = _greedy(engine, cache, first, {})
        if residence == "auto":
            assert {t.device_name().lower() for t in cache.tensors} == {"cuda"}
    _assert_same_decoding(runs["host"], runs["auto"])
    moved, host = engines["auto"].transfers, engines["host"].transfers
    assert moved.steps == STEPS and moved.kv_bytes == 0
    assert host.kv_bytes > 100 * moved.other_bytes  # what a host cache costs each step: all of it, both ways


def test_the_translator_keeps_its_cache_and_sources_on_the_gpu():
    model = ModelRepository(RELEASE).get("translation")
    engines = {r: TranslationEngine(model, RuntimeOptions(device="cuda", kv_residence=r)) for r in ("auto", "host")}
    assert engines["auto"].kv_residence == "device"
    sources = [engines["auto"].source_ids(t) for t in ["Ein Mann fährt Fahrrad.", "Zwei Hunde spielen im Schnee."]]
    runs = {}
    for residence, engine in engines.items():
        first, batch = engine.prefill(sources, candidates=4)
        runs[residence], batch = _greedy(engine, batch, first, {"candidates": 4})
        if residence == "auto":
            assert {t.device_name().lower() for t in (*batch.cache.tensors, *batch.encoded.cross)} == {"cuda"}
    _assert_same_decoding(runs["host"], runs["auto"])
    assert engines["auto"].transfers.kv_bytes == 0
