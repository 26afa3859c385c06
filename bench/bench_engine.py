"""Engine benchmark: our ONNX Runtime decoding engine vs Hugging Face transformers, Optimum and ONNX Runtime GenAI,
on CPU, and our GPT engine's scaling with the batch against an fp32 matmul roofline.

What is compared, on same-size models with random weights (nothing is downloaded: every model is built from a
config, and the Optimum models are exported locally into --workdir):

- GPT (decoder-only), greedy, a 16-token prompt and exactly 128 new tokens, at batch 1 and batch 16 -> tokens/s.
  d_model 256, 4 layers, 4 heads, d_ff 1024, vocab 512, context 256 (`GPT2LMHeadModel` for the baselines).
- Translation (encoder-decoder), beam search with 4 beams, batch 1, sources of ~15 tokens (Multi30k length) and
  exactly 30 new tokens -> sentences/s. d_model 256, 3+3 layers, 4 heads, d_ff 1024, vocab 8,000
  (`MarianMTModel` for the baselines).

Systems (one function each, `run_<system>_<task>`):
- transformers: PyTorch `model.generate()`;
- optimum: `optimum.onnxruntime.ORTModelForCausalLM` / `ORTModelForSeq2SeqLM` (their own `generate()`);
- genai (GPT only): `onnxruntime_genai` (`Generator`, greedy) running OUR exported GPT graph, the very
  `decoder.onnx` our engine loads, unchanged, through a generated `genai_config.json` (bench/genai_system.py). Same
  graph and weights as ours, so its tokens must equal ours: the harness checks and reports it. It runs in this
  process (its wheel uses the installed onnxruntime package), timed and interleaved like the others;
- ours: `service.engines.gpt.GPTEngine` / `service.engines.translation.TranslationEngine` with the searches of
  `service.decoding`, on our own from-scratch models (`models.gpt.GPT`, `models.transformer`; same sizes,
  random weights) exported by `export.onnx_export`.

Fairness rules:
- Every system generates exactly the same number of tokens: EOS is never chosen because every system gets
  `min_new_tokens == max_new_tokens` (HF/Optimum: the `MinNewTokensLengthLogitsProcessor` masks EOS until the
  last step; ours: the searches' `min_new_tokens`). The harness checks the output shapes.
- One thread count for all (`--threads`, default 2): `torch.set_num_threads` and every ONNX Runtime session's
  `intra_op_num_threads` (inter-op 1), and one spin policy: idle threads sleep instead of busy-waiting (torch:
  OMP_WAIT_POLICY=PASSIVE; ONNX Runtime: allow_spinning=0) unless --spin. See `Runtime`.
- Each system is warmed up before timing; the timed repeats are interleaved round-robin across systems (so a
  background load drifting over time hits them all alike) and the median is reported. Time includes the prompt
  pass (prefill / encoder), not the model build or export. Tokens/s counts generated tokens only.
- Compare ratios from one run, never absolute numbers from different runs: this machine is shared.

Scaling table (task `scaling`): our GPT engine at batch 1, 8, 16, 32, 64, 128 (--scaling-batches) on the release
GPT's shape (models/config.py, preset gpt/release: d_model 256, 4 layers, 4 heads, d_ff 1024, vocab 257, context
256; random weights), same prompt and new tokens as above, next to its fp32 roofline measured in the same run: the
matmuls of one decoding step at that batch (per layer the q, k, v and attention-output projections and the two
MLP matmuls, then the tied LM head; the model's nn.Linear shapes and op, F.linear, bias included) timed in torch
with the same threads, `new_tokens` steps per pass, interleaved with ours and converted to tokens/s
(batch * new_tokens / median seconds). Printed: tokens/s of both and ours' fraction of the roofline (= the time
torch needs for the step's matmuls / the time our whole step takes). The roofline leaves out the prompt pass,
attention over the cache, LayerNorm, GELU, the search and everything else. It is torch's (MKL's) matmul speed, not
a hardware bound: at small batches (8-16 rows) ONNX Runtime's own MatMul kernels (MLAS) can beat it, and the
fraction then comes out near or above 1.

Run (in the benchmark venv, which has Optimum; see bench/requirements.txt):
    .venv-bench/bin/python bench/bench_engine.py --quick          # smoke run, 1-2 minutes once exports are cached
    .venv-bench/bin/python bench/bench_engine.py                  # full run, writes reports/bench_engine.json
Options: --threads N, --spin, --repeats N, --warmup N, --sentences N, --gpt-batches 1,16,
--scaling-batches 1,8,16,32,64,128, --tasks gpt,translation,scaling, --systems transformers,optimum,genai,ours,
--out PATH, --workdir PATH. A system whose package is missing (e.g. Optimum in the main venv) or that does not
apply to a task (genai: translation) is reported as skipped, with the reason.
"""

from __future__ import annotations

import os

# Nothing may come from the Hugging Face hub: every model here is built locally from a config.
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

import argparse
import hashlib
import json
import logging
import platform
import statistics
import sys
import time
import warnings
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path

import numpy as np

# A generate function: input ids (B, S) int64 -> the generated tokens only (B, new_tokens) int64.
# GPT: the prompts; translation: the source sentences (the best beam is returned).
GenerateFn = Callable[[np.ndarray], np.ndarray]

