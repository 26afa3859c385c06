"""`service.decoding.constraints` on the released GPT's byte tokenizer (256 bytes + EOS), without running the model:
`Constraint.of`'s shapes and the errors naming the request field; the compiler's LRU cache; what llguidance refuses
(its own message in the error); pathological constraints ending within a bound (and never killing the process);
`allow_rows` for many matchers at once against llguidance's mask of each; EOS only where the constraint accepts;
whatever a constraint lets the byte tokenizer emit is valid UTF-8."""

from __future__ import annotations

import codecs
import json
import subprocess
import sys
import time

import llguidance.numpy as llg_numpy
import numpy as np
import pytest

from service.decoding.constraints import (MAX_CHOICES, MAX_CONSTRAINT_CHARS, MAX_GBNF_RULES, Constraint, ConstraintCompiler,
                                          ConstraintError, allow_rows)
from service.repository import TOKENIZER_FILE, ModelRepository
from tests.support import ROOT

MODEL = ModelRepository(ROOT / "model_repository").get("gpt")
VOCAB = MODEL.config["architecture"]["vocab_size"]  # 257: the bytes and EOS
EOS = MODEL.config["special_tokens"]["eos_id"]
BOUND_S = 10.0  # a pathological constraint ends (compiled or refused) within this long


def _compiler(cached: int = 256) -> ConstraintCompiler:
    return ConstraintCompiler(MODEL.path / TOKENIZER_FILE, VOCAB, [EOS], cached=cached)


@pytest.fixture(scope="module")
def compiler() -> ConstraintCompiler:
    return _compiler()


def _walk(row, rng, steps: int = 200) -> list[int]:
    """Random allowed tokens (EOS only when nothing else is allowed), to the constraint's end or `steps`."""
    tokens = []
    for _ in range(steps):
        allow_rows([row], VOCAB)
        allowed = np.flatnonzero(row.allowed)
        others = allowed[allowed != EOS]
        token = int(rng.choice(others)) if others.size else EOS
        tokens.append(token)
        if row.advance(token) or token == EOS:
            break
    return tokens


# --- Constraint.of ---------------------------------------------------------------------------------------------------

@pytest.mark.parametrize("kind, value, text", [
    ("json_schema", {"type": "string", "enum": ["café"]}, '{"type": "string", "enum": ["café"]}'),
    ("json_schema", True, "true"),
    ("json_object", None, '{"type": "object"}'),
    ("json_object", {"ignored": 1}, '{"type": "object"}'),
    ("regex", r"\d+", r"\d+"),
    ("choice", ["yes", "日本"], '["yes", "日本"]'),
    ("grammar", 'start: "a"', 'start: "a"'),
])
def test_a_constraint_keeps_its_kind_and_text(kind, value, text):
    constraint = Constraint.of(kind, value, "field")
    assert (constraint.kind, constraint.text, constraint.field) == (kind, text, "field")


def test_the_field_is_not_part_of_a_constraints_identity():
    a, b = Constraint.of("regex", "a+", "regex"), Constraint.of("regex", "a+", "guided_regex")
    assert a == b and hash(a) == hash(b)
    assert a != Constraint.of("grammar", "a+", "regex")


@pytest.mark.parametrize("kind, value, message", [
    ("xml", "<a/>", "unknown constraint 'xml'"),
    ("json_schema", "{}", "a JSON schema must be an object"),
    ("json_schema", [], "a JSON schema must be an object"),
    ("json_schema", None, "a JSON schema must be an object"),
    ("choice", "yes", "choice must be a list of 1 to"),
    ("choice", [], "choice must be a list of 1 to"),
    ("choice", ["a", 1], "choice must be a list of 1 to"),
    ("choice", ["a", ""], "choice must be a list of 1 to"),
    ("choice", ["c"] * (MAX_CHOICES + 1), "choice must be a list of 1 to"),
    ("regex", "", "regex must be a non-empty string"),
    ("regex", 5, "regex must be a non-empty string"),
    ("grammar", "", "grammar must be a non-empty string"),
    ("grammar", "x" * (MAX_CONSTRAINT_CHARS + 1), "over 100,000"),
    ("json_schema", {"enum": ["v" * 50] * 2_000}, "over 100,000"),
])
def test_a_value_of_the_wrong_shape_is_refused_naming_the_field(kind, value, message):
    with pytest.raises(ConstraintError, match=message) as error:
        Constraint.of(kind, value, "response_format.json_schema")
    assert error.value.field == "response_format.json_schema"


