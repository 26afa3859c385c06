"""Constrained decoding: what a row may emit, as a JSON schema, any JSON object, a regular expression, a choice of
strings or a grammar (Lark or llama.cpp's GBNF), compiled by llguidance into a matcher over the model's own
tokenizer (vLLM, SGLang, llama.cpp's server and ONNX Runtime GenAI constrain the same ways; GenAI with llguidance too).

- `Constraint`: the kind and its text, as a request gave it (the field it came from names the errors);
- `ConstraintCompiler` (one per tokenizer): compiles a constraint once (LRU-cached, bounded in size and in
  llguidance's own fuel limits) and hands each row a fresh copy of the compiled matcher;
- `RowConstraint`: a row's matcher; `allow_rows` fills the allowed tokens of every constrained row of a step in one
  call (llguidance's parallel mask fill), the searches ban the rest and advance each matcher by the token chosen.
EOS is allowed only where the constraint accepts; a row whose constraint can take no more tokens ends ("stop").
"""

from __future__ import annotations

import json
import threading
import time
from collections import OrderedDict
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path

import llguidance
import llguidance.numpy as llg_numpy
import numpy as np

JSON_SCHEMA, JSON_OBJECT, REGEX, CHOICE, GRAMMAR = "json_schema", "json_object", "regex", "choice", "grammar"
KINDS = (JSON_SCHEMA, JSON_OBJECT, REGEX, CHOICE, GRAMMAR)
# llguidance's grammar_from formats per kind (a `json_object` is the schema {"type": "object"})
_FORMATS = {JSON_SCHEMA: "json_schema", JSON_OBJECT: "json_schema", REGEX: "regex", CHOICE: "choice",
            GRAMMAR: "grammar"}
MAX_CONSTRAINT_CHARS = 100_000  # a constraint's text (a schema's JSON, a grammar): longer ones are refused
MAX_CHOICES = 1_000
COMPILED_CACHED = 256  # compiled constraints kept per tokenizer (least recently used dropped first)
# The rows copied from one compiled matcher share its lexer, and with it llguidance's lexer state limit: a regex
# that makes new lexer states as it goes (`[ab]*a[ab]{16}`) exhausted it after ~130 rows of 250 tokens. A cached
# constraint's matcher is rebuilt from its grammar, on a thread of its own, once this many rows copied it.
ROWS_PER_TEMPLATE = 32
# llguidance converts GBNF to Lark in Python, in time quadratic in its rules (2,000 rules: 1.8 s holding the GIL)
MAX_GBNF_RULES = 400
GBNF_RULE = "::="
# llguidance's resource limits (`LLParserLimits`): a compilation or a mask step past them is an error, not a stall
# (its docs: ~50k fuel units/ms when compiling, ~14k/ms per step): 20 ms of lexer fuel to build, 5 ms per step
PARSER_LIMITS = dict(initial_lexer_fuel=1_000_000, step_lexer_fuel=70_000, max_grammar_size=200_000,
                     max_lexer_states=50_000)
JSON_OPTIONS = {"whitespace_flexible": False}  # compact JSON (`{"a":1}`): no runs of whitespace between tokens
BITS_PER_WORD = 32
# llguidance builds a grammar recursively, kilobytes of stack per nested rule or `$ref`: a chain of a few thousand
# (a 60 KB Lark grammar, a 100 KB schema) overflows a thread's default 8 MiB and kills the process (SIGSEGV, no
# exception). Compilations run on a thread of their own with this much stack (reserved; pages used only as touched):
# 64 MiB already builds the deepest chains that fit in MAX_CONSTRAINT_CHARS
COMPILE_STACK_BYTES = 256 * 2**20


class ConstraintError(ValueError):
    """A constraint that cannot be compiled: `field` names the request field, the message llguidance's reason."""

    def __init__(self, message: str, field: str):
        super().__init__(message)
        self.field = field