PAD_ID, BOS_ID, EOS_ID = 0, 1, 2  # the same special ids in every model here; sources/prompts never contain them
FIRST_REGULAR_ID = 3


# ----------------------------------------------------------------------------------------------------------------
# Workloads


@dataclass(frozen=True)
class GptSpec:
    vocab_size: int = 512
    d_model: int = 256
    n_layers: int = 4
    n_heads: int = 4
    d_ff: int = 1024
    context_length: int = 256
    prompt_tokens: int = 16
    new_tokens: int = 128


@dataclass(frozen=True)
class TranslationSpec:
    vocab_size: int = 8000
    d_model: int = 256
    n_encoder_layers: int = 3
    n_decoder_layers: int = 3
    n_heads: int = 4
    d_ff: int = 1024
    max_positions: int = 256
    num_beams: int = 4
    new_tokens: int = 30
    source_min: int = 11  # source lengths (tokens, EOS included) are drawn uniformly from [min, max]: mean 15
    source_max: int = 19


def make_prompts(spec: GptSpec, batch: int, seed: int = 0) -> np.ndarray:
    """(batch, prompt_tokens) int64 of regular ids: equal lengths, so no padding is involved."""
    rng = np.random.default_rng(seed)
    return rng.integers(FIRST_REGULAR_ID, spec.vocab_size, size=(batch, spec.prompt_tokens), dtype=np.int64)


def make_sources(spec: TranslationSpec, count: int, seed: int = 1) -> list[np.ndarray]:
    """`count` source sentences, each (1, length) int64 ending in EOS (as a tokenizer would produce them)."""
    rng = np.random.default_rng(seed)
    sources = []
    for _ in range(count):
        length = int(rng.integers(spec.source_min, spec.source_max + 1))
        ids = rng.integers(FIRST_REGULAR_ID, spec.vocab_size, size=length - 1, dtype=np.int64)
        sources.append(np.concatenate([ids, [EOS_ID]]).astype(np.int64)[None, :])
    return sources


# ----------------------------------------------------------------------------------------------------------------
# Hugging Face models (shared by the transformers and Optimum baselines: same config, same random weights)


def _seed_torch(seed: int) -> None:
    import torch

    torch.manual_seed(seed)


def hf_gpt_model(spec: GptSpec):
    import transformers

    config = transformers.GPT2Config(
        vocab_size=spec.vocab_size, n_positions=spec.context_length, n_embd=spec.d_model, n_layer=spec.n_layers,
        n_head=spec.n_heads, n_inner=spec.d_ff, activation_function="gelu",
        resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0,
        bos_token_id=BOS_ID, eos_token_id=EOS_ID, pad_token_id=PAD_ID,
    )
    _seed_torch(0)
    return transformers.GPT2LMHeadModel(config).eval()


def hf_translation_model(spec: TranslationSpec):
    import transformers

    config = transformers.MarianConfig(
        vocab_size=spec.vocab_size, d_model=spec.d_model,
        encoder_layers=spec.n_encoder_layers, decoder_layers=spec.n_decoder_layers,
        encoder_attention_heads=spec.n_heads, decoder_attention_heads=spec.n_heads,
        encoder_ffn_dim=spec.d_ff, decoder_ffn_dim=spec.d_ff, activation_function="relu",
        max_position_embeddings=spec.max_positions, dropout=0.0, attention_dropout=0.0, activation_dropout=0.0,
        pad_token_id=PAD_ID, bos_token_id=BOS_ID, eos_token_id=EOS_ID, decoder_start_token_id=BOS_ID,
        forced_eos_token_id=None, share_encoder_decoder_embeddings=True, tie_word_embeddings=True,
    )
    _seed_torch(0)
    return transformers.MarianMTModel(config).eval()


def gpt_generation_config(spec: GptSpec):
    """Greedy, exactly `new_tokens` tokens: min_new_tokens == max_new_tokens keeps EOS masked every step."""
    import transformers

    return transformers.GenerationConfig(
        do_sample=False, num_beams=1, max_new_tokens=spec.new_tokens, min_new_tokens=spec.new_tokens,
        eos_token_id=EOS_ID, pad_token_id=PAD_ID, bos_token_id=BOS_ID, use_cache=True,
    )


def translation_generation_config(spec: TranslationSpec):
    """Beam search, exactly `new_tokens` tokens (EOS masked until the last step), length_penalty 1, 1 result."""
    import transformers

    return transformers.GenerationConfig(
        do_sample=False, num_beams=spec.num_beams, num_return_sequences=1, length_penalty=1.0,
        early_stopping=False, max_new_tokens=spec.new_tokens, min_new_tokens=spec.new_tokens,
        eos_token_id=EOS_ID, pad_token_id=PAD_ID, bos_token_id=BOS_ID, decoder_start_token_id=BOS_ID,
        forced_eos_token_id=None, use_cache=True,
    )


def _spec_dir(workdir: Path, name: str, spec) -> Path:
    key = hashlib.sha1(json.dumps(asdict(spec), sort_keys=True).encode()).hexdigest()[:10]
    return workdir / f"{name}-{key}"


