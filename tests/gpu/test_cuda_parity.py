"""The three release models (model_repository/) on CUDA: every session of an engine built with
`RuntimeOptions(device="cuda")` runs on the CUDAExecutionProvider, and its outputs equal CPU float32's.

Tolerances, and why:
- ONNX Runtime's CUDA provider computes float32 MatMul/Gemm/Conv in TF32 by default (`use_tf32`, default true:
  onnxruntime/core/providers/cuda/cuda_execution_provider_info.h), and the engines keep that default: TF32 rounds
  each operand to 10 mantissa bits (unit roundoff 2^-11 ~ 4.9e-4, accumulation in float32). Through a model's
  6-9 layers of a few matmuls each, that compounds to ~1e-3 of the logits' scale; `TF32_RTOL` = 1e-2 of the row's
  largest |logit| leaves 10x that, and still fails any wrong kernel, layout or cache by orders of magnitude.
- With TF32 off (`STRICT_RTOL`, a raw session of the ViT's float32 graph with `use_tf32=0`), CUDA and CPU differ by
  summation order and the transcendental functions' rounding only (~1e-6 relative): 1e-3 of the largest |logit|.
- Greedy outputs: identical, or they part at a near-tie only: where they first differ, CPU's logits (log-probs, for
  the translator) of its own token and of CUDA's are within `NEAR_TIE` of each other (twice the tolerance, of the
  scale). Each test prints the
  deviations it measured (pytest -s, or the junit report's properties), so that a GPU run can tighten them.
"""

from __future__ import annotations

import numpy as np
import pytest

from service.decoding import GreedySearch
from service.engines.runtime import CPU, CUDA, RuntimeOptions
from service.repository import ModelRepository
from tests.support import ROOT

pytestmark = pytest.mark.gpu

REPOSITORY = ROOT / "model_repository"
TF32_RTOL = 1e-2  # of the row's largest |logit|: TF32 matmuls (above)
STRICT_RTOL = 1e-3  # float32 without TF32: summation order only
NEAR_TIE = 2 * TF32_RTOL  # of the largest |logit| at the step where greedy outputs part
VARIANT = "fp32"  # the parity variant: float32 MatMuls on both devices (the stored graphs hold int8 or fp16 weights)
PROMPTS = 6  # GPT prompts of PROMPT_CHARS characters from the validation text
PROMPT_CHARS = 48
NEW_TOKENS = 32
SENTENCES = 6  # Multi30k validation sentences
IMAGES = 32  # Fashion-MNIST test images


def engine(kind: str, device: str, weights: str | None = VARIANT):
    from service.engines.gpt import GPTEngine
    from service.engines.translation import TranslationEngine
    from service.engines.vit import ViTEngine

    cls = {"gpt": GPTEngine, "translation": TranslationEngine, "vit": ViTEngine}[kind]
    return cls(ModelRepository(REPOSITORY).get(kind), RuntimeOptions(device=device, weights=weights))


def sessions(built) -> list:
    return [s for s in (getattr(built, name, None) for name in ("session", "encoder", "decoder")) if s is not None]


def max_deviation(cuda: np.ndarray, cpu: np.ndarray) -> float:
    """max |cuda - cpu| as a fraction of the largest |cpu| (per row's scale: the whole array's, at least 1)."""
    return float(np.max(np.abs(cuda - cpu)) / max(1.0, float(np.max(np.abs(cpu)))))


@pytest.fixture(scope="module")
def engines():
    """{kind: (cuda engine, cpu engine)} in float32, built once (the translator's derivation takes seconds)."""
    return {kind: (engine(kind, "cuda"), engine(kind, "cpu")) for kind in ("gpt", "translation", "vit")}


@pytest.mark.parametrize("weights", [None, VARIANT], ids=["stored", VARIANT])
@pytest.mark.parametrize("kind", ["gpt", "translation", "vit"])
def test_every_session_runs_on_cuda(kind, weights):
    built = engine(kind, "cuda", weights)
    assert built.provider == CUDA
    providers = [s.get_providers() for s in sessions(built)]
    assert providers and all(p[0] == CUDA for p in providers), providers


def test_vit_logits_equal_cpu_float32(engines, data_dir, record_property):
    from models.data import load_fashion_mnist

    cuda, cpu = engines["vit"]
    images, _ = load_fashion_mnist(data_dir, "test")
    batch = cpu.normalize(images[:IMAGES, None].astype(np.float32) / 255.0)  # (B, 1, 28, 28)
    a, b = cuda.logits(batch), cpu.logits(batch)
    deviation = max_deviation(a, b)
    record_property("vit_tf32_deviation", deviation)
    print(f"vit: max |cuda - cpu| = {deviation:.2e} of the largest |logit|")
    assert deviation <= TF32_RTOL
    assert (a.argmax(-1) == b.argmax(-1)).all()


