"""The models this process serves: loading them (engine + scheduler) from the repository, looking them up for a
request, readiness, and stopping their schedulers on shutdown.

Models load in a background thread after the server starts, so `/health/live` answers at once and
`/health/ready` says 503, with reasons, until every configured model is loaded (Kubernetes' startup pattern).

Each model has an active version, the one a request that names no version gets: the version loaded last (at start,
the highest). A request holds a lease on the model version it resolved until its response has ended, so that a
version being unloaded (`service.model_control`) is stopped only once no request can still reach it.
"""

from __future__ import annotations

import logging
import threading
import time
from dataclasses import dataclass, field
from typing import Any

from service.errors import NotFound, Unavailable
from service.metrics import Metrics
from service.repository import ModelRepository, RepositoryError
from service.runtime import RuntimeOptions
from service.settings import Settings

log = logging.getLogger(__name__)


@dataclass(eq=False)
class LoadedModel:
    name: str
    version: int
    kind: str
    engine: Any  # TranslationEngine | GPTEngine | ViTEngine
    scheduler: Any  # ContinuousBatcher | DynamicBatcher
    provider: str
    load_seconds: float
    leases: int = 0  # requests that resolved this version and have not ended
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


def parse_model_spec(spec: str) -> tuple[str, int | None]:
    """'gpt' -> ('gpt', None); 'gpt:3' -> ('gpt', 3)."""
    name, _, version = spec.partition(":")
    if version and not version.isdigit():
        raise ValueError(f"bad model spec {spec!r}: expected NAME or NAME:VERSION")
    return name, int(version) if version else None


class ModelRegistry:
    def __init__(self, settings: Settings, metrics: Metrics):
        self.settings = settings
        self.metrics = metrics
        self.repository = ModelRepository(settings.repository)
        self.loaded: dict[tuple[str, int], LoadedModel] = {}
        self.active: dict[str, int] = {}  # model name -> the version requests that name none get
        self.pending: list[str] = []
        self.errors: dict[str, str] = {}
        self.draining = False
        self._loader: threading.Thread | None = None

    # --- loading ------------------------------------------------------------------------------------------

    def configured(self) -> list[tuple[str, int | None]]:
        specs = self.settings.models or self.repository.model_names()
        return [parse_model_spec(spec) for spec in specs]

    def start_loading(self) -> None:
        self.pending = [f"{n}:{v}" if v else n for n, v in self.configured()]
        if not self.pending:
            self.errors["repository"] = f"no models found in {self.repository.root}"
        self._loader = threading.Thread(target=self._load_all, name="model-loader", daemon=True)
        self._loader.start()

    def _load_all(self) -> None:
        for name, version in self.configured():
            label = f"{name}:{version}" if version else name
            try:
                self.load(name, version)
            except Exception as error:  # a broken model must not take the others down
                log.exception("could not load %s", label)
                self.errors[label] = str(error)
            finally:
                self.pending.remove(label)

    def load(self, name: str, version: int | None = None, warm_up: bool = False) -> LoadedModel:
        """Load a version (default: the highest) and make it the active one; with `warm_up`, one real inference runs
        before any request can reach it."""
        from service.engines.gpt import GPTEngine
        from service.engines.translation import TranslationEngine
        from service.engines.vit import ViTEngine
        from service.scheduling.continuous import ContinuousBatcher

        s = self.settings
        model = self.repository.get(name, version)
        options = RuntimeOptions(device=s.device, intra_op_threads=s.intra_op_threads, spin=s.ort_spin)
        started = time.perf_counter()
        if model.kind == "vit":
            from service.scheduling.dynamic import DynamicBatcher

            engine = ViTEngine(model, options)
            scheduler = DynamicBatcher(engine, model.name, model.version, self.metrics,
                                       max_batch_size=s.vit_max_batch_size, max_queue_delay_ms=s.vit_max_queue_delay_ms,
                                       max_queue=s.max_queue_size, batching=s.vit_batching)
        else:
            engine = (TranslationEngine if model.kind == "translation" else GPTEngine)(model, options)
            max_rows = s.translation_max_batch_rows if model.kind == "translation" else s.gpt_max_batch_rows
            scheduler = ContinuousBatcher(engine, model.name, model.version, self.metrics, max_rows=max_rows,
                                          max_prefill=s.max_prefill_requests, max_queue=s.max_queue_size)
        if warm_up:
            _warm_up(model.kind, engine)
        scheduler.start()
        seconds = time.perf_counter() - started
        loaded = LoadedModel(model.name, model.version, model.kind, engine, scheduler, engine.provider, seconds)
        previous = self.loaded.get((model.name, model.version))
        self.loaded[(model.name, model.version)] = loaded
        self.active[model.name] = model.version
        if previous is not None:  # the same version loaded again: the old copy is retired by its caller
            log.info("replaced %s version %d", model.name, model.version)
        labels = {"model": model.name, "version": str(model.version)}
        self.metrics.declare_model(model.name, model.version, model.kind)
        self.metrics.model_load_seconds.labels(**labels).set(seconds)
        self.metrics.model_info.labels(model=model.name).info(
            {"kind": model.kind, "version": str(model.version), "provider": engine.provider})
        log.info("loaded %s version %d (%s) on %s in %.2fs", model.name, model.version, model.kind,
                 engine.provider, seconds)
        return loaded

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
            if name in self.repository.model_names():
                failed = [f"{spec}: {message}" for spec, message in self.errors.items()
                          if spec.partition(":")[0] == name]
                raise Unavailable(f"model {name!r} is not loaded: "
                                  f"{'; '.join(failed) if failed else 'not configured (TSERVE_MODELS)'}")
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
        reasons = [f"loading {spec}" for spec in self.pending]
        reasons += [f"failed to load {spec}: {message}" for spec, message in self.errors.items()]
        if self.draining:
            reasons.append("draining: the server is shutting down")
        ready = not reasons and bool(self.loaded)
        self.metrics.ready.set(1 if ready else 0)
        return ready, reasons

    def status(self) -> list[dict]:
        names = sorted(set(self.repository.model_names()) | {n for n, _ in self.loaded})
        out = []
        for name in names:
            loaded = sorted(v for (n, v) in self.loaded if n == name)
            try:
                kind = self.repository.get(name).kind
            except RepositoryError:
                kind = self.loaded[(name, loaded[-1])].kind
            active_version = self.active.get(name) if self.active.get(name) in loaded else (loaded or [None])[-1]
            active = self.loaded[(name, active_version)] if loaded else None
            out.append({"name": name, "kind": kind, "versions": self.repository.versions(name),
                        "active_version": active.version if active else None, "loaded_versions": loaded,
                        "provider": active.provider if active else None, "ready": bool(loaded)})
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


def _warm_up(kind: str, engine) -> None:
    """One real inference through a freshly loaded engine (sessions initialised, first-run allocations made), so
    that the first request does not pay for it and a broken model fails here, before it takes requests."""
    import numpy as np

    from service.decoding import GreedySearch

    if kind == "vit":
        engine.logits(np.zeros((1, engine.channels, engine.size, engine.size), np.float32))
    elif kind == "translation":
        engine.translate_ids([engine.source_ids("Hallo.")], lambda _: GreedySearch(2, None))
    else:
        engine.generate([engine.tokenizer.encode("A").ids], lambda _: GreedySearch(2, None))