@dataclass(frozen=True)
class Runtime:
    """Thread settings shared by every system: `threads` intra-op threads (inter-op 1) for torch and every ONNX
    Runtime session, and whether idle worker threads spin (busy-wait) or sleep. `spin=False` (the default, see
    --spin) sets OMP_WAIT_POLICY=PASSIVE for torch's OpenMP pool (done in `main` before torch is imported) and
    `session.intra_op.allow_spinning=0` for ONNX Runtime: on a machine whose cores are shared with other jobs,
    spinning threads wait for a descheduled sibling at every op and torch drops ~50x (measured: 14 vs 884 tok/s)."""

    threads: int = 2
    spin: bool = False

    def session_options(self):
        """The `onnxruntime.SessionOptions` every ONNX Runtime system must use (ours included)."""
        import onnxruntime as ort

        options = ort.SessionOptions()
        options.intra_op_num_threads = self.threads
        options.inter_op_num_threads = 1
        options.graph_optimization_level = ort.GraphOptimizationLevel.ORT_ENABLE_ALL
        options.log_severity_level = 3
        spin = "1" if self.spin else "0"
        options.add_session_config_entry("session.intra_op.allow_spinning", spin)
        options.add_session_config_entry("session.inter_op.allow_spinning", spin)
        return options


def _optimum_export(model, onnx_dir: Path, task: str) -> Path:
    """Save `model` (random weights) and export it with Optimum's exporter, once per spec (cached in onnx_dir)."""
    done = onnx_dir / ".exported"
    if done.exists():
        return onnx_dir
    from optimum.exporters.onnx import main_export

    hf_dir = onnx_dir.with_name(onnx_dir.name + "-hf")
    model.save_pretrained(hf_dir)
    main_export(str(hf_dir), output=onnx_dir, task=task, device="cpu", do_validation=False, local_files_only=True,
                library_name="transformers")
    done.touch()
    return onnx_dir


# ----------------------------------------------------------------------------------------------------------------
# Systems: each `run_<system>_<task>(spec, runtime, workdir)` builds its model (untimed) and returns a GenerateFn.


def run_transformers_gpt(spec: GptSpec, runtime: Runtime, workdir: Path) -> GenerateFn:
    import torch

    model = hf_gpt_model(spec)
    generation_config = gpt_generation_config(spec)

    def generate(prompts: np.ndarray) -> np.ndarray:
        ids = torch.from_numpy(prompts)
        with torch.inference_mode():
            out = model.generate(input_ids=ids, attention_mask=torch.ones_like(ids),
                                 generation_config=generation_config)
        return out[:, ids.shape[1]:].numpy()

    return generate


def run_optimum_gpt(spec: GptSpec, runtime: Runtime, workdir: Path) -> GenerateFn:
    import torch
    from optimum.onnxruntime import ORTModelForCausalLM

    onnx_dir = _optimum_export(hf_gpt_model(spec), _spec_dir(workdir, "optimum-gpt", spec), "text-generation-with-past")
    model = ORTModelForCausalLM.from_pretrained(onnx_dir, provider="CPUExecutionProvider", use_cache=True,
                                                session_options=runtime.session_options(), local_files_only=True)
    generation_config = gpt_generation_config(spec)

    def generate(prompts: np.ndarray) -> np.ndarray:
        ids = torch.from_numpy(prompts)
        out = model.generate(input_ids=ids, attention_mask=torch.ones_like(ids), generation_config=generation_config)
        return out[:, ids.shape[1]:].numpy()

    return generate


def run_shipped_gpt(spec: GptSpec, runtime: Runtime, workdir: Path) -> GenerateFn:
    """OUR ENGINE on the SHIPPED VARIANT of our graph: `run_ours_gpt`'s export rewritten as the release GPT is
    (bench/shipped.py: fused attention, int8 weights, in-place KV cache, ...)."""
    from shipped import shipped_variant

    return run_ours_gpt(spec, runtime, workdir, shipped_variant("gpt"))


def run_shipped_translation(spec: TranslationSpec, runtime: Runtime, workdir: Path) -> GenerateFn:
    """OUR ENGINE on the SHIPPED VARIANT of our translation graphs (see `run_shipped_gpt`)."""
    from shipped import shipped_variant

    return run_ours_translation(spec, runtime, workdir, shipped_variant("translation"))


def run_ours_gpt(spec: GptSpec, runtime: Runtime, workdir: Path, variant: dict[str, str] | None = None
                 ) -> GenerateFn:
    """OUR ENGINE, GPT: `service.engines.gpt.GPTEngine` + `service.decoding.GreedySearch`.

    Our from-scratch GPT (`models.gpt.GPT`) with random weights and the same sizes, exported by
    `export.onnx_export.export_gpt` (untimed, cached). `generate(prompts)`: prompts (B, spec.prompt_tokens) int64,
    no padding -> (B, spec.new_tokens) int64, the generated tokens only; greedy with
    `min_new_tokens == max_new_tokens == spec.new_tokens`, all B rows decoded together in one batch.
    """
    from service.decoding import GreedySearch
    from service.engines.gpt import GPTEngine

    version = _ours_gpt_version(spec, workdir, variant)
    engine = GPTEngine(version, _ours_runtime_options(runtime))

    def generate(prompts: np.ndarray) -> np.ndarray:
        searches = engine.generate(prompts.tolist(), lambda _: GreedySearch(spec.new_tokens, EOS_ID,
                                                                           min_new_tokens=spec.new_tokens))
        return np.array([search.results()[0].tokens for search in searches], dtype=np.int64)

    return generate


