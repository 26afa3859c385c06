"""A request's output constraint compiled before its jobs are made (`compile_constraint`), for every API: off the
event loop (a worker thread; llguidance drops the GIL while it builds), bounded in time, from the model's compiled
cache when the same constraint came before; counted (requests by kind, compilation time, cache hits and misses) and
traced (a `constraint.compile` span). What cannot be compiled is a 400 naming the request field and carrying
llguidance's reason; the searches then get a fresh copy of the compiled matcher per choice (`row_constraint`).
"""

from __future__ import annotations

import asyncio
import dataclasses

from starlette.concurrency import run_in_threadpool

from service.decoding.constraints import Compiled, ConstraintError, RowConstraint
from service.errors import BadInput
from service.models.registry import LoadedModel
from service.observability import tracing

# A compilation still running after this long is answered with a 400 (llguidance's fuel limits end it soon after:
# `service.decoding.constraints.PARSER_LIMITS`); the ~10-property schemas of the benchmark compile in ~1 ms.
COMPILE_TIMEOUT_S = 5.0


async def compile_constraint(loaded: LoadedModel, params):
    """`params` (a `GenerationParams`) with its constraint compiled (`compiled`), or as they are without one."""
    constraint = params.constraint
    if constraint is None or params.compiled is not None:
        return params
    if params.num_beams > 1:
        raise BadInput(f"a {constraint.kind} constraint needs num_beams=1: beam search under a constraint is not "
                       "supported", param=constraint.field)
    compiler = getattr(loaded.engine, "constraints", None)
    if compiler is None:
        raise BadInput(f"{loaded.name} cannot constrain its output", param=constraint.field)
    labels = {"model": loaded.name, "version": str(loaded.version)}
    metrics = loaded.scheduler.metrics
    metrics.constrained_requests.labels(**labels, kind=constraint.kind).inc()
    try:
        with tracing.constraint_span(constraint.kind, False):
            compiled: Compiled = await asyncio.wait_for(run_in_threadpool(compiler.compile, constraint),
                                                        COMPILE_TIMEOUT_S)
    except ConstraintError as error:
        field = error.field or constraint.field
        raise BadInput(f"{field}: {error}", param=field) from None
    except TimeoutError:
        raise BadInput(f"compiling the {constraint.kind} took longer than {COMPILE_TIMEOUT_S:g} s",
                       param=constraint.field) from None
    metrics.constraint_cache.labels(**labels, result="hit" if compiled.cached else "miss").inc()
    if not compiled.cached:
        metrics.constraint_compile_seconds.labels(**labels, kind=constraint.kind).observe(compiled.seconds)
    return dataclasses.replace(params, compiled=compiled)


def row_constraint(params) -> RowConstraint | None:
    """A choice's own copy of the compiled constraint (None without one)."""
    if params.constraint is None:
        return None
    if params.compiled is None:
        raise RuntimeError("compile_constraint() must run before the jobs of a constrained request are made")
    return params.compiled.row()