# --- the compiler's cache ---------------------------------------------------------------------------------------------

def test_the_same_constraint_is_compiled_once():
    compiler = _compiler()
    first = compiler.compile(Constraint.of("regex", "[a-z]{3}", "regex"))
    again = compiler.compile(Constraint.of("regex", "[a-z]{3}", "another_field"))
    assert (first.cached, again.cached, again.seconds) == (False, True, 0.0)
    assert first.seconds > 0 and again.entry.template is first.entry.template
    assert first.row().matcher is not again.row().matcher  # every row its own copy


def test_the_cache_drops_the_least_recently_used():
    compiler = _compiler(cached=2)
    a, b, c = (Constraint.of("regex", text, "regex") for text in ("a+", "b+", "c+"))
    compiler.compile(a)
    compiler.compile(b)
    assert compiler.compile(a).cached  # a is now the most recently used
    compiler.compile(c)  # drops b
    assert compiler.compile(a).cached and compiler.compile(c).cached
    assert not compiler.compile(b).cached  # compiled again, and now a (least recent) is dropped
    assert not compiler.compile(a).cached


# --- what llguidance refuses ------------------------------------------------------------------------------------------

@pytest.mark.parametrize("kind, value, message", [
    ("regex", "a(b", "unclosed group"),
    ("regex", "(?=a)b", "look-around"),
    ("regex", "(?<!a)b", "look-around"),
    ("grammar", "start: foo bar", 'unknown name: "foo"'),
    ("grammar", 'root ::= "a" x', "Rule 'x' not found"),
    ("json_schema", {"type": "string", "format": "foo-bar"}, "Unknown format: foo-bar"),
    ("json_schema", {"type": "string", "format": "uri-template"}, "Unknown format: uri-template"),
    ("json_schema", {"type": "string", "pattern": "(?=a)b"}, "look-around"),
    ("json_schema", {"type": "strin"}, "Invalid type: strin"),
    ("json_schema", {"$ref": "#/$defs/missing"}, "/\\$defs/missing' does not exist"),
    ("json_schema", {"type": "integer", "minimum": 5, "maximum": 1}, "Unsatisfiable schema"),
])
def test_what_llguidance_cannot_compile_is_an_error_with_its_reason(compiler, kind, value, message):
    with pytest.raises(ConstraintError, match=message) as error:
        compiler.compile(Constraint.of(kind, value, "the_field"))
    assert error.value.field == "the_field"
    assert str(error.value).startswith(f"invalid {kind}: ")


# --- pathological constraints: bounded, never fatal ----------------------------------------------------------------

def _lark_chain(rules: int) -> str:
    """A chain of `rules` Lark rules, each naming the next (the densest nesting that fits in the size limit)."""
    return "start: r0\n" + "".join(f'r{i}: r{i + 1} | "x"\n' for i in range(rules)) + f'r{rules}: "y"\n'


def _ref_chain(defs: int, wrap=lambda ref: ref) -> dict:
    """A schema of `defs` definitions, each a `$ref` (or `wrap` of one) to the next."""
    chain = {f"d{i}": wrap({"$ref": f"#/$defs/d{i + 1}"}) for i in range(defs)}
    return {"$defs": {**chain, f"d{defs}": {"type": "integer"}}, "$ref": "#/$defs/d0"}


