"""Calibration: how fast each weights variant of a model version runs on this host, measured through its engine
(`measure`), and the measurements cached per kind of host (`CalibrationCache`: one JSON file,
`TSERVE_CALIBRATION_CACHE`) so that a restart on the same machine (or an identical one sharing the cache file) does
not measure again.

`measure` times, per variant and batch size, the seconds per item of its kind's workload (`service.models.kinds`)
through the same engine calls the schedulers make: one untimed run each, then `ROUNDS` interleaved rounds, the
median kept. The cache is keyed (`calibration_key`) by what decides the timings: the CPU and its ISA flags, ONNX
Runtime's version and provider, the session options, the graph files, the batch sizes and the variants offered.

Invariant: only a valid measurement of that key is used (`CacheEntry`, a schema); any other file or entry is
ignored with one log line naming the file and the reason, and the version is measured again.

Design notes: docs/architecture.md, service/models/calibration.py.
"""

from __future__ import annotations

import gc
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
from typing import Annotated, Any

import onnxruntime as ort
from pydantic import BaseModel, ConfigDict, Field, ValidationError, ValidationInfo, model_validator

from service.engines.runtime import RuntimeOptions
from service.errors import json_error_reason
from service.repository import ModelVersion

log = logging.getLogger(__name__)

ROUNDS = 3  # timed runs per variant and batch size, interleaved; the median is kept
# rounds of a candidate beside the reference (`measure_against`): the reference's time is the median of all its pairs'
# rounds, a candidate's of its own; 2, so that the GPT's eight candidates cost about what timing them all together
# in 3 rounds did (32 workloads against 27), which a replica's start-up (and its health check) waits for
ROUNDS_BESIDE = 2
DECODE_STEPS = 16  # one-token steps after a text workload's prompt pass, unless its kind says otherwise
CPUINFO = Path("/proc/cpuinfo")
# The ISA flags that decide which kernels ONNX Runtime's MLAS runs (float: AVX2/FMA or AVX-512; int8: VNNI, AMX)
ISA_FLAGS = ("avx", "avx2", "fma", "f16c", "avx512f", "avx512bw", "avx512vl", "avx512_vnni", "avx_vnni",
             "avx512_bf16", "amx_tile", "amx_int8", "amx_bf16")
HASH_CHUNK = 1 << 20
KEY_DIGITS = 16  # hex digits of a cache key
MEASURED_AT_FORMAT, MEASURED_AT_PATTERN = "%Y-%m-%dT%H:%M:%SZ", r"^\d{4}-\d\d-\d\dT\d\d:\d\d:\d\dZ$"
# A cache of a few hundred entries (~1 kB each) is far below this; a larger file is not one this service wrote.
MAX_CACHE_BYTES = 16 << 20
MAX_REASON_CHARS = 300  # of why a cache or entry is ignored, in its log line
REASON_ERRORS = 3  # schema errors named in that line

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


def calibration_key(model: ModelVersion, provider: str, options: RuntimeOptions, rows: Sequence[int],
                    offered: Sequence[str]) -> dict[str, Any]:
    """Everything the timings of `model`'s variants depend on; its hash (`key_hash`) names the cache entry. The
    session options that change a step's speed are in it (threads, spinning, the one-thread sessions of small
    steps, the fused projections); the weights are what is measured: `offered`, the stored variant first."""
    return {**cpu_identity(), "onnxruntime": ort.__version__, "provider": provider,
            "threads": options.intra_op_threads, "spin": options.spin,
            "single_thread_rows": options.single_thread_rows, "fuse_projections": options.fuse_projections,
            "model": f"{model.name}:{model.version}",
            "graphs": graph_digest(model), "rows": list(rows), "offered": list(offered)}


def key_hash(key: Mapping[str, Any]) -> str:
    return hashlib.sha256(json.dumps(key, sort_keys=True).encode()).hexdigest()[:KEY_DIGITS]