def _ours_gpt_version(spec: GptSpec, workdir: Path, variant: dict[str, str] | None = None):
    """Our GPT with random weights (seed 0) at `spec`'s sizes, exported once into workdir (see `_ours_export`),
    its graph rewritten into `variant` if given."""
    from models.config import GPTConfig
    from models.gpt import GPT

    config = GPTConfig(vocab_size=spec.vocab_size, context_length=spec.context_length, d_model=spec.d_model,
                       n_heads=spec.n_heads, n_layers=spec.n_layers, d_ff=spec.d_ff, dropout=0.0, eos_id=EOS_ID)
    folder = _spec_dir(workdir, _variant_name("ours-gpt", variant), spec)
    return _ours_export("gpt", lambda: GPT(config), config, folder, variant)


def run_genai_gpt(spec: GptSpec, runtime: Runtime, workdir: Path) -> GenerateFn:
    """ONNX Runtime GenAI on OUR exported GPT graph (the file `run_ours_gpt` loads), see bench/genai_system.py."""
    import genai_system
    import onnxruntime_genai  # noqa: F401 - ImportError here: reported as skipped

    version = _ours_gpt_version(spec, workdir)
    folder = genai_system.prepare_folder(
        version.path, version.config, _spec_dir(workdir, "genai-gpt", spec), threads=runtime.threads,
        spin=runtime.spin, max_length=spec.prompt_tokens + spec.new_tokens, pad_id=PAD_ID, bos_id=BOS_ID)
    return genai_system.make_generate(folder, spec.new_tokens)


def run_transformers_translation(spec: TranslationSpec, runtime: Runtime, workdir: Path) -> GenerateFn:
    import torch

    model = hf_translation_model(spec)
    generation_config = translation_generation_config(spec)

    def generate(source: np.ndarray) -> np.ndarray:
        ids = torch.from_numpy(source)
        with torch.inference_mode():
            out = model.generate(input_ids=ids, attention_mask=torch.ones_like(ids),
                                 generation_config=generation_config)
        return out[:, 1:].numpy()  # drop the decoder start token

    return generate


def run_optimum_translation(spec: TranslationSpec, runtime: Runtime, workdir: Path) -> GenerateFn:
    import torch
    from optimum.onnxruntime import ORTModelForSeq2SeqLM

    onnx_dir = _optimum_export(hf_translation_model(spec), _spec_dir(workdir, "optimum-translation", spec),
                               "text2text-generation-with-past")
    model = ORTModelForSeq2SeqLM.from_pretrained(onnx_dir, provider="CPUExecutionProvider", use_cache=True,
                                                 session_options=runtime.session_options(),
                                                 local_files_only=True)
    generation_config = translation_generation_config(spec)

    def generate(source: np.ndarray) -> np.ndarray:
        ids = torch.from_numpy(source)
        out = model.generate(input_ids=ids, attention_mask=torch.ones_like(ids), generation_config=generation_config)
        return out[:, 1:].numpy()

    return generate


def run_ours_translation(spec: TranslationSpec, runtime: Runtime, workdir: Path,
                         variant: dict[str, str] | None = None) -> GenerateFn:
    """OUR ENGINE, TRANSLATION: `service.engines.translation.TranslationEngine` + `service.decoding.BeamSearch`.

    Our from-scratch encoder-decoder (`models.transformer.EncoderDecoderTransformer`) with random weights and the
    same sizes, exported by `export.onnx_export.export_translation` (untimed, cached). `generate(source)`: source
    (1, S) int64 ending in EOS -> (1, spec.new_tokens) int64, the best beam's tokens (no decoder start token);
    beam search like the baselines: `num_beams`, length_penalty 1.0, early_stopping False,
    `min_new_tokens == max_new_tokens == spec.new_tokens`.
    """
    from models.config import TranslationConfig
    from models.transformer import EncoderDecoderTransformer
    from service.decoding import BeamSearch
    from service.engines.translation import TranslationEngine

    config = TranslationConfig(vocab_size=spec.vocab_size, d_model=spec.d_model, n_heads=spec.n_heads,
                               n_encoder_layers=spec.n_encoder_layers, n_decoder_layers=spec.n_decoder_layers,
                               d_ff=spec.d_ff, dropout=0.0, max_positions=spec.max_positions, pad_id=PAD_ID,
                               bos_id=BOS_ID, eos_id=EOS_ID)
    version = _ours_export("translation", lambda: EncoderDecoderTransformer(config), config,
                           _spec_dir(workdir, _variant_name("ours-translation", variant), spec), variant)
    engine = TranslationEngine(version, _ours_runtime_options(runtime))

    def generate(source: np.ndarray) -> np.ndarray:
        searches = engine.translate_ids(source.tolist(), lambda _: BeamSearch(
            spec.num_beams, spec.new_tokens, EOS_ID, length_penalty=1.0, early_stopping=False,
            min_new_tokens=spec.new_tokens))
        return np.array([search.results()[0].tokens for search in searches], dtype=np.int64)

    return generate


def _variant_name(name: str, variant: dict[str, str] | None) -> str:
    return name + "".join(f"-{value}" for value in (variant or {}).values())