@pytest.mark.parametrize("kind, value", [
    ("regex", "(a+)+b"),
    ("regex", "((a*)*)*b"),
    ("regex", "(x+x+)+y"),
    ("regex", "(.*.*.*.*)*=.*"),
    ("regex", "(a|aa)*c{1000}"),
    ("regex", "[a-z]{100000}"),
    ("json_schema", {"enum": [f"value number {i}" for i in range(4_000)]}),
    ("json_schema", {"type": "object", "properties": {"a": {"$ref": "#"}, "b": {"type": "integer"}}}),
    ("json_schema", _ref_chain(200, lambda ref: {"type": "object", "properties": {"x": ref}})),
    ("json_schema", {"type": "array", "minItems": 50, "items": {"type": "array", "minItems": 50,
                                                                "items": {"type": "integer"}}}),
    ("grammar", _lark_chain(1_500)),
])
def test_a_pathological_constraint_compiles_and_steps_within_a_bound(compiler, kind, value):
    """Compiles and steps, or is refused when it compiles (its first token past llguidance's limits: the long
    right-recursive chain), within the bound: never a failure in the middle of decoding."""
    started = time.perf_counter()
    try:
        row = compiler.compile(Constraint.of(kind, value, "f")).row()
    except ConstraintError as refused:
        assert kind == "grammar" and "max is" in str(refused)
    else:
        _walk(row, np.random.default_rng(0))
    assert time.perf_counter() - started < BOUND_S


def test_a_100k_value_enum_is_refused_by_its_size_and_by_llguidance_past_it(compiler):
    schema = {"enum": [f"v{i}" for i in range(100_000)]}
    started = time.perf_counter()
    with pytest.raises(ConstraintError, match="over 100,000"):
        Constraint.of("json_schema", schema, "f")
    with pytest.raises(ConstraintError, match="too big"):  # past the size limit: llguidance's own limits
        compiler.compile(Constraint("json_schema", json.dumps(schema), "f"))
    assert time.perf_counter() - started < BOUND_S


def test_a_regex_past_the_lexers_limits_is_refused_when_it_compiles(compiler):
    """llguidance builds its lexer lazily: this regex would compile, then fail on its first token; the compiler
    computes a first mask, so that it is a ConstraintError (a 400), not a failed request."""
    started = time.perf_counter()
    with pytest.raises(ConstraintError, match="too many expressions"):
        compiler.compile(Constraint.of("regex", "(a{1000}){1000}", "f"))  # its first mask is computed there
    assert time.perf_counter() - started < BOUND_S


DEEP_CHAINS = f"""
import json, string, sys, threading
sys.path.insert(0, {str(ROOT)!r})
from tests.unit.decoding.test_constraints import _compiler, _lark_chain, _ref_chain
from service.decoding.constraints import Constraint, ConstraintError
def name(i):
    s, i = "", i + 26 * 26
    while i:
        s, i = s + string.ascii_lowercase[i % 26], i // 26
    return s
dense = ("start:" + name(0) + "\\n" + "".join(f"{{name(i)}}:{{name(i + 1)}}\\n" for i in range(11_000))
         + name(11_000) + ':"y"')
gbnf = "root ::= r0\\n" + "".join(f'r{{i}} ::= r{{i + 1}} | "x"\\n' for i in range(398)) + 'r398 ::= "y"\\n'
cases = [("grammar", _lark_chain(3_000)), ("grammar", dense), ("grammar", gbnf),
         ("json_schema", _ref_chain(1_450, lambda ref: {{"anyOf": [ref, {{"type": "null"}}]}})),
         ("json_schema", _ref_chain(1_500, lambda ref: {{"type": "array", "items": ref}}))]
if len(sys.argv) > 1:  # the stack of a compiling thread, to see these cases crash on too small a one
    import service.decoding.constraints
    service.decoding.constraints.COMPILE_STACK_BYTES = int(sys.argv[1])
    cases = [cases[int(sys.argv[2])]]
def compile_all():  # on a thread of the default stack size, as the service's worker threads are
    for kind, value in cases:
        constraint = Constraint.of(kind, value, "f")
        try:
            _compiler().compile(constraint)
        except ConstraintError as refused:  # past llguidance's limits at its first token: a 400, not a crash
            print(kind, len(constraint.text), "refused", str(refused).splitlines()[0], flush=True)
        else:
            print(kind, len(constraint.text), "compiled", flush=True)
thread = threading.Thread(target=compile_all)
thread.start()
thread.join()
"""