@dataclass(frozen=True)
class Constraint:
    """One constraint of a request: `kind` (`KINDS`) and `text` (the schema as JSON, the regex, the choices as a
    JSON list, the grammar); `field`: the request field it came from (errors name it; not part of its identity)."""

    kind: str
    text: str
    field: str = field(default="", compare=False)

    @classmethod
    def of(cls, kind: str, value, field_name: str) -> Constraint:
        """From a request's value: a schema (a dict, or True), a regex or grammar (a string), choices (a list of
        strings); `json_object` takes none. Raises `ConstraintError` for a value of the wrong shape."""
        if kind not in KINDS:
            raise ConstraintError(f"unknown constraint {kind!r}: one of {', '.join(KINDS)}", field_name)
        if kind == JSON_OBJECT:
            text = json.dumps({"type": "object"})
        elif kind == JSON_SCHEMA:
            if not isinstance(value, (dict, bool)):
                raise ConstraintError("a JSON schema must be an object", field_name)
            text = json.dumps(value, ensure_ascii=False)  # its property order is the output's
        elif kind == CHOICE:
            if (not isinstance(value, list) or not value or len(value) > MAX_CHOICES
                    or not all(isinstance(c, str) and c for c in value)):
                raise ConstraintError(f"choice must be a list of 1 to {MAX_CHOICES} non-empty strings", field_name)
            text = json.dumps(value, ensure_ascii=False)
        else:
            if not isinstance(value, str) or not value:
                raise ConstraintError(f"{kind} must be a non-empty string", field_name)
            text = value
        if kind == GRAMMAR and text.count(GBNF_RULE) > MAX_GBNF_RULES:
            raise ConstraintError(f"the GBNF grammar has {text.count(GBNF_RULE):,} rules, over {MAX_GBNF_RULES}",
                                  field_name)
        if len(text) > MAX_CONSTRAINT_CHARS:
            raise ConstraintError(f"the {kind} is {len(text):,} characters long, over {MAX_CONSTRAINT_CHARS:,}",
                                  field_name)
        return cls(kind, text, field_name)

    def grammar(self) -> str:
        """llguidance's grammar of this constraint (raises `ConstraintError` with its reason)."""
        try:
            if self.kind in (JSON_SCHEMA, JSON_OBJECT):
                return llguidance.LLMatcher.grammar_from_json_schema(self.text, defaults=JSON_OPTIONS)
            return llguidance.grammar_from(_FORMATS[self.kind], self.text)
        except (ValueError, TypeError, RuntimeError) as error:
            raise ConstraintError(f"invalid {self.kind}: {error}", self.field) from None


@dataclass
class _Entry:
    """A compiled constraint in the cache: its grammar, the matcher rows copy, how many rows copied it, and
    whether a fresh matcher is being built for it (`ROWS_PER_TEMPLATE`)."""

    grammar: str
    template: llguidance.LLMatcher
    rows: int = 0
    rebuilding: bool = False


@dataclass
class Compiled:
    """A compiled constraint: the matcher every row copies, and how long compiling it took (0 when cached)."""

    entry: _Entry
    seconds: float
    cached: bool
    vocab: int  # the tokenizer's vocabulary: the width of the rows' masks

    def row(self) -> RowConstraint:
        self.entry.rows += 1
        return RowConstraint(self.entry.template.deep_copy(), self.vocab)


class ConstraintCompiler:
    """The constraints of one tokenizer (`tokenizer.json`, its vocabulary of `vocab_size` and its EOS): each compiled
    once, the last `COMPILED_CACHED` kept. Thread-safe; a compilation runs on the caller's thread (llguidance drops
    the GIL while it builds), so callers run it off the event loop."""

    def __init__(self, tokenizer_file: str | Path, vocab_size: int, eos_ids: Sequence[int],
                 cached: int = COMPILED_CACHED):
        self.tokenizer = llguidance.LLTokenizer(Path(tokenizer_file).read_text(), n_vocab=vocab_size,
                                                eos_token=list(eos_ids))
        self.vocab_size = vocab_size
        self.limits = llguidance.LLParserLimits(**PARSER_LIMITS)
        self._cache: OrderedDict[Constraint, _Entry] = OrderedDict()
        self._capacity = cached
        self._lock = threading.Lock()
        # the cached constraints' matchers built again (`ROWS_PER_TEMPLATE`), one at a time, beside the requests
        self._rebuilds = ThreadPoolExecutor(max_workers=1, thread_name_prefix="constraint-rebuild")

    def compile(self, constraint: Constraint) -> Compiled:
        """The compiled `constraint` (from the cache when it was compiled before); `ConstraintError` with
        llguidance's reason when it cannot be."""
        with self._lock:
            entry = self._cache.get(constraint)
            if entry is not None:
                self._cache.move_to_end(constraint)
        if entry is not None:
            if entry.rows >= ROWS_PER_TEMPLATE and not entry.rebuilding:  # a fresh lexer, built aside
                entry.rebuilding = True
                self._rebuilds.submit(self._rebuild, constraint, entry)
            return Compiled(entry, 0.0, True, self.vocab_size)
        started = time.perf_counter()
        entry = _on_large_stack(lambda: self._entry(constraint))
        seconds = time.perf_counter() - started
        with self._lock:
            self._cache[constraint] = entry
            while len(self._cache) > self._capacity:
                self._cache.popitem(last=False)
        return Compiled(entry, seconds, False, self.vocab_size)

    def _rebuild(self, constraint: Constraint, entry: _Entry) -> None:
        """`entry`'s matcher built again from its grammar (`ROWS_PER_TEMPLATE`), off every request's path."""
        try:
            entry.template, entry.rows = _on_large_stack(lambda: self._matcher(constraint, entry.grammar)), 0
        finally:
            entry.rebuilding = False

    def _entry(self, constraint: Constraint) -> _Entry:
        """`constraint` compiled: its grammar and a matcher of it (`_matcher`). On a large stack (`_on_large_stack`)."""
        grammar = constraint.grammar()
        return _Entry(grammar, self._matcher(constraint, grammar))

    def _matcher(self, constraint: Constraint, grammar: str) -> llguidance.LLMatcher:
        """A matcher of `grammar`, checked as far as its first token (some limits are only met there: a regex such as
        `(a{1000}){1000}` compiles, allows "a", then fails to take it). On a large stack (`_on_large_stack`)."""
        template = llguidance.LLMatcher(self.tokenizer, grammar, log_level=0, limits=self.limits)
        if not template.is_error():
            probe = template.deep_copy()
            allowed = np.unpackbits(np.frombuffer(probe.compute_bitmask(), np.uint8),
                                    bitorder="little")[: self.vocab_size]
            first = next((int(t) for t in np.flatnonzero(allowed) if t not in self.tokenizer.eos_tokens), None)
            if first is not None:
                probe.consume_token(first)
            if probe.is_error():
                template = probe
        if template.is_error():
            raise ConstraintError(f"invalid {constraint.kind}: {template.get_error()}", constraint.field)
        return template


