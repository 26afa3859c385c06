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
from collections.abc import Sequence
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
# llguidance's resource limits (`LLParserLimits`): a compilation or a mask step past them is an error, not a stall
# (its docs: ~50k fuel units/ms when compiling, ~14k/ms per step): 20 ms of lexer fuel to build, 5 ms per step
PARSER_LIMITS = dict(initial_lexer_fuel=1_000_000, step_lexer_fuel=70_000, max_grammar_size=200_000,
                     max_lexer_states=50_000)
JSON_OPTIONS = {"whitespace_flexible": False}  # compact JSON (`{"a":1}`): no runs of whitespace between tokens
BITS_PER_WORD = 32


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
class Compiled:
    """A compiled constraint: the matcher every row copies, and how long compiling it took (0 when cached)."""

    template: llguidance.LLMatcher
    seconds: float
    cached: bool

    def row(self) -> RowConstraint:
        return RowConstraint(self.template.deep_copy())


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
        self._cache: OrderedDict[Constraint, llguidance.LLMatcher] = OrderedDict()
        self._capacity = cached
        self._lock = threading.Lock()

    def compile(self, constraint: Constraint) -> Compiled:
        """The compiled `constraint` (from the cache when it was compiled before); `ConstraintError` with
        llguidance's reason when it cannot be."""
        with self._lock:
            template = self._cache.get(constraint)
            if template is not None:
                self._cache.move_to_end(constraint)
                return Compiled(template, 0.0, True)
        started = time.perf_counter()
        grammar = constraint.grammar()
        template = llguidance.LLMatcher(self.tokenizer, grammar, log_level=0, limits=self.limits)
        if template.is_error():
            raise ConstraintError(f"invalid {constraint.kind}: {template.get_error()}", constraint.field)
        seconds = time.perf_counter() - started
        with self._lock:
            self._cache[constraint] = template
            while len(self._cache) > self._capacity:
                self._cache.popitem(last=False)
        return Compiled(template, seconds, False)


class RowConstraint:
    """A row's matcher and, during a step, the tokens it allows (`allow_rows` fills `allowed`)."""

    __slots__ = ("matcher", "allowed")

    def __init__(self, matcher: llguidance.LLMatcher):
        self.matcher = matcher
        self.allowed: np.ndarray | None = None  # (V,) bool, this step's

    def bans(self, token: int) -> bool:
        return not self.allowed[token]

    def ban(self, banned: np.ndarray) -> None:
        """In place on a ban mask (V,) bool: every token the constraint does not allow now."""
        np.logical_or(banned, ~self.allowed[: banned.shape[-1]], out=banned)

    def advance(self, token: int) -> bool:
        """Consume the chosen token -> whether the constraint is complete (it can take no further token)."""
        if not self.matcher.consume_token(int(token)):
            raise RuntimeError(f"the constraint refused token {token}: {self.matcher.get_error()}")
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
        if not mask.any():
            raise RuntimeError(f"the constraint allows no token: {row.matcher.get_error() or 'it is complete'}")
        row.allowed = mask