def test_deeply_nested_grammars_and_schemas_within_the_size_limit_compile_without_killing_the_process():
    """A chain of a few thousand rules or `$ref`s overflowed the 8 MiB stack of the compiling thread inside
    llguidance (SIGSEGV: the whole service gone); run in a process of its own so that a crash fails only this."""
    done = subprocess.run([sys.executable, "-c", DEEP_CHAINS], capture_output=True, text=True, timeout=120,
                          cwd=ROOT)
    assert done.returncode == 0, (done.returncode, done.stdout, done.stderr[-2000:])
    assert done.stdout.count("compiled") + done.stdout.count("refused") == 5, done.stdout


# --- masks ---------------------------------------------------------------------------------------------------------

def _own_mask(matcher) -> np.ndarray:
    bitmask = llg_numpy.allocate_token_bitmask(1, VOCAB)
    llg_numpy.fill_next_token_bitmask(matcher, bitmask)
    return np.unpackbits(bitmask.view(np.uint8), axis=1, bitorder="little")[0, :VOCAB].astype(bool)


def test_allow_rows_gives_every_row_its_own_matchers_mask(compiler):
    constraints = [Constraint.of("json_schema", {"type": "object", "properties": {"n": {"type": "integer"}}}, "f"),
                   Constraint.of("regex", r"[0-9]{2}-[a-z]+", "f"), Constraint.of("choice", ["yes", "no"], "f"),
                   Constraint.of("grammar", 'start: "(" start ")" | "x"', "f"), Constraint.of("json_object", 0, "f")]
    rng = np.random.default_rng(3)
    rows = [compiler.compile(c).row() for c in constraints for _ in range(3)]
    for _ in range(6):
        allow_rows(rows, VOCAB)
        for row in rows:
            np.testing.assert_array_equal(row.allowed, _own_mask(row.matcher))
        rows = [row for row in rows if not row.advance(int(rng.choice(np.flatnonzero(row.allowed[:EOS]))))]


def test_allow_rows_of_no_rows_does_nothing():
    allow_rows([], VOCAB)


def test_a_row_bans_what_its_constraint_does_not_allow(compiler):
    row = compiler.compile(Constraint.of("choice", ["ab", "b"], "f")).row()
    allow_rows([row], VOCAB)
    banned = np.zeros(VOCAB, bool)
    banned[0] = True  # bans already there stay
    row.ban(banned)
    assert np.flatnonzero(~banned).tolist() == [ord("a"), ord("b")]
    assert row.bans(EOS) and row.bans(ord("c")) and not row.bans(ord("a"))


@pytest.mark.parametrize("kind, value", [
    ("regex", "ab(c|de)?f?"), ("choice", ["to", "tor", "tort"]), ("json_schema", {"type": "integer"}),
    ("grammar", 'start: "a"+ "b"?'),
])
def test_eos_is_allowed_exactly_where_the_constraint_accepts(compiler, kind, value):
    for seed in range(8):
        row, rng = compiler.compile(Constraint.of(kind, value, "f")).row(), np.random.default_rng(seed)
        for _ in range(12):
            allow_rows([row], VOCAB)
            assert row.allowed[EOS] == row.matcher.is_accepting()
            token = int(rng.choice(np.flatnonzero(row.allowed)))
            if row.advance(token) or token == EOS:
                break


def test_a_complete_constraint_says_so_on_its_last_token(compiler):
    row = compiler.compile(Constraint.of("choice", ["yes", "no"], "f")).row()
    assert [row.advance(token) for token in b"yes"] == [False, False, True]