def _ours_export(kind: str, make_model: Callable, config, folder: Path, variant: dict[str, str] | None = None):
    """Export our model (random weights, seed 0) into `folder` as a model-repository version, once, rewritten into
    `variant` (`export.repository.rewrite_graphs`) if given: the folder name carries the spec, and the marker the
    hash of the model/export sources, so edits there re-export."""
    from export.onnx_export import EXPORTERS
    from service.models.repository import CONFIG_FILE, TOKENIZER_FILE, ModelVersion

    sources = sorted(Path(__file__).resolve().parents[1].glob("models/*.py")) + \
        sorted(Path(__file__).resolve().parents[1].glob("export/*.py"))
    digest = hashlib.sha1(b"".join(p.read_bytes() for p in sources)).hexdigest()
    marker = folder / ".exported"
    if not (marker.exists() and marker.read_text() == digest):
        from tokenizers import Tokenizer
        from tokenizers.models import WordLevel

        folder.mkdir(parents=True, exist_ok=True)
        _seed_torch(0)
        described = EXPORTERS[kind](make_model().eval(), config, folder)
        if variant:
            from export.repository import rewrite_graphs

            rewrite_graphs(folder, described, **variant)
        (folder / CONFIG_FILE).write_text(json.dumps(described, indent=2))
        # The engines load a tokenizer; generation from ids never uses it, so a one-word vocabulary will do.
        Tokenizer(WordLevel({"<unk>": 0}, unk_token="<unk>")).save(str(folder / TOKENIZER_FILE))
        marker.write_text(digest)
    return ModelVersion(f"bench-{kind}", 1, folder, json.loads((folder / CONFIG_FILE).read_text()))


def _ours_runtime_options(runtime: Runtime):
    """The same settings as `Runtime.session_options()`, through the service's own `RuntimeOptions`."""
    from service.engines.runtime import RuntimeOptions

    return RuntimeOptions(device="cpu", intra_op_threads=runtime.threads, inter_op_threads=1, spin=runtime.spin)


SYSTEMS = ("transformers", "optimum", "genai", "ours", "shipped")
BUILDERS: dict[str, dict[str, Callable[..., GenerateFn]]] = {
    "gpt": {"transformers": run_transformers_gpt, "optimum": run_optimum_gpt, "genai": run_genai_gpt,
            "ours": run_ours_gpt, "shipped": run_shipped_gpt},
    "translation": {"transformers": run_transformers_translation, "optimum": run_optimum_translation,
                    "ours": run_ours_translation, "shipped": run_shipped_translation},
}


TASKS = ("gpt", "translation", "scaling")  # scaling: see `bench_scaling`


# ----------------------------------------------------------------------------------------------------------------
# Harness


def build_systems(task: str, spec, systems: list[str], runtime: Runtime, workdir: Path):
    """Build each system; one that cannot be built (missing package, not implemented) is skipped with a reason."""
    built, skipped = {}, {}
    for name in systems:
        if name not in BUILDERS[task]:
            skipped[name] = f"not applicable to {task}"
            print(f"  [{task}] {name}: skipped ({skipped[name]})", flush=True)
            continue
        start = time.perf_counter()
        try:
            built[name] = BUILDERS[task][name](spec, runtime, workdir)
        except (ImportError, NotImplementedError) as error:
            skipped[name] = f"{type(error).__name__}: {error}"
            print(f"  [{task}] {name}: skipped ({skipped[name]})", flush=True)
            continue
        print(f"  [{task}] {name}: built in {time.perf_counter() - start:.1f} s", flush=True)
    return built, skipped


def measure(systems: dict[str, GenerateFn], inputs: list[np.ndarray], expected_new: int, warmup: int,
            repeats: int) -> tuple[dict[str, list[float]], dict[str, list[np.ndarray]]]:
    """Seconds to run every input through each system, per repeat, repeats interleaved across systems.
    Also checks that each system produced exactly `expected_new` tokens per row."""
    outputs: dict[str, list[np.ndarray]] = {}
    for name, generate in systems.items():
        for _ in range(max(warmup, 1)):  # at least one untimed pass: it also yields the outputs checked below
            outputs[name] = [np.asarray(generate(x)) for x in inputs]
        for x, y in zip(inputs, outputs[name]):
            if y.shape != (x.shape[0], expected_new):
                raise RuntimeError(f"{name} returned shape {y.shape}, expected {(x.shape[0], expected_new)}: "
                                   "every system must generate exactly the same number of tokens")
    times: dict[str, list[float]] = {name: [] for name in systems}
    for _ in range(repeats):
        for name, generate in systems.items():
            start = time.perf_counter()
            for x in inputs:
                generate(x)
            times[name].append(time.perf_counter() - start)
    return times, outputs


def agreement(a: list[np.ndarray], b: list[np.ndarray]) -> float:
    """Fraction of output rows that are identical (transformers vs Optimum share weights, and so do ours vs
    genai (one graph file), so ~1.0 expected; near-ties in random-weight logits can flip a token now and then)."""
    rows_a = [row for y in a for row in y]
    rows_b = [row for y in b for row in y]
    return sum(np.array_equal(x, y) for x, y in zip(rows_a, rows_b)) / max(len(rows_a), 1)


