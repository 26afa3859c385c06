"""Steps of few rows on a one-thread session (`TSERVE_SINGLE_THREAD_ROWS`, `OneThreadSession`): the small steps
run there and the others on the configured session, for the concatenating decoder graph and the in-place step
graph, in both engines; the decoded outputs are those of the engine without it."""

import json
import shutil

import pytest

from export.kv_inplace import add_step_graph
from service.decoding import BeamSearch, GreedySearch
from service.engines.gpt import GPTEngine
from service.engines.runtime import OneThreadSession, RuntimeOptions, create_session
from service.engines.translation import TranslationEngine
from service.models.repository import ModelRepository

pytestmark = pytest.mark.slow

GERMAN = ["Ein Mann fährt Fahrrad.", "Zwei Hunde spielen im Schnee.", "Kinder laufen am Strand."]
PROMPTS = ["ROMEO:\n", "First Citizen:\nBefore we proceed", "To be"]
TWO_THREADS = RuntimeOptions(device="cpu", intra_op_threads=2)
STEPS = 12


class CountingSession:
    """A session wrapper that counts the rows of every run (plain `run` or an IO binding's)."""

    def __init__(self, session):
        self.session, self.rows = session, []

    def run(self, outputs, feeds, *args):
        self.rows.append(len(next(iter(feeds.values()))))
        return self.session.run(outputs, feeds, *args)

    def run_with_iobinding(self, binding, *args):
        self.rows.append(-1)  # rows are not visible on a binding; the count is what matters
        return self.session.run_with_iobinding(binding, *args)

    def __getattr__(self, name):
        return getattr(self.session, name)


def _with_step_graphs(tiny_repository, root):
    for kind in ("gpt", "translation"):
        version = root / kind / "1"
        shutil.copytree(tiny_repository / kind / "1", version)
        config = json.loads((version / "config.json").read_text())
        add_step_graph(version, config)
        (version / "config.json").write_text(json.dumps(config))
    return ModelRepository(root)


def _engines(kind, engine_class, tiny_repository, tmp_path, in_place: bool, rows: int):
    """(the engine without a one-thread session, one with it for `rows` rows, its counted narrow and wide
    sessions) on the tiny version of `kind`, with a step graph if `in_place`."""
    repository = _with_step_graphs(tiny_repository, tmp_path) if in_place else ModelRepository(tiny_repository)
    version = repository.get(kind)
    plain = engine_class(version, TWO_THREADS)
    engine = engine_class(version, RuntimeOptions(device="cpu", intra_op_threads=2, single_thread_rows=rows))
    return plain, engine, *_count(engine)


def _one_thread(engine):
    return engine._one_thread if engine._in_place is None else engine._in_place.one_thread


def _count(engine):
    """Wrap the engine's one-thread session and its step session in counters -> (narrow, wide)."""
    holder = _one_thread(engine)
    holder.session = CountingSession(holder.session)
    if engine._in_place is not None:
        engine._in_place.session = wide = CountingSession(engine._in_place.session)
    elif isinstance(engine, GPTEngine):
        engine.session = wide = CountingSession(engine.session)
    else:
        engine.decoder = wide = CountingSession(engine.decoder)
    return holder.session, wide


def test_no_second_session_unless_asked_or_on_one_thread(tiny_repository):
    path = tiny_repository / "gpt" / "1" / "decoder.onnx"
    wide = create_session(path, TWO_THREADS)
    assert OneThreadSession(path, TWO_THREADS, wide).session is None  # single_thread_rows 0: off
    one = RuntimeOptions(device="cpu", intra_op_threads=1, single_thread_rows=4)
    assert OneThreadSession(path, one, wide).session is None  # one thread already
    on = OneThreadSession(path, RuntimeOptions(device="cpu", intra_op_threads=2, single_thread_rows=4), wide)
    assert on.session is not None
    assert on.pick(4, wide) is on.session and on.pick(5, wide) is wide


@pytest.mark.parametrize("in_place", [False, True], ids=["concat", "in-place"])
def test_gpt_steps_of_one_row_run_on_one_thread(tiny_repository, tmp_path, in_place):
    plain, engine, narrow, wide = _engines("gpt", GPTEngine, tiny_repository, tmp_path, in_place, rows=1)
    prompts = [plain.tokenizer.encode(p).ids for p in PROMPTS]

    def tokens(e, batch):
        searches = e.generate(batch, lambda _: GreedySearch(STEPS, e.eos_id, min_new_tokens=STEPS))
        return [s.results()[0].tokens for s in searches]

    assert tokens(engine, prompts[:1]) == tokens(plain, prompts[:1])
    assert len(narrow.rows) == STEPS - 1  # every step after the prompt pass
    narrow.rows.clear()
    wide_runs = len(wide.rows)
    assert tokens(engine, prompts) == tokens(plain, prompts)  # three rows: the configured session
    assert narrow.rows == [] and len(wide.rows) > wide_runs


@pytest.mark.parametrize("in_place", [False, True], ids=["concat", "in-place"])
def test_translation_beams_of_a_single_source_run_on_one_thread(tiny_repository, tmp_path, in_place):
    plain, engine, narrow, wide = _engines("translation", TranslationEngine, tiny_repository, tmp_path, in_place,
                                           rows=4)
    sources = [plain.source_ids(s) for s in GERMAN]

    def tokens(e, batch):
        searches = e.translate_ids(batch, lambda _: BeamSearch(4, STEPS, e.eos_id))
        return [s.results()[0].tokens for s in searches]

    assert tokens(engine, sources[:1]) == tokens(plain, sources[:1])  # 1 then 4 beam rows: one thread
    assert narrow.rows and all(r in (-1, 1, 4) for r in narrow.rows)
    wide_runs = len(wide.rows)
    assert tokens(engine, sources) == tokens(plain, sources)  # 12 rows after the start: the configured session
    assert len(wide.rows) > wide_runs