# --- the byte tokenizer: always valid UTF-8 ---------------------------------------------------------------------

@pytest.mark.parametrize("kind, value", [
    ("json_schema", {"type": "object", "properties": {"w": {"enum": ["café", "naïve", "日本"]}},
                     "required": ["w"]}),
    ("json_schema", {"type": "array", "items": {"type": "string", "maxLength": 6}, "maxItems": 4}),
    ("json_schema", {"type": "string", "pattern": "^[à-ÿ]{2,5}$"}),
    ("json_object", None),
    ("regex", "[à-ÿ]{3}|日本語?|naïve"),
    ("regex", ".{1,12}"),
    ("regex", "[^a-z]{4,9}"),
    ("choice", ["café", "日本", "🙂 ok"]),
    ("grammar", 'start: WORD (" " WORD)*\nWORD: /[^ ]{1,4}/'),
])
def test_whatever_a_constraint_lets_the_byte_tokenizer_emit_is_valid_utf8(compiler, kind, value):
    compiled = compiler.compile(Constraint.of(kind, value, "f"))
    for seed in range(30):
        row = compiled.row()
        tokens = _walk(row, np.random.default_rng(seed), steps=60)
        ended = tokens[-1] == EOS or row.matcher.is_stopped()  # else cut short: a prefix of valid UTF-8
        text = codecs.getincrementaldecoder("utf-8")().decode(bytes(t for t in tokens if t != EOS), final=ended)
        if kind == "json_schema" and tokens[-1] == EOS and "enum" in json.dumps(value):
            assert json.loads(text)["w"] in ("café", "naïve", "日本")


def test_the_rows_of_one_cached_constraint_do_not_exhaust_its_lexer(compiler):
    """The rows copied from one compiled matcher share its lexer and its state limit (PARSER_LIMITS
    max_lexer_states): without `ROWS_PER_TEMPLATE`, a regex that makes a new lexer state per token exhausted it
    after ~130 requests of 250 tokens, and every later row of that constraint failed."""
    rng = np.random.default_rng(0)
    for request in range(200):  # 200 requests of 250 tokens each, each compiling (a cache hit after the first)
        row = compiler.compile(Constraint.of("regex", "[ab]*a[ab]{16}", "f")).row()
        for step in range(250):
            allow_rows([row], VOCAB)
            assert row.allowed[ord("a")] and not row.matcher.is_error(), (request, step, row.matcher.get_error())
            row.advance(int(rng.choice([ord("a"), ord("b")])))


def test_a_gbnf_grammar_past_its_rule_bound_is_refused_before_its_quadratic_conversion():
    rules = MAX_GBNF_RULES + 1
    gbnf = "root ::= r0\n" + "".join(f'r{i} ::= r{i + 1} | "x"\n' for i in range(rules - 1)) + f'r{rules - 1} ::= "y"\n'
    started = time.perf_counter()
    with pytest.raises(ConstraintError, match=f"rules, over {MAX_GBNF_RULES}") as refused:
        Constraint.of("grammar", gbnf, "grammar")
    assert refused.value.field == "grammar" and time.perf_counter() - started < 0.1


def test_a_row_whose_mask_cannot_be_filled_fails_alone_in_its_batch(compiler):
    """`allow_rows` marks a row that allows no token; only that row's search raises when its step reads it (the
    scheduler steps with `isolate`: the other requests of the batch go on)."""
    from service.decoding import SamplingSearch
    from service.decoding.sampling import step_single_rows

    good = compiler.compile(Constraint.of("regex", "[a-z]{4}", "f")).row()
    broken = compiler.compile(Constraint.of("regex", "b", "f")).row()
    assert not broken.matcher.consume_token(ord("z"))  # an error state: llguidance's mask then allows EOS only
    searches = [SamplingSearch(8, EOS, temperature=0, constraint=row) for row in (good, broken)]
    searches.insert(1, SamplingSearch(8, EOS, temperature=0))  # an unconstrained row between them
    logits = np.zeros((3, VOCAB), np.float32)
    results = step_single_rows(searches, logits, isolate=True)
    assert isinstance(results[2], RuntimeError) and "allows no token" in str(results[2])
    assert not isinstance(results[0], Exception) and not isinstance(results[1], Exception)
    assert chr(int(results[0].tokens[0])) in "abcdefghijklmnopqrstuvwxyz"


