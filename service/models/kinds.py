"""What each kind of model is, in one table (`KIND_TABLE`): its engine, how its scheduler is built, its warm-up
inference, the workload its weights variants are timed with (`service.models.calibration`) and the decoding modes its
metrics count. The kinds' names (`TRANSLATION`, `GPT`, `VIT`) are `service.repository`'s; their tensors in the Open
Inference Protocol are `service.api.oip.signatures`'.

- translation: `TranslationEngine`, a continuous batcher of at most `TSERVE_TRANSLATION_MAX_BATCH_ROWS` rows per
  worker (`TSERVE_DECODING_WORKERS` of them);
- gpt: `GPTEngine`, a continuous batcher of at most `TSERVE_GPT_MAX_BATCH_ROWS` rows per worker, with n-gram
  speculation for greedy requests when `TSERVE_SPECULATION=ngram`;
- vit: `ViTEngine`, the dynamic batcher (`TSERVE_VIT_MAX_BATCH_SIZE` images, waiting `TSERVE_VIT_MAX_QUEUE_DELAY_MS`).

Invariant: the registry loads a version through its kind's entry; no other module branches on a kind's name to
learn these. Each kind's vocabulary is checked against its graphs before the version serves.

Design notes: docs/architecture.md, service/models/kinds.py.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from service.engines.gpt import GPTEngine
from service.engines.runtime import DEFAULT_SINGLE_THREAD_ROWS
from service.engines.translation import TranslationEngine
from service.engines.vit import ViTEngine
from service.models.calibration import decode_workload
from service.repository import GPT, TRANSLATION, VIT, ModelVersion
from service.models.warmup import check_length_penalty, grey_images, warm_up_images, warm_up_text
from service.observability.metrics import BEAM, GREEDY, SAMPLE, Metrics
from service.scheduling.continuous import ContinuousBatcher
from service.scheduling.dynamic import DynamicBatcher
from service.scheduling.priority import DEFAULT_PRIORITY, PriorityPolicy
from service.scheduling.speculation import SpeculationConfig
from service.per_model import value_for
from service.settings import Settings

log = logging.getLogger(__name__)

# The warm-up inputs: a short German sentence for the translator (a source it truncates nothing of), a one-token
# prompt for the GPT (any text encodes to at least one token), and one image of one mid-grey level, scaled to
# [0, 1] as a decoded image is before normalising (the same input for any normalisation the config chooses).
TRANSLATION_WARM_UP_SOURCE = "Hallo."
GPT_WARM_UP_PROMPT = "A"
WARM_UP_GREY = 0.5
# The calibration inputs: a source and a prompt of typical length (a Multi30k-like sentence, a line of verse)
TRANSLATION_CALIBRATION_SOURCE = "Ein Mann mit einem orangefarbenen Hut starrt auf etwas."
GPT_CALIBRATION_PROMPT = "ROMEO:\nBut soft, what light"
# ... and the steps they are continued by, a served request's length (a translation's is `DECODE_STEPS`): a GPT
# continuation's 128 new tokens, a length that decides the GPT's choice of variant (see the module's design notes).
GPT_CALIBRATION_STEPS = 128

# (engine, the version, metrics, settings) -> its scheduler, not yet started
SchedulerFactory = Callable[[Any, ModelVersion, Metrics, Settings], Any]


@dataclass(frozen=True)
class ModelKind:
    name: str
    engine: type  # built as engine(version, runtime options)
    scheduler: SchedulerFactory
    warm_up: Callable[[Any], None]  # one checked inference through a loaded engine; `WarmUpFailed` if it cannot serve
    decoding_modes: tuple[str, ...]  # the `mode` labels of its generated tokens; none: it generates no tokens
    max_rows: Callable[[Settings], int]  # the largest batch its scheduler runs (rows or images)
    calibration: Callable[[Any, int], int]  # (engine, rows) -> items produced: the workload variants are timed with
    calibration_unit: str  # what an item of that workload is
    # decoder calls of at most this many rows on a one-thread session unless TSERVE_SINGLE_THREAD_ROWS says
    # otherwise (`OneThreadSession`, `DEFAULT_SINGLE_THREAD_ROWS`)
    single_thread_rows: int = 0


def continuous_batcher(max_rows: Callable[[Settings], int], speculates: bool = False) -> SchedulerFactory:
    """A text kind's scheduler: the continuous batcher, holding at most `max_rows(settings)` rows; `speculates`:
    with n-gram speculation as `TSERVE_SPECULATION` says, where its engine can verify drafts."""

    def build(engine, model: ModelVersion, metrics: Metrics, s: Settings) -> ContinuousBatcher:
        speculation = SpeculationConfig.from_settings(s) if speculates else None
        if speculation is not None and not engine.speculates:
            log.warning("%s:%d: TSERVE_SPECULATION=%s is not used: its KV cache (int8, or in a device's memory) cannot "
                        "be verified (docs/speculation.md)", model.name, model.version, s.speculation)
            speculation = None
        return ContinuousBatcher(engine, model.name, model.version, metrics, max_rows=max_rows(s),
                                 max_prefill=s.max_prefill_requests, max_queue=s.max_queue_size,
                                 workers=s.decoding_workers, speculation=speculation,
                                 priority=priority_policy(model, s))

    return build


def _translation_rows(s: Settings) -> int:
    return s.translation_max_batch_rows


def _gpt_rows(s: Settings) -> int:
    return s.gpt_max_batch_rows


def _vit_images(s: Settings) -> int:
    return s.vit_max_batch_size


def priority_policy(model: ModelVersion, s: Settings) -> PriorityPolicy:
    """The version's priority levels, its default level (TSERVE_DEFAULT_PRIORITY, per model) and the wait after which
    any request is served first."""
    default = value_for(s.default_priorities, model.name, min(DEFAULT_PRIORITY, s.priority_levels - 1))
    return PriorityPolicy(levels=s.priority_levels, default=default, max_wait_s=s.priority_max_wait_s,
                          headroom_rows=s.priority_headroom_rows)


def dynamic_batcher(engine, model: ModelVersion, metrics: Metrics, s: Settings) -> DynamicBatcher:
    """The image kind's scheduler: the dynamic batcher (Triton's), with the ViT's batch size and queue delay."""
    return DynamicBatcher(engine, model.name, model.version, metrics, max_batch_size=s.vit_max_batch_size,
                          max_queue_delay_ms=s.vit_max_queue_delay_ms, max_queue=s.max_queue_size,
                          batching=s.vit_batching, priority=priority_policy(model, s))