def summarise(case: str, unit: str, work: float, times: dict[str, list[float]], outputs, skipped) -> dict:
    """`work` = tokens (or sentences) per timed pass; throughput = work / median seconds."""
    result = {"case": case, "unit": unit, "work_per_pass": work, "systems": {}, "skipped": skipped}
    for name, seconds in times.items():
        median = statistics.median(seconds)
        result["systems"][name] = {"throughput": work / median, "median_s": median,
                                   "best_throughput": work / min(seconds), "seconds": [round(s, 4) for s in seconds]}
    throughput = {name: entry["throughput"] for name, entry in result["systems"].items()}
    result["ratios"] = {
        f"{mine}/{other}": (throughput[mine] / throughput[other]) if {mine, other} <= throughput.keys() else None
        for mine in ("ours", "shipped") for other in ("transformers", "optimum", "genai")
    }
    result["ratios"]["optimum/transformers"] = (throughput["optimum"] / throughput["transformers"]
                                                if {"optimum", "transformers"} <= throughput.keys() else None)
    if {"transformers", "optimum"} <= outputs.keys():
        result["transformers_optimum_agreement"] = agreement(outputs["transformers"], outputs["optimum"])
    if {"ours", "genai"} <= outputs.keys():
        result["ours_genai_agreement"] = agreement(outputs["ours"], outputs["genai"])
        result["ours_genai_identical_tokens"] = int(sum(
            int((x == y).sum()) for x, y in zip(outputs["ours"], outputs["genai"])))
        result["ours_genai_total_tokens"] = int(sum(x.size for x in outputs["ours"]))
    return result


def bench_gpt(args, systems: list[str]) -> list[dict]:
    spec = GptSpec()
    print(f"GPT: {spec}", flush=True)
    built, skipped = build_systems("gpt", spec, systems, args.runtime, args.workdir)
    results = []
    for batch in args.gpt_batches:
        prompts = make_prompts(spec, batch)
        times, outputs = measure(built, [prompts], spec.new_tokens, args.warmup, args.repeats)
        results.append(summarise(f"gpt greedy batch {batch}", "tokens/s", batch * spec.new_tokens, times, outputs,
                                 skipped))
        print_result(results[-1])
    return results


def bench_translation(args, systems: list[str]) -> list[dict]:
    spec = TranslationSpec()
    print(f"Translation: {spec}", flush=True)
    built, skipped = build_systems("translation", spec, systems, args.runtime, args.workdir)
    sources = make_sources(spec, args.sentences)
    times, outputs = measure(built, sources, spec.new_tokens, args.warmup, args.repeats)
    result = summarise(f"translation beam {spec.num_beams} batch 1", "sentences/s", len(sources), times, outputs,
                       skipped)
    result["source_lengths"] = [int(s.shape[1]) for s in sources]
    print_result(result)
    return [result]


def release_gpt_spec() -> GptSpec:
    """The scaling table's model: the release GPT's shape (models/config.py, preset gpt/release), with the GPT
    case's prompt and new tokens."""
    from models.config import get_preset

    config, _ = get_preset("gpt", "release")
    return GptSpec(vocab_size=config.vocab_size, d_model=config.d_model, n_layers=config.n_layers,
                   n_heads=config.n_heads, d_ff=config.d_ff, context_length=config.context_length)


def run_roofline_gpt(spec: GptSpec, batch: int) -> GenerateFn:
    """The fp32 matmul roofline of one GPT decoding step at `batch`, as a GenerateFn for `measure`: per pass,
    `spec.new_tokens` steps, each step every matmul of the model at one token per row, as the model's own
    nn.Linear layers run them (`torch.nn.functional.linear`, weight (out, in), bias added): per layer the q, k, v
    and attention-output projections (d -> d), MLP up (d -> d_ff) and down (d_ff -> d), then the tied LM head
    (d -> vocab, no bias). torch's threads are the harness's (set in `main`). Returns a placeholder of the right
    shape (it produces no tokens). F.linear is the fastest of the torch forms here: measured against
    addmm/matmul on (in, out) weights, 15% faster at batch 8-64 and equal at batch 1 and 128."""
    import torch
    import torch.nn.functional as F

    generator = torch.Generator().manual_seed(0)
    d, ff = spec.d_model, spec.d_ff
    x = torch.randn(batch, d, generator=generator)
    hidden = torch.randn(batch, ff, generator=generator)

    def linear(inputs, n_out: int, bias: bool = True):
        weight = torch.randn(n_out, inputs.shape[1], generator=generator) * 0.02
        return inputs, weight, (torch.randn(n_out, generator=generator) * 0.02 if bias else None)

    ops = []
    for _ in range(spec.n_layers):
        ops += [linear(x, d), linear(x, d), linear(x, d), linear(x, d), linear(x, ff), linear(hidden, d)]
    ops.append(linear(x, spec.vocab_size, bias=False))
    placeholder = np.zeros((batch, spec.new_tokens), np.int64)

    def generate(prompts: np.ndarray) -> np.ndarray:
        with torch.inference_mode():
            for _ in range(spec.new_tokens):
                for inputs, weight, bias in ops:
                    F.linear(inputs, weight, bias)
        return placeholder

    return generate


