"""Loading and unloading model versions while the server runs (Triton's explicit model-control mode), without
interrupting traffic. Off unless `TSERVE_MODEL_CONTROL=true`; loads and unloads run one at a time.

- load: the version's sessions are created and warmed with one real inference in a worker thread, and only then
  does it take requests, as the model's active version; a version that fails to load answers 400 with the reason.
- unload: the version leaves routing at once; its in-flight requests finish (at most `TSERVE_DRAIN_TIMEOUT_S`),
  then its scheduler stops and its sessions are freed; a request still running then fails with a 503 saying its
  version was unloaded (`VersionUnloaded`), not that the server shut down.

The index lists the folders the repository skips (`ModelRepository.problems`) as UNAVAILABLE, with why.

Invariant: traffic is not interrupted: a failed load leaves what is serving untouched, and an unloaded version's
in-flight requests finish before its scheduler stops (within `TSERVE_DRAIN_TIMEOUT_S`).

Design notes: docs/architecture.md, service/models/control.py.
"""

from __future__ import annotations

import asyncio
import logging
import time

from starlette.concurrency import run_in_threadpool

from service.errors import BadInput, NotFound, ServiceError
from service.models.registry import LoadedModel, ModelRegistry, freeze_long_lived_objects
from service.repository import MAX_VERSION, RepositoryError, VersionNotFound
from service.repository import parse_version as parse_version_text
from service.scheduling.queueing import unloading

log = logging.getLogger(__name__)

IDLE_POLL_S = 0.05  # how often a retiring version is checked for its last requests


class ModelControlDisabled(ServiceError):
    status, type, reason = 403, "model_control_disabled", "bad_input"


class LoadFailed(ServiceError):
    status, type, reason = 400, "load_failed", "bad_input"


class ModelControl:
    def __init__(self, registry: ModelRegistry, enabled: bool, drain_timeout_s: float):
        self.registry = registry
        self.enabled = enabled
        self.drain_timeout_s = drain_timeout_s
        self.failures: dict[tuple[str, int], str] = {}  # the last failed load of a version, and why
        self.loading: set[tuple[str, int]] = set()
        self._lock = asyncio.Lock()

    def check_enabled(self) -> None:
        if not self.enabled:
            raise ModelControlDisabled("model control is off; start the server with TSERVE_MODEL_CONTROL=true")

    def index(self) -> list[dict]:
        """Every version of every model in the repository (and every loaded one), with its state; every folder the
        repository skips too, UNAVAILABLE with the reason (`version` is the folder's name, "" for a model folder)."""
        registry = self.registry
        entries = []
        names = sorted(set(registry.repository.model_names()) | {n for n, _ in registry.loaded})
        for name in names:
            versions = sorted(set(registry.repository.versions(name)) | {v for n, v in registry.loaded if n == name})
            for version in versions:
                key = (name, version)
                if key in registry.loaded:
                    state, reason = "READY", ("active" if registry.active.get(name) == version else "")
                elif key in self.loading:
                    state, reason = "LOADING", ""
                else:
                    state, reason = "UNAVAILABLE", self.failures.get(key, "not loaded")
                entries.append({"name": name, "version": str(version), "state": state, "reason": reason})
        listed = {(e["name"], e["version"]) for e in entries}
        entries += [{"name": p.name, "version": p.version, "state": "UNAVAILABLE", "reason": p.reason}
                    for p in registry.repository.problems() if (p.name, p.version) not in listed]
        return sorted(entries, key=lambda e: (e["name"], len(e["version"]), e["version"]))

    async def load(self, name: str, version: int | None) -> LoadedModel:
        self.check_enabled()
        try:
            model = self.registry.repository.get(name, version)
        except VersionNotFound as error:
            raise NotFound(str(error)) from None
        except RepositoryError as error:  # the folder is there, but not a valid model: the operator's to fix
            if version is not None:
                self.failures[(name, version)] = f"failed to load: {error}"
            raise LoadFailed(f"model {name!r} failed to load: {error}") from None
        key = (model.name, model.version)
        async with self._lock:
            previous = self.registry.loaded.get(key)
            self.loading.add(key)
            try:
                loaded = await run_in_threadpool(self.registry.load, model.name, model.version)
            except Exception as error:  # a broken version: what is serving stays as it is
                log.exception("could not load %s version %d", *key)
                self.failures[key] = f"failed to load: {error}"
                raise LoadFailed(f"model {name!r} version {model.version} failed to load: {error}") from None
            finally:
                self.loading.discard(key)
            self.failures.pop(key, None)
            if previous is not None:  # the same version loaded again: retire the copy it replaced
                await run_in_threadpool(self._retire, previous)
            del previous
            await run_in_threadpool(freeze_long_lived_objects)  # the new sessions frozen, a replaced copy freed
            log.info("model control: %s version %d loaded and active", *key)
            return loaded

    async def unload(self, name: str, version: int | None) -> list[int]:
        self.check_enabled()
        async with self._lock:
            versions = [version] if version is not None else sorted(v for n, v in self.registry.loaded if n == name)
            if not versions:
                raise NotFound(f"model {name!r} has no loaded version")
            retiring = [self.registry.unload(name, v) for v in versions]  # out of routing at once
            for loaded in retiring:
                await run_in_threadpool(self._retire, loaded)
            del retiring, loaded  # the last references: the sessions are freed now, frozen or not
            await run_in_threadpool(freeze_long_lived_objects)
            return versions

    def _retire(self, loaded: LoadedModel) -> None:
        """Wait for the version's last requests (at most the drain timeout), stop its scheduler, free its sessions."""
        deadline = time.monotonic() + self.drain_timeout_s
        loaded.wait_unleased(self.drain_timeout_s)
        while (loaded.scheduler.queue_depth or loaded.scheduler.running) and time.monotonic() < deadline:
            time.sleep(IDLE_POLL_S)
        loaded.scheduler.stop(timeout=max(0.0, deadline - time.monotonic()),
                              closing=unloading(loaded.name, loaded.version, self.drain_timeout_s))
        log.info("model control: %s version %d unloaded", loaded.name, loaded.version)


def parse_version(value) -> int | None:
    """A version from a request: None, a positive int, or its string (as the protocol writes versions: ASCII
    digits, no leading zero; `"²"` or `"03"` is not a version)."""
    if value is None:
        return None
    if isinstance(value, int) and not isinstance(value, bool) and 1 <= value <= MAX_VERSION:
        return value
    if isinstance(value, str) and (number := parse_version_text(value)) is not None:
        return number
    raise BadInput(f"version {value!r} is not a version number (a positive integer up to {MAX_VERSION}, "
                   "written without leading zeros)")
