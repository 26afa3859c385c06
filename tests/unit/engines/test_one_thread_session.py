"""Steps of few rows on a one-thread session (`TSERVE_SINGLE_THREAD_ROWS`, `OneThreadSession`): the small steps
run there and the others on the configured session, for the concatenating decoder graph and the in-place step
graph, in both engines; the decoded outputs are those of the engine without it. With several decoding workers, a
call beside another runs on the one-thread session too (`OneThreadSession.call`), and a decode whose steps move
between the two sessions decodes what it would on either."""

import json
import shutil
import threading

import pytest

from export.kv_inplace import add_step_graph
from service.decoding import BeamSearch, GreedySearch
from service.engines.gpt import GPTEngine
from service.engines.runtime import EngineCalls, OneThreadSession, RuntimeOptions, create_session
from service.engines.translation import TranslationEngine
from service.repository import ModelRepository
from tests.support import ROOT

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


def test_a_call_beside_another_runs_on_one_thread_when_workers_share_the_engine(tiny_repository):
    path = tiny_repository / "gpt" / "1" / "decoder.onnx"
    wide = create_session(path, TWO_THREADS)
    concurrent = RuntimeOptions(device="cpu", intra_op_threads=2, one_thread_when_concurrent=True)
    on = OneThreadSession(path, concurrent, wide)
    assert on.session is not None  # no small-row rule, but a second session for calls side by side
    with on.call(64, wide) as first:
        with on.call(64, wide) as second:
            with on.call(64, wide) as third:
                assert first is wide and second is on.session and third is on.session
        with on.call(64, wide) as beside_first:
            assert beside_first is on.session
    with on.call(64, wide) as alone:
        assert alone is wide  # nothing in flight any more: every thread
    with pytest.raises(RuntimeError):
        with on.call(64, wide):
            raise RuntimeError("a failed run")
    with on.call(64, wide) as after_a_failure:
        assert after_a_failure is wide  # the failed call is not counted as in flight
    apart = OneThreadSession(path, RuntimeOptions(device="cpu", intra_op_threads=2, single_thread_rows=1), wide)
    with apart.call(64, wide) as first, apart.call(64, wide) as second:
        assert first is wide and second is wide  # one worker: only the row rule


def _in_thread(function):
    """Run `function` on another thread and wait for it (a second decoding worker's call)."""
    worker = threading.Thread(target=function)
    worker.start()
    worker.join()


def test_a_call_soon_after_another_threads_counts_as_beside_it():
    """Two busy workers' calls are apart by their searches: a call within the window after another thread's call
    ended is concurrent, a call after its own ended is not, and once the window has passed a worker is alone."""
    calls = EngineCalls(window_s=60)
    _in_thread(lambda: (calls.enter(), calls.exit()))
    assert calls.enter() is True  # the other worker's call ended just now
    calls.exit()
    assert calls.enter() is True  # still within the window of the other's
    calls.exit()
    short = EngineCalls(window_s=0)
    _in_thread(lambda: (short.enter(), short.exit()))
    assert short.enter() is False  # the window has passed: alone
    assert short.enter() is True  # ...but a call in flight (even this thread's) is beside it
    short.exit()
    short.exit()
    mine = EngineCalls(window_s=60)
    mine.enter()
    mine.exit()
    assert mine.enter() is False  # only this thread has called: its own last call does not count


@pytest.mark.parametrize("kind, engine_class", [("gpt", GPTEngine), ("translation", TranslationEngine)])
@pytest.mark.parametrize("in_place", [False, True], ids=["concat", "in-place"])
def test_the_prompt_pass_shares_the_steps_count_of_calls(tiny_repository, tmp_path, kind, engine_class, in_place):
    """The GPT's prompt pass and the translator's encoder pass are counted with the steps (one `EngineCalls` per
    engine): beside another worker's call they run on their own one-thread session, alone on the wide one."""
    repository = _with_step_graphs(tiny_repository, tmp_path) if in_place else ModelRepository(tiny_repository)
    engine = engine_class(repository.get(kind), RuntimeOptions(device="cpu", intra_op_threads=2,
                                                               one_thread_when_concurrent=True))
    first = engine._prompt_one_thread if kind == "gpt" else engine._encoder_one_thread
    steps = _one_thread(engine)
    assert first.calls is steps.calls and first.session is not None
    first.calls.window_s = 0  # only calls in flight count here
    prefill = ((lambda: engine.prefill([engine.tokenizer.encode(PROMPTS[1]).ids])) if kind == "gpt"
               else (lambda: engine.prefill([engine.source_ids(GERMAN[0])])))
    narrow, wide = CountingSession(first.session), None
    first.session = narrow
    if kind == "gpt":
        engine.session = wide = CountingSession(engine.session)
    else:
        engine.encoder = wide = CountingSession(engine.encoder)
    prefill()
    assert (len(narrow.rows), len(wide.rows)) == (0, 1)  # alone: every thread
    with _CallInFlight(steps.calls):
        prefill()
    assert (len(narrow.rows), len(wide.rows)) == (1, 1)  # beside a step in flight: one thread