def bench_scaling(args) -> dict:
    """Our GPT engine at each batch in --scaling-batches vs the fp32 matmul roofline, interleaved per batch."""
    spec = release_gpt_spec()
    print(f"Scaling (our GPT engine vs its fp32 matmul roofline): {spec}", flush=True)
    ours = run_ours_gpt(spec, args.runtime, args.workdir)
    shipped = run_shipped_gpt(spec, args.runtime, args.workdir)
    rows = []
    for batch in args.scaling_batches:
        prompts = make_prompts(spec, batch)
        systems = {"ours": ours, "shipped": shipped, "roofline": run_roofline_gpt(spec, batch)}
        times, _ = measure(systems, [prompts], spec.new_tokens, args.warmup, args.repeats)
        tokens = batch * spec.new_tokens
        ours_tp = tokens / statistics.median(times["ours"])
        shipped_tp = tokens / statistics.median(times["shipped"])
        roofline_tp = tokens / statistics.median(times["roofline"])
        rows.append({"batch": batch, "ours_tokens_per_s": ours_tp, "shipped_tokens_per_s": shipped_tp,
                     "roofline_tokens_per_s": roofline_tp, "fraction_of_roofline": ours_tp / roofline_tp,
                     "shipped_fraction_of_roofline": shipped_tp / roofline_tp,
                     "roofline_step_ms": statistics.median(times["roofline"]) / spec.new_tokens * 1000,
                     "ours_seconds": [round(t, 4) for t in times["ours"]],
                     "shipped_seconds": [round(t, 4) for t in times["shipped"]],
                     "roofline_seconds": [round(t, 4) for t in times["roofline"]]})
        print(f"  batch {batch:>3}: ours {ours_tp:>9.1f} tok/s   shipped {shipped_tp:>9.1f} tok/s   roofline "
              f"{roofline_tp:>9.1f} tok/s   fractions {ours_tp / roofline_tp:.2f} {shipped_tp / roofline_tp:.2f}",
              flush=True)
    return {"case": f"gpt scaling, release shape, greedy {spec.prompt_tokens}+{spec.new_tokens} tokens",
            "spec": asdict(spec), "rows": rows}


def print_scaling(scaling: dict) -> None:
    header = (f"{'batch':>5} {'ours tok/s':>12} {'shipped tok/s':>14} {'roofline tok/s':>15} {'fraction':>9} "
              f"{'shipped fraction':>17} {'roofline ms/step':>17}")
    print(f"\n{scaling['case']} (median of {len(scaling['rows'][0]['ours_seconds']) if scaling['rows'] else 0} "
          "passes; roofline = the step's matmuls in torch, same threads)")
    print("=" * len(header))
    print(header)
    print("-" * len(header))
    for row in scaling["rows"]:
        print(f"{row['batch']:>5} {row['ours_tokens_per_s']:>12.1f} {row['shipped_tokens_per_s']:>14.1f} "
              f"{row['roofline_tokens_per_s']:>15.1f} {row['fraction_of_roofline']:>9.2f} "
              f"{row['shipped_fraction_of_roofline']:>17.2f} {row['roofline_step_ms']:>17.3f}")
    print("=" * len(header))


def _fmt(value: float | None, pattern: str) -> str:
    return "n/a" if value is None else format(value, pattern)


def print_result(result: dict) -> None:
    repeats = max((len(entry["seconds"]) for entry in result["systems"].values()), default=0)
    print(f"\n  {result['case']} ({result['unit']}, median of {repeats} passes)")
    for name in SYSTEMS:
        entry = result["systems"].get(name)
        if entry is None:
            print(f"    {name:<13} {'skipped':>10}")
        else:
            seconds = entry["seconds"]
            print(f"    {name:<13} {entry['throughput']:>10.1f}   (median {entry['median_s']:.3f} s/pass, "
                  f"range {min(seconds):.3f}-{max(seconds):.3f})")
    ratios = result["ratios"]
    print("    " + "   ".join(f"{key} = {_fmt(value, '.2f')}" for key, value in ratios.items()))
    if "transformers_optimum_agreement" in result:
        print(f"    identical outputs transformers vs optimum: {result['transformers_optimum_agreement']:.0%}")
    if "ours_genai_agreement" in result:
        print(f"    identical outputs ours vs genai (same graph): {result['ours_genai_agreement']:.0%} of rows, "
              f"{result['ours_genai_identical_tokens']}/{result['ours_genai_total_tokens']} tokens")
        if result["ours_genai_agreement"] < 1.0:
            print("    WARNING: ours and genai run the same graph greedily; their tokens should be identical")
    print(flush=True)


def print_table(results: list[dict]) -> None:
    header = f"{'case':<30} {'unit':<12} {'transformers':>12} {'optimum':>10} {'genai':>10} {'ours':>10} " \
             f"{'shipped':>10} {'ours/transf.':>12} {'ours/optimum':>12} {'ours/genai':>10} " \
             f"{'shipped/optimum':>15} {'shipped/genai':>13}"
    print("=" * len(header))
    print(header)
    print("-" * len(header))
    for r in results:
        tp = {name: _fmt(r["systems"].get(name, {}).get("throughput"), ".1f") for name in SYSTEMS}
        ratios = r["ratios"]
        print(f"{r['case']:<30} {r['unit']:<12} {tp['transformers']:>12} {tp['optimum']:>10} {tp['genai']:>10} "
              f"{tp['ours']:>10} {tp['shipped']:>10} {_fmt(ratios['ours/transformers'], '.2f'):>12} "
              f"{_fmt(ratios['ours/optimum'], '.2f'):>12} {_fmt(ratios['ours/genai'], '.2f'):>10} "
              f"{_fmt(ratios['shipped/optimum'], '.2f'):>15} {_fmt(ratios['shipped/genai'], '.2f'):>13}")
    print("=" * len(header))