_STACK_SIZE_LOCK = threading.Lock()


def _on_large_stack(function: Callable[[], object]):
    """`function()` on a fresh thread with `COMPILE_STACK_BYTES` of stack; what it raises is raised here."""
    outcome: list = []

    def run() -> None:
        try:
            outcome.append((True, function()))
        except BaseException as error:  # handed to the caller's thread
            outcome.append((False, error))

    with _STACK_SIZE_LOCK:  # `threading.stack_size` is process-wide: set only while this thread is made
        previous = threading.stack_size(COMPILE_STACK_BYTES)
        try:
            thread = threading.Thread(target=run, name="constraint-compile", daemon=True)
            thread.start()
        finally:
            threading.stack_size(previous)
    thread.join()
    succeeded, value = outcome[0]
    if not succeeded:
        raise value
    return value


class RowConstraint:
    """A row's matcher and, during a step, the tokens it allows (`allow_rows` fills `allowed`, or `error`: why it
    allows none, raised when the row's step reads its mask, so that only this row's request fails). A row whose
    step needs no full mask (greedy: the raw argmax, unless it is banned) asks `bans` of one token, which llguidance
    answers without a mask (`validate_tokens`, ~0.4 us against ~17 us for a mask; the same answer for every token
    of 873 states of four constraint kinds, EOS included); its mask is filled only if that token is banned."""

    __slots__ = ("matcher", "matcher_vocab", "allowed", "error")

    def __init__(self, matcher: llguidance.LLMatcher, vocab: int):
        self.matcher = matcher
        self.matcher_vocab = vocab  # the logits' width the masks cover
        self.allowed: np.ndarray | None = None  # (V,) bool, this step's (None: not filled yet)
        self.error: str | None = None

    def _mask(self) -> np.ndarray:
        if self.allowed is None and self.error is None:
            allow_rows([self], self.matcher_vocab)
        if self.error is not None:
            raise RuntimeError(f"the constraint allows no token: {self.error}")
        return self.allowed

    def bans(self, token: int) -> bool:
        if self.allowed is None and self.error is None:
            return self.matcher.validate_tokens([int(token)]) != 1
        return not self._mask()[token]

    def ban(self, banned: np.ndarray) -> None:
        """In place on a ban mask (V,) bool: every token the constraint does not allow now (the logits' tokens
        past the tokenizer's vocabulary too)."""
        allowed = self._mask()
        covered = min(len(allowed), banned.shape[-1])
        np.logical_or(banned[:covered], ~allowed[:covered], out=banned[:covered])
        banned[covered:] = True

    def advance(self, token: int) -> bool:
        """Consume the chosen token -> whether the constraint is complete (it can take no further token)."""
        if not self.matcher.consume_token(int(token)):
            raise RuntimeError(f"the constraint refused token {token}: {self.matcher.get_error()}")
        self.allowed = self.error = None  # the next step's mask is another
        return self.matcher.is_stopped()


_EXECUTOR = llguidance.LLExecutor()


def allow_rows(rows: Sequence[RowConstraint], vocab: int) -> None:
    """Each row's allowed tokens for this step (`RowConstraint.allowed`, (vocab,) bool), computed for every row in
    one call of llguidance's parallel mask fill and unpacked at once."""
    if not rows:
        return
    words = (vocab + BITS_PER_WORD - 1) // BITS_PER_WORD
    bitmask = np.zeros((len(rows), words), np.int32)
    llg_numpy.fill_next_token_bitmask_par(_EXECUTOR, [(row.matcher, i) for i, row in enumerate(rows)], bitmask)
    allowed = np.unpackbits(bitmask.view(np.uint8), axis=1, bitorder="little")[:, :vocab].astype(bool)
    for row, mask in zip(rows, allowed):
        row.allowed = mask
        row.error = (row.matcher.get_error() if row.matcher.is_error() else
                     None if mask.any() else "it is complete")