class _CallInFlight:
    """A call of the engine in flight on another thread for as long as the block lasts."""

    def __init__(self, calls: EngineCalls):
        self.calls, self.started, self.release = calls, threading.Event(), threading.Event()

    def _worker(self):
        self.calls.enter()
        self.started.set()
        self.release.wait()
        self.calls.exit()

    def __enter__(self):
        self.thread = threading.Thread(target=self._worker)
        self.thread.start()
        self.started.wait()

    def __exit__(self, *exc):
        self.release.set()
        self.thread.join()


@pytest.mark.parametrize("kind, engine_class", [("gpt", GPTEngine), ("translation", TranslationEngine)])
@pytest.mark.parametrize("in_place", [False, True], ids=["concat", "in-place"])
def test_steps_moving_between_the_sessions_decode_as_on_one(tiny_repository, tmp_path, kind, engine_class, in_place):
    """What a busy server does to a decode (its steps on the wide session when alone, on the one-thread one beside
    another worker's), forced to alternate every step: the outputs and scores of the engine without it, and each
    in-place session keeps its own binding over the same buffers."""
    repository = _with_step_graphs(tiny_repository, tmp_path) if in_place else ModelRepository(tiny_repository)
    version = repository.get(kind)
    plain = engine_class(version, TWO_THREADS)
    engine = engine_class(version, RuntimeOptions(device="cpu", intra_op_threads=2, one_thread_when_concurrent=True))
    holder = _one_thread(engine)
    calls = []

    def alternate(rows, wide, concurrent=False):
        calls.append(len(calls) % 2 == 1)
        return holder.session if calls[-1] else wide

    holder.pick = alternate
    if kind == "gpt":
        batch = [plain.tokenizer.encode(p).ids for p in PROMPTS]

        def decode(e):
            searches = e.generate(batch, lambda _: GreedySearch(STEPS, e.eos_id, min_new_tokens=STEPS))
            return [(r.tokens, r.score) for s in searches for r in s.results()]
    else:
        batch = [plain.source_ids(s) for s in GERMAN]

        def decode(e):
            searches = e.translate_ids(batch, lambda _: BeamSearch(4, STEPS, e.eos_id))
            return [(r.tokens, r.score) for s in searches for r in s.results()]

    assert decode(engine) == decode(plain)
    assert True in calls and False in calls


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


RELEASE_REPOSITORY = ROOT / "model_repository"


@pytest.mark.parametrize("kind, variant", [("gpt", "int8+gqa"), ("gpt", "fp32"), ("translation", "int8"),
                                           ("translation", "fp32")])
def test_the_released_models_decode_bit_identically_on_either_session(kind, variant):
    """A 16-source batch decoded with every call (the prompt or encoder pass, and every step) on the wide
    sessions, then on the one-thread ones (what a call beside another worker's gets): the same tokens and scores,
    bit for bit, so that which session a busy server picks never shows in an answer."""
    engine_class = GPTEngine if kind == "gpt" else TranslationEngine
    engine = engine_class(ModelRepository(RELEASE_REPOSITORY).get(kind),
                          RuntimeOptions(device="cpu", intra_op_threads=2, one_thread_when_concurrent=True,
                                         weights=variant))
    holder = _one_thread(engine)
    if kind == "gpt":
        batch = [engine.tokenizer.encode(p).ids for p in PROMPTS + ["KING"]] * 4

        def decode():
            searches = engine.generate(batch, lambda _: GreedySearch(48, engine.eos_id, min_new_tokens=48))
            return [(r.tokens, r.score) for s in searches for r in s.results()]
    else:
        batch = [engine.source_ids(s) for s in GERMAN + ["Eine Frau singt auf einer Bühne."]] * 4

        def decode():
            searches = engine.translate_ids(batch, lambda _: BeamSearch(4, 40, engine.eos_id))
            return [(r.tokens, r.score) for s in searches for r in s.results()]

    first = engine._prompt_one_thread if kind == "gpt" else engine._encoder_one_thread  # the prompt / encoder pass
    for each in (holder, first):
        each.pick = lambda rows, wide, concurrent=False: wide
    on_wide = decode()
    for each in (holder, first):
        each.pick = lambda rows, wide, concurrent=False, each=each: each.session
    assert decode() == on_wide
