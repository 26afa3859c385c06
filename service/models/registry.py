"""The models this process serves: loading them (engine + scheduler) from the repository, looking them up for a
request, readiness, and stopping their schedulers on shutdown. Follows Kubernetes' startup pattern: models load in
a background thread after the server starts, so `/health/live` answers at once and `/health/ready` says 503, with
reasons, until every configured model has a loaded version.

A version is loaded as its kind says (`service.models.kinds`), in the weights variant chosen for this host
(`service.models.variants`), and warmed with one real inference, its outputs checked (`service.models.warmup`).
Each model's active version (the version loaded last; at start, the highest) answers requests that name none.

Invariant: a version that loads serves (one that fails the warm-up, or whose tokenizer does not fit its graphs, is
not loaded), and a request holds a lease on its version until its response has ended, so that an unloaded version
is stopped only once no request can still reach it.

Design notes: docs/architecture.md, service/models/registry.py.
"""

from __future__ import annotations

import gc
import logging
import threading
import time
from dataclasses import dataclass, field
from typing import Any

from service.engines.prefix_cache import MIB
from service.engines.runtime import RuntimeOptions
from service.errors import NotFound, Unavailable
from service.models.calibration import CalibrationCache
from service.models.kinds import KIND_TABLE
from service.repository import ModelRepository, RepositoryError, parse_version
from service.models.variants import Choice, load_engine, pin_for
from service.observability.metrics import Metrics
from service.response_cache.cache import ResponseCache
from service.settings import Settings

log = logging.getLogger(__name__)


def freeze_long_lived_objects() -> None:
    """Move every object alive now (once the configured models are loaded: the web stack, the engines, the
    tokenizers, ~100k of them) to CPython's permanent generation (`gc.freeze`), which later collections do not
    traverse, as Instagram's and vLLM's servers do: under load a full collection went through all of them, ~75 ms
    with the GIL held (every decoding worker and the event loop stopped), every few seconds (docs/benchmarks.md).
    Objects made later are collected as usual. Called again after a model version is loaded or unloaded at run
    time (`service.models.control`): the frozen objects are thawed and collected first, so that a retired
    version's sessions are freed, not kept frozen."""
    gc.unfreeze()
    gc.collect()
    gc.freeze()


@dataclass(eq=False)
class LoadedModel:
    name: str
    version: int
    kind: str
    engine: Any  # its kind's engine (`service.models.kinds`)
    scheduler: Any  # its kind's scheduler: a ContinuousBatcher or the DynamicBatcher
    provider: str
    load_seconds: float
    variant: dict[str, Any] = field(default_factory=dict)  # how its graphs compute (`ModelVersion.variant`, the
    # weights as chosen) and how the weights were chosen (`Choice.report`, `reason`, `not_offered`: variant -> why)
    leases: int = 0  # requests that resolved this version and have not ended
    # the response cache as this version sees it (`service.response_cache.cache.VersionCache`); None: off
    response_cache: Any = None
    _released: threading.Condition = field(default_factory=threading.Condition, repr=False)

    def acquire(self) -> None:
        with self._released:
            self.leases += 1

    def release(self) -> None:
        with self._released:
            self.leases -= 1
            self._released.notify_all()

    def wait_unleased(self, timeout: float) -> bool:
        """Block until no request holds this version (True), or `timeout` seconds passed (False)."""
        with self._released:
            return self._released.wait_for(lambda: self.leases <= 0, timeout=timeout)


def runtime_options(s: Settings, kind) -> RuntimeOptions:
    """How a version of `kind` (a `ModelKind`) builds its sessions under settings `s`."""
    single_thread_rows = kind.single_thread_rows if s.single_thread_rows is None else s.single_thread_rows
    return RuntimeOptions(device=s.device, intra_op_threads=s.intra_op_threads, spin=s.ort_spin,
                          single_thread_rows=single_thread_rows, one_thread_when_concurrent=s.decoding_workers > 1,
                          fuse_projections=s.fuse_projections, kv_residence=s.kv_residence,
                          prefix_cache_bytes=s.prefix_cache_mb * MIB if s.prefix_cache else 0)


def calibration_rows(s: Settings, kind) -> list[int]:
    """The batch sizes `auto` times a version's variants at (TSERVE_CALIBRATE_FOR): one row and the largest batch its
    scheduler runs, or the largest only."""
    largest = kind.max_rows(s)
    return [largest] if s.calibrate_for == "throughput" else sorted({1, largest})


def parse_model_spec(spec: str) -> tuple[str, int | None]:
    """'gpt' -> ('gpt', None); 'gpt:3' -> ('gpt', 3)."""
    name, colon, version = spec.partition(":")
    number = parse_version(version)
    if not name or (colon and number is None):
        raise ValueError(f"bad model spec {spec!r}: expected NAME or NAME:VERSION (a positive integer)")
    return name, number


