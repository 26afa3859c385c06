"""Batch invariance under a constraint: a constrained request (greedy, and seeded sampling) gives the same tokens
alone and in a batch of 16 beside unconstrained and other constrained rows, through `GPTEngine.generate` with many
searches at once and through the service's scheduler (the native `/v1/generate` with `json_schema`, joining and
leaving a running batch: `tests.support.invariance.alone_and_among_others`). The masks are per row
(`service.decoding.constraints.allow_rows`), so a row's choice depends on its own logits and matcher only."""

from __future__ import annotations

import pytest

from service.decoding.constraints import Constraint
from service.decoding.sampling import SamplingSearch
from service.engines.gpt import GPTEngine
from service.repository import ModelRepository
from service.settings import Settings
from tests.support import ROOT
from tests.support.invariance import GPT_PROMPTS, alone_and_among_others

RELEASE = ROOT / "model_repository"
SCHEMA = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 12},
                                           "age": {"type": "integer", "minimum": 0, "maximum": 120},
                                           "tags": {"type": "array", "items": {"enum": ["king", "fool", "nurse"]},
                                                    "maxItems": 2}},
          "required": ["name", "age", "tags"], "additionalProperties": False}
TARGETS = {"greedy": (0.0, None), "sample": (1.0, 11)}
BATCH = 16
MAX_NEW_TOKENS = 100


@pytest.fixture(scope="module")
def engine() -> GPTEngine:
    return GPTEngine(ModelRepository(RELEASE).get("gpt"))


def _other(engine: GPTEngine, i: int):
    """Row i beside the target: unconstrained greedy or sampled, or under a regex or another schema; other prompts
    and budgets, so rows end at other steps."""
    kind = i % 4
    constraint = None
    if kind == 2:
        constraint = Constraint.of("regex", r"[A-Z][a-z]{1,8}( [a-z]{1,8}){0,6}\.", "regex")
    elif kind == 3:
        constraint = Constraint.of("json_schema", {"type": "array", "items": {"type": "integer"}, "maxItems": 5},
                                   "json_schema")
    return lambda: SamplingSearch(8 + 3 * i, engine.eos_id, temperature=0.8 if i % 2 else 0.0, seed=i,
                                  constraint=None if constraint is None else engine.constraints.compile(
                                      constraint).row())


@pytest.mark.parametrize("mode", TARGETS)
@pytest.mark.parametrize("position", [0, BATCH // 2, BATCH - 1])
def test_a_constrained_row_decodes_the_same_alone_and_in_a_mixed_batch_of_16(engine, mode, position):
    temperature, seed = TARGETS[mode]
    constraint = Constraint.of("json_schema", SCHEMA, "json_schema")

    def target():
        return SamplingSearch(MAX_NEW_TOKENS, engine.eos_id, temperature=temperature, seed=seed,
                              constraint=engine.constraints.compile(constraint).row())

    prompt = list(b"ROMEO:\nWhat")
    alone = engine.generate([prompt], lambda i: target())[0].results()[0]
    others = [_other(engine, i) for i in range(BATCH - 1)]
    makers = others[:position] + [target] + others[position:]
    prompts = [list(GPT_PROMPTS[i % len(GPT_PROMPTS)].encode()) for i in range(BATCH)]
    prompts[position] = prompt
    together = engine.generate(prompts, lambda i: makers[i]())[position].results()[0]
    assert alone.finish_reason in ("stop", "eos")
    assert (together.tokens, together.finish_reason, together.score) == (alone.tokens, alone.finish_reason,
                                                                         alone.score)


@pytest.mark.slow
@pytest.mark.parametrize("mode", TARGETS)
def test_a_constrained_request_decodes_the_samealone_and_among_others_through_the_scheduler(serving, mode):
    temperature, seed = TARGETS[mode]
    settings = Settings(repository=RELEASE, models=["gpt"], variant="stored", max_new_tokens=MAX_NEW_TOKENS)
    with serving(settings) as client:
        version = ModelRepository(RELEASE).get("gpt").version
        target = {"prompt": "ROMEO:\nWhat", "max_new_tokens": MAX_NEW_TOKENS, "temperature": temperature,
                  "json_schema": SCHEMA, "version": version, **({"seed": seed} if seed is not None else {})}
        alone, together = alone_and_among_others(client, "gpt", target)
        assert alone[1] in ("stop", "eos"), alone
        assert together == [alone] * len(together), mode