def _warm_up_translation(engine: TranslationEngine) -> None:
    check_length_penalty(engine)
    warm_up_text(engine, engine.source_ids(TRANSLATION_WARM_UP_SOURCE))


def _warm_up_gpt(engine: GPTEngine) -> None:
    engine.reserve_prefix_cache()
    warm_up_text(engine, engine.tokenizer.encode(GPT_WARM_UP_PROMPT).ids)


def _warm_up_vit(engine: ViTEngine) -> None:
    warm_up_images(engine, WARM_UP_GREY)


def _time_translation(engine: TranslationEngine, rows: int) -> int:
    return decode_workload(engine, engine.source_ids(TRANSLATION_CALIBRATION_SOURCE), rows)


def _time_gpt(engine: GPTEngine, rows: int) -> int:
    prompt = engine.tokenizer.encode(GPT_CALIBRATION_PROMPT).ids
    return decode_workload(engine, prompt, rows, min(GPT_CALIBRATION_STEPS, engine.context_length - len(prompt)))


def _time_vit(engine: ViTEngine, images: int) -> int:
    engine.logits(grey_images(engine, images, WARM_UP_GREY))
    return images


KIND_TABLE: dict[str, ModelKind] = {
    TRANSLATION: ModelKind(TRANSLATION, TranslationEngine, continuous_batcher(_translation_rows),
                           _warm_up_translation, decoding_modes=(GREEDY, BEAM), max_rows=_translation_rows,
                           calibration=_time_translation, calibration_unit="token",
                           single_thread_rows=DEFAULT_SINGLE_THREAD_ROWS[TRANSLATION]),
    GPT: ModelKind(GPT, GPTEngine, continuous_batcher(_gpt_rows, speculates=True), _warm_up_gpt,
                   decoding_modes=(GREEDY, BEAM, SAMPLE), max_rows=_gpt_rows, calibration=_time_gpt,
                   calibration_unit="token", single_thread_rows=DEFAULT_SINGLE_THREAD_ROWS[GPT]),
    VIT: ModelKind(VIT, ViTEngine, dynamic_batcher, _warm_up_vit, decoding_modes=(), max_rows=_vit_images,
                   calibration=_time_vit, calibration_unit="image"),
}