@pytest.mark.parametrize("kind, value", [
    ("json_schema", {"type": "object", "properties": {"n": {"type": "integer", "maximum": 99},
                                                      "s": {"type": "string", "maxLength": 6}}, "required": ["n", "s"]}),
    ("regex", "[A-Z][a-z]+ [0-9]{2}"), ("grammar", 'start: "a"+ "b"'), ("json_object", None), ("choice", ["ab", "abc"])])
def test_asking_of_one_token_answers_as_the_mask_does(compiler, kind, value):
    """Greedy rows ask `bans(token)` of their raw argmax without a mask (llguidance's `validate_tokens`): the same
    answer as the mask for every token, EOS included, at every state of random walks."""
    rng = np.random.default_rng(1)
    for _ in range(3):
        row = compiler.compile(Constraint.of(kind, value, "f")).row()
        for _ in range(60):
            asked = [row.bans(token) for token in range(VOCAB)]
            allow_rows([row], VOCAB)
            assert asked == (~row.allowed).tolist()
            allowed = np.flatnonzero(row.allowed)
            others = allowed[allowed != EOS]
            token = int(rng.choice(others)) if others.size else EOS
            if row.advance(token) or token == EOS:
                break


def test_a_cached_constraint_gets_a_fresh_matcher_after_its_rows_quota(compiler):
    """`ROWS_PER_TEMPLATE` rows copied from a cached matcher: the next compile rebuilds it aside (the rows made so
    far keep theirs), and the count starts again."""
    from service.decoding.constraints import ROWS_PER_TEMPLATE

    constraint = Constraint.of("regex", "[0-9]{3}x", "f")
    compiled = compiler.compile(constraint)
    old = compiled.entry.template
    rows = [compiled.row() for _ in range(ROWS_PER_TEMPLATE)]
    again = compiler.compile(constraint)
    deadline = time.monotonic() + BOUND_S
    while again.entry.rebuilding and time.monotonic() < deadline:
        time.sleep(0.01)
    assert again.entry is compiled.entry and again.entry.template is not old and again.entry.rows == 0
    assert all(row.matcher is not again.entry.template for row in rows)
    assert again.row().bans(ord("x")) and not again.row().bans(ord("7"))


def test_the_sampled_rows_of_a_step_get_their_masks_in_one_fill(compiler, monkeypatch):
    """One parallel fill for every row that samples; a greedy row asks of its argmax alone (no fill unless it is
    banned)."""
    import service.decoding.sampling as sampling
    from service.decoding import SamplingSearch

    calls = []

    def spy(rows, vocab):
        calls.append(len(rows))
        allow_rows(rows, vocab)

    monkeypatch.setattr(sampling, "allow_rows", spy)
    constraint = Constraint.of("regex", "[a-z]{4}", "f")
    sampled = [SamplingSearch(8, EOS, temperature=1.0, seed=i, constraint=compiler.compile(constraint).row())
               for i in range(3)]
    greedy = SamplingSearch(8, EOS, temperature=0, constraint=compiler.compile(constraint).row())
    logits = np.zeros((4, VOCAB), np.float32)
    logits[:, ord("q")] = 5.0  # allowed: the greedy row takes it without a mask
    results = sampling.step_single_rows([*sampled, greedy], logits)
    assert calls == [3]
    assert [chr(int(r.tokens[0])) in "abcdefghijklmnopqrstuvwxyz" for r in results] == [True] * 4
    assert int(results[3].tokens[0]) == ord("q")
