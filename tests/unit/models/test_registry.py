"""The model registry: a model that failed to load is reported as failed, with its error, whether it was
configured by name or by name:version (the errors are kept under the configured spec)."""

from __future__ import annotations

import asyncio
import gc
import shutil
import time
import weakref

import pytest

from service.errors import Unavailable
from service.models.control import ModelControl
from service.models.registry import ModelRegistry, freeze_long_lived_objects
from service.observability.metrics import Metrics
from service.settings import Settings

pytestmark = pytest.mark.slow


@pytest.mark.parametrize("spec", ["gpt", "gpt:1"])
def test_a_model_that_failed_to_load_says_why(tiny_repository, tmp_path, spec):
    repository = tmp_path / "repository"
    shutil.copytree(tiny_repository / "gpt", repository / "gpt")
    (repository / "gpt" / "1" / "decoder.onnx").write_bytes(b"not an onnx graph")
    registry = ModelRegistry(Settings(repository=repository, models=[spec]), Metrics())
    registry.start_loading()
    deadline = time.monotonic() + 30
    while registry.pending and time.monotonic() < deadline:
        time.sleep(0.05)
    ready, reasons = registry.readiness()
    assert not ready and any(reason.startswith(f"failed to load {spec}") for reason in reasons), reasons
    with pytest.raises(Unavailable) as raised:
        registry.resolve("gpt", None, None)
    message = raised.value.message
    assert "not configured" not in message and f"{spec}:" in message, message
    registry.stop(timeout=1)


def test_the_kinds_table_has_one_entry_per_kind_a_config_may_name():
    from service.models.kinds import KIND_TABLE
    from service.repository import KINDS

    assert tuple(KIND_TABLE) == KINDS and all(entry.name == kind for kind, entry in KIND_TABLE.items())


def test_each_kind_loads_with_its_engine_scheduler_and_metric_series(tiny_repository):
    """The kinds table, through the registry: the engine class, the scheduler and its size setting per kind, and
    the series declared at zero (generated tokens per decoding mode for text, images for the ViT)."""
    from service.engines.gpt import GPTEngine
    from service.engines.translation import TranslationEngine
    from service.engines.vit import ViTEngine
    from service.scheduling.continuous import ContinuousBatcher
    from service.scheduling.dynamic import DynamicBatcher

    metrics = Metrics()
    settings = Settings(repository=tiny_repository, translation_max_batch_rows=7, gpt_max_batch_rows=9,
                        vit_max_batch_size=5)
    registry = ModelRegistry(settings, metrics)
    try:
        translation, gpt, vit = (registry.load(name) for name in ("translation", "gpt", "vit"))
        assert isinstance(translation.engine, TranslationEngine) and isinstance(gpt.engine, GPTEngine)
        assert isinstance(vit.engine, ViTEngine)
        assert isinstance(translation.scheduler, ContinuousBatcher) and translation.scheduler.max_rows == 7
        assert isinstance(gpt.scheduler, ContinuousBatcher) and gpt.scheduler.max_rows == 9
        assert isinstance(vit.scheduler, DynamicBatcher) and vit.scheduler.max_batch_size == 5
        modes = {}
        for sample in metrics.generated_tokens.collect()[0].samples:
            modes.setdefault(sample.labels["model"], set()).add(sample.labels["mode"])
        assert modes == {"translation": {"greedy", "beam"}, "gpt": {"greedy", "beam", "sample"}}
        images = {s.labels["model"] for s in metrics.images.collect()[0].samples}
        prompts = {s.labels["model"] for s in metrics.prompt_tokens.collect()[0].samples}
        assert images == {"vit"} and prompts == {"translation", "gpt"}
    finally:
        registry.stop(timeout=1)


@pytest.mark.parametrize("setting, gpt_rows, translation_rows", [(None, 1, 0), (0, 0, 0), (4, 4, 4)],
                         ids=["each-kind's-own", "off", "set"])
@pytest.mark.parametrize("workers", [1, 2])
def test_one_thread_steps_follow_the_kind_unless_the_setting_says(tiny_repository, setting, gpt_rows,
                                                                  translation_rows, workers):
    """TSERVE_SINGLE_THREAD_ROWS unset: the GPT's one-row steps run on a one-thread session and translation's
    steps never (service.models.kinds); set, the one value holds for both. With several decoding workers a
    one-thread session is there for the calls made beside another (`OneThreadSession.call`)."""
    settings = Settings(repository=tiny_repository, intra_op_threads=2, single_thread_rows=setting,
                        decoding_workers=workers)
    registry = ModelRegistry(settings, Metrics())
    try:
        for name, rows in (("gpt", gpt_rows), ("translation", translation_rows)):
            engine = registry.load(name).engine
            holder = engine._one_thread if engine._in_place is None else engine._in_place.one_thread
            assert holder.max_rows == rows and holder.when_concurrent == (workers > 1), name
            assert (holder.session is not None) == (rows > 0 or workers > 1), name
    finally:
        registry.stop(timeout=1)


def test_what_start_up_made_is_frozen_out_of_later_collections(tiny_repository):
    """Once the configured models are loaded, every object alive is in CPython's permanent generation
    (`freeze_long_lived_objects`): a full collection under load does not go through the web stack and the engines."""
    made_before = [object()]  # tracked by the collector until frozen
    registry = ModelRegistry(Settings(repository=tiny_repository, models=["gpt"]), Metrics())
    try:
        registry.start_loading()
        registry._loader.join(timeout=60)
        assert gc.get_freeze_count() > 0
        assert not any(o is made_before for o in gc.get_objects())  # frozen objects are not collected any more
    finally:
        gc.unfreeze()  # the other tests' objects go back to the collector
        registry.stop(timeout=1)


def test_a_version_unloaded_after_the_freeze_is_freed(tiny_repository):
    """Model control thaws and collects before freezing again (`freeze_long_lived_objects`): the sessions of a
    version unloaded at run time are freed (here one that only the cyclic collector can free), not kept in the
    permanent generation with the start-up objects."""
    registry = ModelRegistry(Settings(repository=tiny_repository, models=["gpt"]), Metrics())
    try:
        registry.start_loading()
        registry._loader.join(timeout=60)
        loaded = registry.loaded[("gpt", 1)].engine
        loaded.cycle = [loaded]  # a version that only the cyclic collector can free, frozen with the rest
        freeze_long_lived_objects()
        assert gc.get_freeze_count() > 0
        engine = weakref.ref(loaded)
        del loaded
        versions = asyncio.run(ModelControl(registry, enabled=True, drain_timeout_s=1).unload("gpt", 1))
        assert versions == [1] and engine() is None
    finally:
        gc.unfreeze()
        registry.stop(timeout=1)
