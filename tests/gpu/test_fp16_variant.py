"""The float16 variants on CUDA against float32 on the CPU (`service.engines.float16`), on the release GPT and
translator: the logits of every greedy step within `logits_tolerance` (float16's rounding through the layers), and
the greedy texts of the golden prompts identical, or the first difference explained: at that step float32's own two
candidates were within twice that tolerance of each other (a near-tie that float16's rounding may order either way).
`fp16+gqa` is held to the same on the GPT's step graph. No export-time check runs these variants' CUDA kernels."""

from __future__ import annotations

import numpy as np
import onnxruntime as ort
import pytest

from service.engines.float16 import logits_tolerance
from service.engines.gpt import GPTEngine
from service.engines.runtime import CUDA, RuntimeOptions
from service.engines.translation import TranslationEngine
from service.repository import ModelRepository
from tests.support import ROOT

pytestmark = pytest.mark.gpu

if CUDA not in ort.get_available_providers():
    pytest.skip(f"needs a CUDA GPU: this onnxruntime has no {CUDA} (install onnxruntime-gpu)", allow_module_level=True)

GPT_PROMPTS = ["JULIET:\nO Romeo, Romeo", "ROMEO:\n", "First Citizen:\nBefore we proceed any further"]
SOURCES = ["Ein Mann fährt mit dem Fahrrad durch die Stadt.", "Zwei Hunde spielen im Schnee.",
           "Eine Frau in einem roten Kleid singt auf einer Bühne.", "Kinder spielen am Strand."]
STEPS = 48  # greedy tokens per prompt
NEAR_TIE = 2  # a first difference is explained where float32's two candidates are this many tolerances apart or less


@pytest.fixture(scope="module")
def repository():
    return ModelRepository(ROOT / "model_repository")


def _greedy(engine, first, eos_id: int) -> tuple[list[int], list[np.ndarray]]:
    """One row's greedy tokens (to `eos_id` or `STEPS`) and the logits each was chosen from."""
    logits, state = first
    tokens, seen = [], []
    for _ in range(STEPS):
        seen.append(np.asarray(logits[0], np.float64))
        token = int(seen[-1].argmax())
        tokens.append(token)
        if token == eos_id:
            break
        logits = engine.step(state, np.array([token], np.int64))
    return tokens, seen


def _compare(reference: tuple[list[int], list[np.ndarray]], half: tuple[list[int], list[np.ndarray]],
             n_layers: int, label: str) -> None:
    """Logits within the tolerance over the common steps; the tokens identical up to where both stop, or the first
    difference at a near-tie of float32's logits."""
    (ref_tokens, ref_logits), (tokens, logits) = reference, half
    for step, (a, b) in enumerate(zip(ref_logits, logits)):
        tolerance = logits_tolerance(n_layers, np.abs(a).max())
        assert np.abs(a - b).max() <= tolerance, f"{label}: step {step}: |dlogits| {np.abs(a - b).max():.4g} > " \
                                                 f"{tolerance:.4g}"
        if ref_tokens[step] != tokens[step]:  # the rest follows another prefix: compared no further
            margin = a[ref_tokens[step]] - a[tokens[step]]
            assert margin <= NEAR_TIE * tolerance, f"{label}: step {step}: float16 chose {tokens[step]} over " \
                                                   f"float32's {ref_tokens[step]} by a margin of {margin:.4g}"
            return
    assert ref_tokens == tokens, label


@pytest.mark.parametrize("variant", ["fp16", "fp16+gqa"])
def test_the_gpt_in_float16_on_cuda_answers_as_float32_on_the_cpu(repository, variant):
    model = repository.get("gpt")
    reference = GPTEngine(model, RuntimeOptions(device="cpu", weights="fp32"))
    half = GPTEngine(model, RuntimeOptions(device="cuda", weights=variant))
    assert half.provider == CUDA
    for prompt in GPT_PROMPTS:
        ids = reference.tokenizer.encode(prompt).ids
        _compare(_greedy(reference, reference.prefill([ids]), reference.eos_id),
                 _greedy(half, half.prefill([ids]), half.eos_id), model.config["architecture"]["n_layers"],
                 f"gpt {variant} {prompt!r}")


def test_the_translator_in_float16_on_cuda_answers_as_float32_on_the_cpu(repository):
    model = repository.get("translation")
    reference = TranslationEngine(model, RuntimeOptions(device="cpu", weights="fp32"))
    half = TranslationEngine(model, RuntimeOptions(device="cuda", weights="fp16"))
    assert half.provider == CUDA
    arch = model.config["architecture"]  # the logits go through both stacks' roundings
    layers = arch["n_encoder_layers"] + arch["n_decoder_layers"]
    for source in SOURCES:
        ids = reference.source_ids(source)
        _compare(_greedy(reference, reference.prefill([ids]), reference.eos_id),
                 _greedy(half, half.prefill([ids]), half.eos_id), layers, f"translation fp16 {source!r}")
