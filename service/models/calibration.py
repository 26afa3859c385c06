"""Calibration: how fast each weights variant of a model version runs on this host, measured through its engine, and
the measurements cached per kind of host so that a restart on the same machine (or an identical one sharing the
cache file) does not measure again.

What is measured (`measure`): for each variant and each batch size (rows), the seconds per item of its kind's
workload (`service.models.kinds`: a text model's prompt pass over `rows` copies of a short input, then one-token
steps, as many as a request of its kind generates (`DECODE_STEPS` for a translation), per generated token; the
ViT's batch of `rows` images, per image), through the same engine calls the schedulers make. Every variant and
size runs once untimed (first-run allocations), then the variants take turns for `ROUNDS` rounds and each keeps its
median: the host's noise falls on all of them alike.

The cache (`CalibrationCache`: one JSON file, `TSERVE_CALIBRATION_CACHE`) is keyed (`calibration_key`) by what
decides the timings: the CPU (its model name and the ISA flags ONNX Runtime's kernels are chosen by), ONNX
Runtime's version and provider, the session options (threads, spinning, one-thread small steps), the version's
graph files (SHA-256) and the batch sizes measured.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import platform
import statistics
import tempfile
import time
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any

import onnxruntime as ort

from service.engines.runtime import RuntimeOptions
from service.repository import ModelVersion

log = logging.getLogger(__name__)

ROUNDS = 3  # timed runs per variant and batch size, interleaved; the median is kept
DECODE_STEPS = 16  # one-token steps after a text workload's prompt pass, unless its kind says otherwise
CPUINFO = Path("/proc/cpuinfo")
# The ISA flags that decide which kernels ONNX Runtime's MLAS runs (float: AVX2/FMA or AVX-512; int8: VNNI, AMX)
ISA_FLAGS = ("avx", "avx2", "fma", "f16c", "avx512f", "avx512bw", "avx512vl", "avx512_vnni", "avx_vnni",
             "avx512_bf16", "amx_tile", "amx_int8", "amx_bf16")
HASH_CHUNK = 1 << 20
KEY_DIGITS = 16  # hex digits of a cache key

# (engine, rows) -> how many items (generated tokens, images) the run produced
Workload = Callable[[Any, int], int]


def cpu_identity() -> dict[str, Any]:
    """This host's CPU as the kernels see it: model name, the ISA flags among `ISA_FLAGS` it has, logical cores."""
    name, flags = "", set()
    try:
        for line in CPUINFO.read_text().splitlines():
            key, _, value = (part.strip() for part in line.partition(":"))
            if key == "model name" and not name:
                name = value
            elif key == "flags" and not flags:
                flags = set(value.split())
            if name and flags:
                break
    except OSError:  # not Linux: the platform's name for it, no flags
        pass
    name = name or platform.processor() or platform.machine()
    return {"cpu": name, "isa": [f for f in ISA_FLAGS if f in flags], "cores": os.cpu_count()}


def graph_digest(model: ModelVersion) -> str:
    """SHA-256 over the version's graph files (config `files`), in their config order."""
    digest = hashlib.sha256()
    for file in model.config["files"].values():
        with open(model.path / file, "rb") as f:
            while chunk := f.read(HASH_CHUNK):
                digest.update(chunk)
    return digest.hexdigest()


def calibration_key(model: ModelVersion, provider: str, options: RuntimeOptions, rows: Sequence[int]
                    ) -> dict[str, Any]:
    """Everything the timings of `model`'s variants depend on; its hash (`key_hash`) names the cache entry. The
    session options that change a step's speed are in it (threads, spinning, the one-thread sessions of small
    steps, the fused projections); the weights are what is measured."""
    return {**cpu_identity(), "onnxruntime": ort.__version__, "provider": provider,
            "threads": options.intra_op_threads, "spin": options.spin,
            "single_thread_rows": options.single_thread_rows, "fuse_projections": options.fuse_projections,
            "model": f"{model.name}:{model.version}",
            "graphs": graph_digest(model), "rows": list(rows)}


def key_hash(key: Mapping[str, Any]) -> str:
    return hashlib.sha256(json.dumps(key, sort_keys=True).encode()).hexdigest()[:KEY_DIGITS]


def measure(engines: Mapping[str, Any], workload: Workload, rows: Sequence[int],
            rounds: int = ROUNDS) -> dict[str, dict[int, float]]:
    """Seconds per item of `workload` for each variant's engine and each batch size: variant -> rows -> seconds."""
    for engine in engines.values():
        for size in rows:
            workload(engine, size)
    samples: dict[str, dict[int, list[float]]] = {v: {size: [] for size in rows} for v in engines}
    for _ in range(rounds):
        for variant, engine in engines.items():
            for size in rows:
                started = time.perf_counter()
                items = workload(engine, size)
                samples[variant][size].append((time.perf_counter() - started) / max(items, 1))
    return {v: {size: statistics.median(s) for size, s in by_rows.items()} for v, by_rows in samples.items()}


def decode_workload(engine, prompt: Sequence[int], rows: int, steps: int = DECODE_STEPS) -> int:
    """A text engine's prompt pass over `rows` copies of `prompt`, then `steps` greedy one-token steps; the tokens
    it generated."""
    logits, state = engine.prefill([list(prompt)] * rows)
    for _ in range(steps):
        logits = engine.step(state, logits.argmax(-1))
    return rows * (steps + 1)


class CalibrationCache:
    """Measured timings in one JSON file: key hash -> {"key": what was measured where, "measured_at", "timings"}.
    Unreadable or unwritable: logged, and calibration measures every time (the service still starts)."""

    def __init__(self, path: Path | None):
        self.path = path

    def _read(self) -> dict[str, Any]:
        if self.path is None or not self.path.exists():
            return {}
        try:
            entries = json.loads(self.path.read_text())
            return entries if isinstance(entries, dict) else {}
        except (OSError, ValueError) as error:
            log.warning("calibration cache %s unreadable (%s): measuring again", self.path, error)
            return {}

    def get(self, key: Mapping[str, Any]) -> dict[str, Any] | None:
        """The cached entry for `key`, with its timings as variant -> rows (int) -> seconds; None if there is none."""
        entry = self._read().get(key_hash(key))
        if not isinstance(entry, dict) or entry.get("key") != dict(key):
            return None
        try:
            timings = {v: {int(r): float(s) for r, s in by_rows.items()} for v, by_rows in entry["timings"].items()}
        except (KeyError, TypeError, ValueError, AttributeError):
            return None
        return {**entry, "timings": timings}

    def put(self, key: Mapping[str, Any], timings: Mapping[str, Mapping[int, float]]) -> str:
        """Store `timings` under `key` (written to a temporary file, then renamed over the cache); the time
        recorded as measured_at."""
        measured_at = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())
        if self.path is None:
            return measured_at
        entries = self._read()
        entries[key_hash(key)] = {"key": dict(key), "measured_at": measured_at,
                                  "timings": {v: {str(r): s for r, s in by_rows.items()}
                                              for v, by_rows in timings.items()}}
        try:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            with tempfile.NamedTemporaryFile("w", dir=self.path.parent, prefix=".calibration-", suffix=".json",
                                             delete=False) as f:
                json.dump(entries, f, indent=2)
            os.replace(f.name, self.path)
        except OSError as error:
            log.warning("calibration cache %s not written (%s)", self.path, error)
        return measured_at
