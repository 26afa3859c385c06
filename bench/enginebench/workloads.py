"""What every system is measured on: the model sizes (`GptSpec`, `TranslationSpec`), the inputs (prompts, source
sentences of random regular ids), the special ids all models share, and the thread settings all systems share
(`Runtime`). A system is a `GenerateFn`: input ids in, exactly the generated tokens out."""

from __future__ import annotations

import hashlib
import json
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path

import numpy as np


# A generate function: input ids (B, S) int64 -> the generated tokens only (B, new_tokens) int64.
# GPT: the prompts; translation: the source sentences, right-padded with PAD_ID after their EOS (`source_rows`
# gives each one back; the best beam is returned).
GenerateFn = Callable[[np.ndarray], np.ndarray]

PAD_ID, BOS_ID, EOS_ID = 0, 1, 2  # the same special ids in every model here; sources/prompts never contain them
FIRST_REGULAR_ID = 3


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


def make_source_batch(spec: TranslationSpec, batch: int, seed: int = 2) -> np.ndarray:
    """`batch` source sentences as one (batch, longest) int64 array, right-padded with PAD_ID after each EOS."""
    rows = [s[0] for s in make_sources(spec, batch, seed)]
    padded = np.full((batch, max(len(r) for r in rows)), PAD_ID, np.int64)
    for i, row in enumerate(rows):
        padded[i, : len(row)] = row
    return padded


def source_rows(source: np.ndarray) -> list[list[int]]:
    """The sentences of a (B, S) source batch: each row up to and with its EOS (the padding dropped)."""
    return [row[: row.index(EOS_ID) + 1] for row in source.tolist()]


def seed_torch(seed: int) -> None:
    """Seed torch before building a model with random weights: every system's weights are the same per seed."""
    import torch

    torch.manual_seed(seed)


def spec_dir(workdir: Path, name: str, spec) -> Path:
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
    # ours and shipped only: steps of at most this many rows on a one-thread session (the service's
    # TSERVE_SINGLE_THREAD_ROWS, `service.engines.runtime.OneThreadSession`); 0 = never, None = as the service
    single_thread_rows: int | None = None
    # shipped only: the variant it runs, a TSERVE_VARIANT value (`int8`, `gpt=int8+gqa,translation=int8`:
    # `service.models.variants.parse_pins`); None (or a model it names no variant for) = as stored, as the service
    # runs it with TSERVE_VARIANT=stored
    shipped_variant: str | None = None
    # ours and shipped only: sibling projections fused at load, as the service does (TSERVE_FUSE_PROJECTIONS,
    # `service.engines.projection_fusion`); False: the graphs' MatMuls as exported
    fuse_projections: bool = True
    # ours and shipped only: the device their sessions run on (`RuntimeOptions.device`: cpu or cuda); a cuda engine
    # whose sessions fell back to CPU is an error (`enginebench.ours`), never a CPU figure labelled CUDA
    device: str = "cpu"
    # ours and shipped only: where their KV caches live (the service's TSERVE_KV_RESIDENCE: auto, host, device;
    # `service.engines.runtime.kv_resident_on_device`)
    kv_residence: str = "auto"

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


def release_gpt_spec() -> GptSpec:
    """The scaling table's model: the release GPT's shape (models/config.py, preset gpt/release), with the GPT
    case's prompt and new tokens."""
    from models.config import get_preset

    config, _ = get_preset("gpt", "release")
    return GptSpec(vocab_size=config.vocab_size, d_model=config.d_model, n_layers=config.n_layers,
                   n_heads=config.n_heads, d_ff=config.d_ff, context_length=config.context_length)