class ModelRegistry:
    def __init__(self, settings: Settings, metrics: Metrics):
        self.settings = settings
        self.metrics = metrics
        self.repository = ModelRepository(settings.repository, settings.model_name)
        self.loaded: dict[tuple[str, int], LoadedModel] = {}
        self.active: dict[str, int] = {}  # model name -> the version requests that name none get
        self.pending: list[str] = []
        self.errors: dict[str, str] = {}
        self.expected: list[str] = []  # the models configured at start: readiness needs a loaded version of each
        self.calibration = CalibrationCache(settings.calibration_cache_path)
        self.response_cache = ResponseCache(settings, metrics)
        self.draining = False
        self._loader: threading.Thread | None = None

    # --- loading ------------------------------------------------------------------------------------------

    def configured(self) -> list[tuple[str, int | None]]:
        if self.settings.models:
            return [parse_model_spec(spec) for spec in self.settings.models]
        return [(name, None) for name in self.repository.model_names()]

    def start_loading(self) -> None:
        configured = self.configured()
        self.expected = sorted({name for name, _ in configured})
        self.pending = [f"{n}:{v}" if v else n for n, v in configured]
        if not self.pending:  # and why each folder there is skipped, when there is one (an invalid config.json)
            skipped = "; ".join(f"{p.folder}: {p.reason}" for p in self.repository.problems())
            self.errors["repository"] = f"no models found in {self.repository.root}" + (
                f" (skipped {skipped})" if skipped else "")
        self._loader = threading.Thread(target=self._load_all, name="model-loader", daemon=True)
        self._loader.start()

    def _load_all(self) -> None:
        for name, version in self.configured():
            label = f"{name}:{version}" if version else name
            try:
                self.load(name, version)
            except RepositoryError as error:  # no such model, or not a valid one: the reason says which field
                log.error("could not load %s: %s", label, error)
                self.errors[label] = str(error)
            except Exception as error:  # a broken model must not take the others down
                log.exception("could not load %s", label)
                self.errors[label] = str(error)
            finally:
                self.pending.remove(label)
        freeze_long_lived_objects()

    def load(self, name: str, version: int | None = None) -> LoadedModel:
        """Load a version (default: the highest) as its kind says, warm it up (one real inference, checked:
        `service.models.warmup.WarmUpFailed`) before any request can reach it, and make it the active one."""
        s = self.settings
        model = self.repository.get(name, version)
        kind = KIND_TABLE[model.kind]
        options = runtime_options(s, kind)
        started = time.perf_counter()
        engine, choice = load_engine(model, kind, options, pin_for(s.variant_pins, model.name),
                                     calibration_rows(s, kind), self.calibration)
        scheduler = kind.scheduler(engine, model, self.metrics, s)
        kind.warm_up(engine)
        scheduler.start()
        seconds = time.perf_counter() - started
        variant = {**model.variant, "weights": choice.weights, "stored_weights": model.variant["weights"],
                   **choice.report()}
        if hasattr(engine, "kv_residence"):  # the decoders': where their KV caches live ("device" or "host")
            variant["kv_residence"] = engine.kv_residence
        details = {"reason": choice.reason, "not_offered": choice.not_offered}
        if hasattr(engine, "prefix_caching"):  # the GPT's (`service.engines.prefix_cache`): on or off, and why
            variant["prefix_cache"] = "on" if engine.prefix_caching["enabled"] else "off"
            # n-gram speculation (`service.scheduling.speculation`): ngram where its scheduler speculates
            variant["speculation"] = s.speculation if getattr(scheduler, "speculation", None) else "off"
            details["prefix_caching"] = {key: str(value).lower() if isinstance(value, bool) else str(value)
                                         for key, value in engine.prefix_caching.items()}
        loaded = LoadedModel(model.name, model.version, model.kind, engine, scheduler, engine.provider, seconds,
                             {**variant, **details})
        loaded.response_cache = self.response_cache.for_version(model.name, model.version, model.kind,
                                                                engine.provider, variant, model.config)
        previous = self.loaded.get((model.name, model.version))
        self.loaded[(model.name, model.version)] = loaded
        self.active[model.name] = model.version
        # a failure at start is over once a version of the model serves (a new dict: readers may be iterating)
        self.errors = {spec: m for spec, m in self.errors.items() if spec.partition(":")[0] != model.name}
        if previous is not None:  # the same version loaded again: the old copy is retired by its caller
            log.info("replaced %s version %d", model.name, model.version)
        labels = {"model": model.name, "version": str(model.version)}
        self.metrics.declare_model(model.name, model.version, kind.decoding_modes)
        self.metrics.model_load_seconds.labels(**labels).set(seconds)
        self.metrics.model_info.labels(model=model.name).info(
            {"kind": model.kind, "version": str(model.version), "provider": engine.provider, **variant})
        self._report_calibration(model.name, model.version, choice)
        log.info("loaded %s version %d (%s) on %s with %s weights (%s) in %.2fs", model.name, model.version,
                 model.kind, engine.provider, choice.weights, choice.chosen_by, seconds)
        return loaded

    def _report_calibration(self, name: str, version: int, choice: Choice) -> None:
        for weights, by_rows in choice.timings.items():
            for rows, seconds in by_rows.items():
                self.metrics.variant_seconds.labels(model=name, version=str(version), weights=weights,
                                                    rows=str(rows)).set(seconds)

    # --- lookup and state ---------------------------------------------------------------------------------

    def resolve(self, kind: str | None, name: str | None, version: int | None) -> LoadedModel:
        """The loaded model a request asks for (its kind's default when unnamed, the highest loaded version);
        `kind` None: a named model of any kind (the Open Inference Protocol names the model in the path)."""
        if self.draining:
            raise Unavailable("the server is draining (shutting down); retry on another replica")
        name = name or kind
        versions = sorted(v for (n, v) in self.loaded if n == name)
        if not versions:
            if any(spec.partition(":")[0] == name for spec in self.pending):
                raise Unavailable(f"model {name!r} is still loading")
            failed = [f"{spec}: {message}" for spec, message in dict(self.errors).items()
                      if spec.partition(":")[0] == name]
            if failed:
                raise Unavailable(f"model {name!r} is not loaded: {'; '.join(failed)}")
            if available := self.repository.versions(name):
                why = "every version was unloaded" if name in self.expected else "it is not in TSERVE_MODELS"
                how = f"; load one with POST /v2/repository/models/{name}/load" if self.settings.model_control else ""
                raise NotFound(f"model {name!r} has no loaded version ({why}; versions in the repository: "
                               f"{available}{how})")
            known = sorted({n for n, _ in self.loaded})
            raise NotFound(f"model {name!r} not found (loaded models: {', '.join(known) or 'none'})")
        if version is None:
            version = self.active.get(name) if self.active.get(name) in versions else versions[-1]
        elif version not in versions:
            raise NotFound(f"model {name!r} has no loaded version {version} (loaded: {versions})")
        loaded = self.loaded[(name, version)]
        if kind is not None and loaded.kind != kind:
            raise NotFound(f"model {name!r} is a {loaded.kind} model; this endpoint serves {kind} models")
        return loaded

    def readiness(self) -> tuple[bool, list[str]]:
        errors, pending = dict(self.errors), list(self.pending)  # the loader thread changes them
        reasons = [f"loading {spec}" for spec in pending]
        reasons += [f"failed to load {spec}: {message}" for spec, message in errors.items()]
        explained = {spec.partition(":")[0] for spec in [*errors, *pending]}
        loaded = {n for n, _ in self.loaded}
        reasons += [f"model {name} has no loaded version (every version was unloaded)"
                    for name in self.expected if name not in loaded and name not in explained]
        if self.draining:
            reasons.append("draining: the server is shutting down")
        ready = not reasons and bool(self.loaded)
        self.metrics.ready.set(1 if ready else 0)
        return ready, reasons

    def status(self) -> list[dict]:
        """Every model with a valid version in the repository or a loaded one (folders the repository skips are not
        here; the repository index reports them), with `created`: the Unix time its active (else highest) version's
        folder was last changed, 0 if that folder is gone."""
        names = sorted(set(self.repository.model_names()) | {n for n, _ in self.loaded})
        out = []
        for name in names:
            loaded = sorted(v for (n, v) in self.loaded if n == name)
            versions = self.repository.versions(name)
            active_version = self.active.get(name) if self.active.get(name) in loaded else (loaded or [None])[-1]
            active = self.loaded[(name, active_version)] if loaded else None
            if active is not None:
                kind, shown = active.kind, active.version
            else:
                try:
                    model = self.repository.get(name)
                except RepositoryError:  # changed since it was listed: the next listing shows what is there
                    continue
                kind, shown = model.kind, model.version
            folder = self.repository.folder(name)
            try:
                created = int((folder / str(shown)).stat().st_mtime) if folder else 0
            except OSError:
                created = 0
            out.append({"name": name, "kind": kind, "versions": versions, "created": created,
                        "active_version": active.version if active else None, "loaded_versions": loaded,
                        "provider": active.provider if active else None,
                        "variant": active.variant if active else None, "ready": bool(loaded),
                        "response_cache": active.response_cache.report() if active else None})
        return out

    def unload(self, name: str, version: int) -> LoadedModel:
        """Take a loaded version out of routing (new requests no longer reach it); the caller retires it. The active
        version moves to the highest one still loaded."""
        loaded = self.loaded.pop((name, version), None)
        if loaded is None:
            raise NotFound(f"model {name!r} has no loaded version {version}")
        if self.active.get(name) == version:
            remaining = sorted(v for (n, v) in self.loaded if n == name)
            if remaining:
                self.active[name] = remaining[-1]
            else:
                del self.active[name]
        return loaded

    def stop(self, timeout: float) -> None:
        self.draining = True
        deadline = time.monotonic() + timeout
        for loaded in self.loaded.values():
            loaded.scheduler.stop(max(0.0, deadline - time.monotonic()))

