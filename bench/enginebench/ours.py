"""OUR ENGINE as a system: `service.engines.gpt.GPTEngine` / `service.engines.translation.TranslationEngine` with the
searches of `service.decoding`, on our from-scratch models (`models.gpt.GPT`, `models.transformer`) with random
weights, exported by `export.onnx_export` once per spec and source digest; `shipped` is the same engine on the graph
variant the release models are served in (bench/shipped.py)."""

from __future__ import annotations

import hashlib
import json
from collections.abc import Callable
from pathlib import Path

import numpy as np

from . import PROJECT_ROOT
from .workloads import (
    BOS_ID,
    EOS_ID,
    FIRST_REGULAR_ID,
    PAD_ID,
    GenerateFn,
    GptSpec,
    Runtime,
    TranslationSpec,
    seed_torch,
    source_rows,
    spec_dir,
)


def run_shipped_gpt(spec: GptSpec, runtime: Runtime, workdir: Path) -> GenerateFn:
    """OUR ENGINE on the SHIPPED VARIANT of our graph: `run_ours_gpt`'s export rewritten as the release GPT is
    (bench/shipped.py: fused attention, int8 weights, in-place KV cache, ...), run in the weights variant
    `runtime.shipped_variant` pins for the GPT (the one the service chose on this host, by default)."""
    from shipped import shipped_variant

    return run_ours_gpt(spec, runtime, workdir, shipped_variant("gpt"), _runs_as(runtime, "gpt"))


def run_shipped_translation(spec: TranslationSpec, runtime: Runtime, workdir: Path) -> GenerateFn:
    """OUR ENGINE on the SHIPPED VARIANT of our translation graphs (see `run_shipped_gpt`)."""
    from shipped import shipped_variant

    return run_ours_translation(spec, runtime, workdir, shipped_variant("translation"),
                                _runs_as(runtime, "translation"))


def _runs_as(runtime: Runtime, model: str) -> str | None:
    """The weights variant `runtime.shipped_variant` (a TSERVE_VARIANT value) pins for `model`; None: as stored."""
    from service.models.variants import AUTO, STORED, parse_pins, pin_for

    pin = pin_for(parse_pins(runtime.shipped_variant or ""), model)
    return None if pin in (AUTO, STORED) else pin


def run_ours_gpt(spec: GptSpec, runtime: Runtime, workdir: Path, variant: dict[str, str] | None = None,
                 runs_as: str | None = None) -> GenerateFn:
    """OUR ENGINE, GPT: `service.engines.gpt.GPTEngine` + `service.decoding.GreedySearch`.

    Our from-scratch GPT (`models.gpt.GPT`) with random weights and the same sizes, exported by
    `export.onnx_export.export_gpt` (untimed, cached). `generate(prompts)`: prompts (B, spec.prompt_tokens) int64,
    no padding -> (B, spec.new_tokens) int64, the generated tokens only; greedy with
    `min_new_tokens == max_new_tokens == spec.new_tokens`, all B rows decoded together in one batch. `variant`: the
    export's rewrite (`export.repository.rewrite_graphs`), `runs_as`: the variant the engine derives from it when
    the graphs load (`service.engines.weights.VARIANTS`; None: as stored).
    """
    from service.decoding import GreedySearch

    engine = ours_gpt_engine(spec, runtime, workdir, variant, runs_as)

    def generate(prompts: np.ndarray) -> np.ndarray:
        searches = engine.generate(prompts.tolist(), lambda _: GreedySearch(spec.new_tokens, EOS_ID,
                                                                           min_new_tokens=spec.new_tokens))
        return np.array([search.results()[0].tokens for search in searches], dtype=np.int64)

    return generate