def measure(engines: Mapping[str, Any], workload: Workload, rows: Sequence[int], rounds: int = ROUNDS,
            cold: Sequence[str] | None = None) -> dict[str, dict[int, float]]:
    """Seconds per item of `workload` for each variant's engine and each batch size: variant -> rows -> seconds,
    after one untimed run of each `cold` engine at each size (default: all of them)."""
    for variant in engines if cold is None else cold:
        for size in rows:
            workload(engines[variant], size)
    samples: dict[str, dict[int, list[float]]] = {v: {size: [] for size in rows} for v in engines}
    for _ in range(rounds):
        for variant, engine in engines.items():
            for size in rows:
                started = time.perf_counter()
                items = workload(engine, size)
                samples[variant][size].append((time.perf_counter() - started) / max(items, 1))
    return {v: {size: statistics.median(s) for size, s in by_rows.items()} for v, by_rows in samples.items()}


def measure_against(reference: str, engine: Any, candidates: Sequence[str], build: Callable[[str], Any | None],
                    workload: Workload, rows: Sequence[int], rounds: int = ROUNDS_BESIDE
                    ) -> dict[str, dict[int, float]]:
    """Seconds per item of `reference`'s `engine` and of each candidate variant, each candidate built (`build`:
    None when it cannot build or run here: left out), timed in interleaved rounds beside the reference and dropped
    before the next one is built. So at most two engines (their sessions, arenas and buffers) are held at once, where
    timing every variant together held them all (the release GPT's nine variants: 3.8 GB resident, over a 2 GiB
    container limit). The reference's time is the median of its times beside each candidate."""
    timings: dict[str, dict[int, float]] = {}
    beside: dict[int, list[float]] = {size: [] for size in rows}
    for variant in candidates:
        candidate = build(variant)
        if candidate is None:
            continue
        pair = measure({reference: engine, variant: candidate}, workload, rows, rounds,
                       cold=[variant] if timings else None)  # the reference is warm after its first pair
        del candidate  # its sessions go before the next candidate's are made
        gc.collect()
        timings[variant] = pair[variant]
        for size in rows:
            beside[size].append(pair[reference][size])
    if not timings:
        return measure({reference: engine}, workload, rows, ROUNDS)
    return {reference: {size: statistics.median(times) for size, times in beside.items()}, **timings}


def decode_workload(engine, prompt: Sequence[int], rows: int, steps: int = DECODE_STEPS) -> int:
    """A text engine's prompt pass over `rows` copies of `prompt`, then `steps` greedy one-token steps; the tokens
    it generated."""
    logits, state = engine.prefill([list(prompt)] * rows)
    for _ in range(steps):
        logits = engine.step(state, logits.argmax(-1))
    return rows * (steps + 1)


Seconds = Annotated[float, Field(strict=True, gt=0, allow_inf_nan=False)]  # per item; an int is a float here
Rows = Annotated[int, Field(gt=0)]  # a JSON object's key: the text of a batch size


class CacheEntry(BaseModel):
    """One measurement as `CalibrationCache.put` writes it, valid for the key it is read for (the validation
    context's `key`): that very key, and timings of the stored variant and of no variant the key does not offer,
    each at exactly the key's batch sizes."""
    model_config = ConfigDict(extra="forbid", frozen=True)

    key: dict[str, Any]
    measured_at: Annotated[str, Field(strict=True, pattern=MEASURED_AT_PATTERN)]
    timings: Annotated[dict[str, dict[Rows, Seconds]], Field(min_length=1)]

    @model_validator(mode="after")
    def _measures_the_key(self, info: ValidationInfo) -> CacheEntry:
        key = (info.context or {}).get("key", self.key)
        if self.key != key:
            raise ValueError(f"it was measured elsewhere ({key_difference(self.key, key)})")
        offered, rows = list(key.get("offered") or []), sorted(key.get("rows") or [])
        if not offered or offered[0] not in self.timings or not set(self.timings) <= set(offered):
            raise ValueError(f"it times the variants {sorted(self.timings)}: the stored one (the first of {offered}) "
                             f"must be timed, and no other than those offered")
        for variant, by_rows in self.timings.items():
            if sorted(by_rows) != rows:
                raise ValueError(f"timings.{variant} has the batch sizes {sorted(by_rows)}, not {rows}")
        return self