def test_vit_without_tf32_equals_cpu_strictly(engines, data_dir, record_property):
    """A raw session of the same float32 graph with TF32 off: only summation order may differ."""
    import onnxruntime as ort

    from models.data import load_fashion_mnist
    from service.engines import onnx_schema as schema
    from service.engines.weights import derive

    model = ModelRepository(REPOSITORY).get("vit")
    path = model.path / model.config["files"]["model"]
    graph = derive(path, VARIANT) or path.read_bytes()
    strict = ort.InferenceSession(graph, providers=[(CUDA, {"use_tf32": "0"}), CPU])
    reference = ort.InferenceSession(graph, providers=[CPU])
    assert strict.get_providers()[0] == CUDA
    images, _ = load_fashion_mnist(data_dir, "test")
    batch = engines["vit"][1].normalize(images[:IMAGES, None].astype(np.float32) / 255.0)
    feeds = {schema.PIXEL_VALUES: batch}
    deviation = max_deviation(strict.run(None, feeds)[0], reference.run(None, feeds)[0])
    record_property("vit_strict_deviation", deviation)
    print(f"vit, TF32 off: max |cuda - cpu| = {deviation:.2e} of the largest |logit|")
    assert deviation <= STRICT_RTOL


def gpt_prompts(data_dir, tokenizer) -> list[list[int]]:
    from models.data import load_shakespeare

    _, val = load_shakespeare(data_dir)
    starts = np.linspace(0, len(val) - 2 * PROMPT_CHARS, PROMPTS).astype(int)
    return [tokenizer.encode(val[s : s + PROMPT_CHARS]).ids for s in starts]


def test_gpt_prompt_logits_equal_cpu_float32(engines, data_dir, record_property):
    cuda, cpu = engines["gpt"]
    prompts = gpt_prompts(data_dir, cpu.tokenizer)
    rows = range(len(prompts))
    _, _, every_cuda = cuda.prefill_positions(prompts, rows)
    _, _, every_cpu = cpu.prefill_positions(prompts, rows)
    deviation = max(max_deviation(every_cuda[row], every_cpu[row]) for row in rows)
    record_property("gpt_tf32_deviation", deviation)
    print(f"gpt prompt pass: max |cuda - cpu| = {deviation:.2e} of the largest |logit|")
    assert deviation <= TF32_RTOL


def test_gpt_greedy_texts_equal_cpu_or_part_at_a_near_tie(engines, data_dir):
    cuda, cpu = engines["gpt"]
    prompts = gpt_prompts(data_dir, cpu.tokenizer)

    def greedy(built) -> list[list[int]]:
        return [s.results()[0].tokens for s in built.generate(prompts, lambda _: GreedySearch(NEW_TOKENS, None))]

    for prompt, a, b in zip(prompts, greedy(cuda), greedy(cpu)):
        if a == b:
            continue
        t = next(i for i, (x, y) in enumerate(zip(a, b)) if x != y)
        logits, _ = cpu.prefill([prompt + b[:t]])  # CPU's logits where the two part
        gap = float(logits[0, b[t]] - logits[0, a[t]])
        scale = max(1.0, float(np.abs(logits).max()))
        print(f"gpt greedy: outputs part at token {t}: CPU's logits {gap:.2e} apart ({gap / scale:.2e} of scale)")
        assert gap <= NEAR_TIE * scale, (cpu.tokenizer.decode(a), cpu.tokenizer.decode(b))


def test_translation_scores_and_greedy_outputs_equal_cpu_float32(engines, data_dir, record_property):
    from models.data import load_multi30k

    cuda, cpu = engines["translation"]
    pairs = load_multi30k(data_dir, "val")[:SENTENCES]
    sources = [cpu.source_ids(de) for de, _ in pairs]
    targets = [cpu.tokenizer.encode(en).ids for _, en in pairs]
    rows = list(range(len(sources)))
    scored = zip(cuda.score_ids(sources, targets, rows), cpu.score_ids(sources, targets, rows))
    deviation = max(max_deviation(a, b) for a, b in scored)  # log-probs (nats), of the largest |log-prob|
    record_property("translation_logprob_deviation", deviation)
    print(f"translation forced decoding: max |cuda - cpu| log-prob = {deviation:.2e} of the largest")
    assert deviation <= TF32_RTOL

    def greedy(built) -> list[list[int]]:
        searches = built.translate_ids(sources, lambda _: GreedySearch(cpu.max_target_length, cpu.eos_id))
        return [s.results()[0].tokens for s in searches]

    for row, (a, b) in enumerate(zip(greedy(cuda), greedy(cpu))):
        if a == b:
            continue
        t = next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)) - 1)
        own, theirs = (cpu.score_ids([sources[row]], [tokens[: t + 1]], [0])[0][t] for tokens in (b, a))
        print(f"translation greedy {row}: outputs part at token {t}, CPU log-probs {own - theirs:.2e} apart")
        assert own - theirs <= NEAR_TIE * max(1.0, abs(theirs)), (cpu.tokenizer.decode(a), cpu.tokenizer.decode(b))