def ours_gpt_engine(spec: GptSpec, runtime: Runtime, workdir: Path, variant: dict[str, str] | None = None,
                    runs_as: str | None = None, prefix_cache_bytes: int = 0):
    """`run_ours_gpt`'s engine: `GPTEngine` on our GPT exported at `spec`'s sizes (`variant`, `runs_as`: as there),
    keeping a prefix cache of `prefix_cache_bytes` (0: none, as the benchmark's other GPT cases run)."""
    from dataclasses import replace

    from export.kv_scales import calibration_peaks, save_scales
    from service.engines.gpt import GPTEngine
    from service.engines.weights import quantizes_kv_cache

    version = ours_gpt_version(spec, workdir, variant)
    if quantizes_kv_cache(runs_as):  # its int8 cache's scales: random weights, random prompts, random calibration
        save_scales(version, calibration_peaks(version, None), "random tokens only (the bench's random-weight GPT)")
    options = replace(_ours_runtime_options(runtime, "gpt", runs_as), prefix_cache_bytes=prefix_cache_bytes)
    return on_device(GPTEngine(version, options), runtime)


def ours_gpt_version(spec: GptSpec, workdir: Path, variant: dict[str, str] | None = None):
    """Our GPT with random weights (seed 0) at `spec`'s sizes, exported once into workdir (see `_ours_export`),
    its graph rewritten into `variant` if given."""
    from models.gpt import GPT

    config = gpt_config(spec)
    folder = spec_dir(workdir, _variant_name("ours-gpt", variant), spec)
    return _ours_export("gpt", lambda: GPT(config), config, folder, variant)


def gpt_config(spec: GptSpec):
    """Our GPT's config at `spec`'s sizes (no dropout; the EOS id every model here shares)."""
    from models.config import GPTConfig

    return GPTConfig(vocab_size=spec.vocab_size, context_length=spec.context_length, d_model=spec.d_model,
                     n_heads=spec.n_heads, n_layers=spec.n_layers, d_ff=spec.d_ff, dropout=0.0, eos_id=EOS_ID)


def run_ours_translation(spec: TranslationSpec, runtime: Runtime, workdir: Path,
                         variant: dict[str, str] | None = None, runs_as: str | None = None) -> GenerateFn:
    """OUR ENGINE, TRANSLATION: `service.engines.translation.TranslationEngine` + `service.decoding.BeamSearch`.

    Our from-scratch encoder-decoder (`models.transformer.EncoderDecoderTransformer`) with random weights and the
    same sizes, exported by `export.onnx_export.export_translation` (untimed, cached). `generate(source)`: source
    (1, S) int64 ending in EOS -> (1, spec.new_tokens) int64, the best beam's tokens (no decoder start token);
    beam search like the baselines: `num_beams`, length_penalty 1.0, early_stopping False,
    `min_new_tokens == max_new_tokens == spec.new_tokens`.
    """
    from models.transformer import EncoderDecoderTransformer
    from service.decoding import BeamSearch
    from service.engines.translation import TranslationEngine

    config = translation_config(spec)
    version = _ours_export("translation", lambda: EncoderDecoderTransformer(config), config,
                           spec_dir(workdir, _variant_name("ours-translation", variant), spec), variant)
    engine = on_device(TranslationEngine(version, _ours_runtime_options(runtime, "translation", runs_as)), runtime)

    def generate(source: np.ndarray) -> np.ndarray:
        searches = engine.translate_ids(source_rows(source), lambda _: BeamSearch(
            spec.num_beams, spec.new_tokens, EOS_ID, length_penalty=1.0, early_stopping=False,
            min_new_tokens=spec.new_tokens))
        return np.array([search.results()[0].tokens for search in searches], dtype=np.int64)

    return generate


def translation_config(spec: TranslationSpec):
    """Our translator's config at `spec`'s sizes (no dropout; the special ids every model here shares)."""
    from models.config import TranslationConfig

    return TranslationConfig(vocab_size=spec.vocab_size, d_model=spec.d_model, n_heads=spec.n_heads,
                             n_encoder_layers=spec.n_encoder_layers, n_decoder_layers=spec.n_decoder_layers,
                             d_ff=spec.d_ff, dropout=0.0, max_positions=spec.max_positions, pad_id=PAD_ID,
                             bos_id=BOS_ID, eos_id=EOS_ID)