def differing(found: Mapping[str, Any], wanted: Mapping[str, Any]) -> list[str]:
    """The fields in which a cached key differs from the one wanted."""
    return sorted(f for f in set(found) | set(wanted) if found.get(f) != wanted.get(f))


def key_difference(found: Mapping[str, Any], wanted: Mapping[str, Any]) -> str:
    """"cpu 'AMD EPYC 9654', here 'Intel(R) Xeon(R) ...'": where a cached key differs from this host's."""
    return "; ".join(f"{f} {found.get(f)!r}, here {wanted.get(f)!r}" for f in differing(found, wanted))


def schema_reason(error: ValidationError) -> str:
    """A ValidationError as one line: the first `REASON_ERRORS` problems, each with where it is."""
    problems = [f"{'.'.join(map(str, e['loc'])) or 'entry'}: {e['msg'].removeprefix('Value error, ')}"
                for e in error.errors()[:REASON_ERRORS]]
    return "; ".join(problems) + (f" (and {error.error_count() - REASON_ERRORS} more)"
                                  if error.error_count() > REASON_ERRORS else "")


class CalibrationCache:
    """Measured timings in one JSON file: key hash -> {"key": what was measured where, "measured_at", "timings"}.
    A file or entry that is not a valid measurement of the key asked for is ignored with one log line saying why,
    and the caller measures again; unwritable: logged, and calibration measures at every start (the service still
    starts)."""

    def __init__(self, path: Path | None):
        self.path = path

    def _entries(self) -> tuple[dict[str, Any], str | None]:
        """The file's entries (key hash -> entry as stored, unchecked), and why it has none if it cannot be read
        as a JSON object (None: it is such an object, or there is no file)."""
        if self.path is None or not self.path.exists():
            return {}, None
        try:
            if (size := self.path.stat().st_size) > MAX_CACHE_BYTES:
                return {}, f"it has {size} bytes, more than the {MAX_CACHE_BYTES} a cache can have"
            entries = json.loads(self.path.read_bytes())
        except OSError as error:
            return {}, f"it cannot be read: {error.strerror or type(error).__name__}"
        except (ValueError, RecursionError) as error:  # UnicodeDecodeError is a ValueError
            return {}, f"it is not JSON: {json_error_reason(error)}"
        if not isinstance(entries, dict):
            return {}, f"it is a JSON {type(entries).__name__}, not an object of entries"
        return entries, None

    def get(self, key: Mapping[str, Any]) -> CacheEntry | None:
        """The valid cached measurement for `key`; None (logged, with the reason) if there is none."""
        if self.path is None:
            return None
        entries, reason = self._entries()
        entry, level = entries.get(key_hash(key)), logging.WARNING
        if entry is not None:
            try:
                return CacheEntry.model_validate(entry, context={"key": dict(key)})
            except ValidationError as error:
                reason = f"its entry for this host is not a valid measurement: {schema_reason(error)}"
        elif reason is None:  # not damaged: measured elsewhere, or not yet
            reason, level = self._missing(entries, key), logging.INFO
        log.log(level, "calibration cache %s not used for %s (%s): measuring", self.path, key["model"],
                reason[:MAX_REASON_CHARS])
        return None

    def _missing(self, entries: Mapping[str, Any], key: Mapping[str, Any]) -> str:
        """Why a readable cache has no entry for `key`: the closest entry of the same version, if any, and where
        its key differs."""
        if not self.path.exists():
            return "there is no such file yet"
        same_model = [e["key"] for e in entries.values() if isinstance(e, dict) and isinstance(e.get("key"), dict)
                      and e["key"].get("model") == key["model"]]
        if not same_model:
            return "it has no entry for this version"
        closest = min(same_model, key=lambda found: len(differing(found, key)))
        return f"it has no entry for this host; the closest was measured with {key_difference(closest, key)}"

    def put(self, key: Mapping[str, Any], timings: Mapping[str, Mapping[int, float]]) -> str:
        """Store `timings` under `key` (written to a temporary file, then renamed over the cache); the time
        recorded as measured_at."""
        measured_at = time.strftime(MEASURED_AT_FORMAT, time.gmtime())
        if self.path is None:
            return measured_at
        entries, _ = self._entries()
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