def environment(runtime: Runtime) -> dict:
    versions = {}
    for package in ("numpy", "onnxruntime", "torch", "transformers", "optimum", "optimum.onnxruntime"):
        try:
            module = __import__(package, fromlist=["__name__"])
            versions[package] = getattr(module, "__version__", "installed")
        except ImportError:
            versions[package] = None
    from importlib.metadata import version

    for distribution in ("optimum-onnx", "onnxruntime-genai"):
        try:
            versions[distribution] = version(distribution)
        except Exception:  # noqa: BLE001 - not installed
            versions[distribution] = None
    return {"python": platform.python_version(), "machine": platform.machine(), "cpu_count": os.cpu_count(),
            "threads": runtime.threads, "spin": runtime.spin,
            "OMP_WAIT_POLICY": os.environ.get("OMP_WAIT_POLICY"), "load_average": os.getloadavg(),
            "executable": sys.executable, "versions": versions}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="smoke run: 1 warm-up, 2 repeats, 3 sentences")
    parser.add_argument("--threads", type=int, default=2, help="torch and ONNX Runtime intra-op threads (default 2)")
    parser.add_argument("--spin", action="store_true",
                        help="let idle threads busy-wait (library defaults); only on an otherwise idle machine")
    parser.add_argument("--repeats", type=int, default=None, help="timed passes per system (default 7; quick 2)")
    parser.add_argument("--warmup", type=int, default=None, help="untimed passes per system (default 2; quick 1)")
    parser.add_argument("--sentences", type=int, default=None,
                        help="translation: source sentences per pass, one at a time (default 10; quick 3)")
    parser.add_argument("--gpt-batches", default="1,16", help="GPT batch sizes (default 1,16)")
    parser.add_argument("--scaling-batches", default="1,8,16,32,64,128",
                        help="scaling table batch sizes (default 1,8,16,32,64,128)")
    parser.add_argument("--tasks", default=",".join(TASKS), help="comma-separated: gpt,translation,scaling")
    parser.add_argument("--systems", default=",".join(SYSTEMS),
                        help="comma-separated: transformers,optimum,genai,ours,shipped (the scaling task always runs "
                             "ours and shipped)")
    parser.add_argument("--out", type=Path, default=Path("reports/bench_engine.json"), help="JSON results")
    parser.add_argument("--workdir", type=Path, default=Path(".cache/bench_engine"),
                        help="where exported models are kept between runs (default .cache/bench_engine)")
    args = parser.parse_args(argv)
    args.repeats = args.repeats or (2 if args.quick else 7)
    args.warmup = args.warmup if args.warmup is not None else (1 if args.quick else 2)
    args.sentences = args.sentences or (3 if args.quick else 10)
    args.gpt_batches = [int(b) for b in args.gpt_batches.split(",") if b]
    args.scaling_batches = [int(b) for b in args.scaling_batches.split(",") if b]
    tasks = [t for t in args.tasks.split(",") if t]
    systems = [s for s in args.systems.split(",") if s]
    for name in systems:
        if name not in SYSTEMS:
            parser.error(f"unknown system {name!r}; choose from {SYSTEMS}")
    for task in tasks:
        if task not in TASKS:
            parser.error(f"unknown task {task!r}; choose from {TASKS}")

    logging.basicConfig(level=logging.WARNING)
    warnings.filterwarnings("ignore")
    args.runtime = Runtime(threads=args.threads, spin=args.spin)
    if "torch" in sys.modules:
        print("warning: torch was imported before main(); OMP_WAIT_POLICY may not apply", file=sys.stderr)
    if not args.spin:
        os.environ["OMP_WAIT_POLICY"] = "PASSIVE"  # read once, when torch loads OpenMP (libgomp)
    import torch

    torch.set_num_threads(args.threads)
    torch.set_num_interop_threads(1)
    args.workdir.mkdir(parents=True, exist_ok=True)
    env = environment(args.runtime)
    print(f"threads={args.threads} spin={args.spin} repeats={args.repeats} warmup={args.warmup} "
          f"load average={env['load_average']}")
    print(f"versions: {env['versions']}", flush=True)

    results = []
    if "gpt" in tasks:
        results += bench_gpt(args, systems)
    if "translation" in tasks:
        results += bench_translation(args, systems)
    scaling = bench_scaling(args) if "scaling" in tasks else None
    if results:
        print_table(results)
    if scaling is not None:
        print_scaling(scaling)

    report = {"created": time.strftime("%Y-%m-%dT%H:%M:%S%z"), "quick": args.quick, "environment": env,
              "settings": {"repeats": args.repeats, "warmup": args.warmup, "sentences": args.sentences,
                           "gpt_batches": args.gpt_batches, "scaling_batches": args.scaling_batches,
                           "gpt": asdict(GptSpec()), "translation": asdict(TranslationSpec())},
              "results": results, "scaling": scaling}
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(report, indent=2) + "\n")
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