def on_device(engine, runtime: Runtime):
    """`engine`, after checking that its sessions run on `runtime.device` (ONNX Runtime falls back to CPU silently
    when CUDA cannot start: a CUDA run must not time the CPU)."""
    from service.engines.runtime import CUDA

    if runtime.device == "cuda" and engine.provider != CUDA:
        raise RuntimeError(f"--device cuda: the engine's sessions run on {engine.provider}, not {CUDA} (no GPU "
                           "visible, or an onnxruntime without CUDA)")
    return engine


def _variant_name(name: str, variant: dict[str, str] | None) -> str:
    return name + "".join(f"-{value}" for value in (variant or {}).values())


def _ours_export(kind: str, make_model: Callable, config, folder: Path, variant: dict[str, str] | None = None):
    """Export our model (random weights, seed 0) into `folder` as a model-repository version, once, rewritten into
    `variant` (`export.repository.rewrite_graphs`) if given: the folder name carries the spec, and the marker the
    hash of the model/export sources, so edits there re-export."""
    from export.onnx_export import EXPORTERS
    from service.repository import CONFIG_FILE, TOKENIZER_FILE, ModelVersion

    sources = sorted(PROJECT_ROOT.glob("models/*.py")) + sorted(PROJECT_ROOT.glob("export/*.py"))
    digest = hashlib.sha1(b"".join(p.read_bytes() for p in sources)).hexdigest()
    marker = folder / ".exported"
    if not (marker.exists() and marker.read_text() == digest):
        folder.mkdir(parents=True, exist_ok=True)
        seed_torch(0)
        described = EXPORTERS[kind](make_model().eval(), config, folder)
        if variant:
            from export.repository import rewrite_graphs

            rewrite_graphs(folder, described, **variant)
        (folder / CONFIG_FILE).write_text(json.dumps(described, indent=2))
        marker.write_text(digest)
    _write_id_tokenizer(folder / TOKENIZER_FILE)
    return ModelVersion(f"bench-{kind}", 1, folder, json.loads((folder / CONFIG_FILE).read_text()))


# the special tokens every model here shares, at their ids (`PAD_ID`, `BOS_ID`, `EOS_ID`)
SPECIAL_TOKENS = {"<pad>": PAD_ID, "<s>": BOS_ID, "</s>": EOS_ID}


def _write_id_tokenizer(path: Path) -> None:
    """The engines load a tokenizer and check that the config's special ids are its special tokens
    (`service.engines.vocabulary`); generation from ids never uses it otherwise, so the special tokens and an
    unknown word will do. Written on every build: a folder exported before that check holds a one-word one. Its
    decoder is byte-level's: the GPT engine's constraint compiler (llguidance) refuses a tokenizer without one."""
    from tokenizers import AddedToken, Tokenizer, decoders
    from tokenizers.models import WordLevel

    tokenizer = Tokenizer(WordLevel({**SPECIAL_TOKENS, "<unk>": FIRST_REGULAR_ID}, unk_token="<unk>"))
    tokenizer.decoder = decoders.ByteLevel()
    tokenizer.add_special_tokens([AddedToken(token, special=True) for token in SPECIAL_TOKENS])
    tokenizer.save(str(path))


def _ours_runtime_options(runtime: Runtime, kind: str, runs_as: str | None = None):
    """The same settings as `Runtime.session_options()`, through the service's own `RuntimeOptions`; one-thread
    steps as the service runs the model `kind` unless `runtime.single_thread_rows` says otherwise; the variant
    `runs_as` (None: as stored); the KV cache where `runtime.kv_residence` says."""
    from service.engines.runtime import DEFAULT_SINGLE_THREAD_ROWS, RuntimeOptions

    rows = runtime.single_thread_rows
    return RuntimeOptions(device=runtime.device, intra_op_threads=runtime.threads, inter_op_threads=1,
                          spin=runtime.spin,
                          single_thread_rows=DEFAULT_SINGLE_THREAD_ROWS[kind] if rows is None else rows,
                          weights=runs_as, fuse_projections=runtime.fuse_projections,
                          kv_residence=runtime.kv_residence)
