"""Constrained decoding end to end on the released GPT (`GPTEngine.generate`, greedy and seeded sampling at
temperature 1): 44 JSON schemas of varied features, regular expressions, choices and grammars (Lark and GBNF).
Every output that completes (finish_reason "stop": the constraint is complete, or "eos": EOS where it accepts)
is checked by an independent implementation: `jsonschema` (Draft 2020-12, with its format checker), `re.fullmatch`,
membership, a recursive-descent parser; at least `MIN_COMPLETE` of them complete within `MAX_NEW_TOKENS` (the tiny
model writes Shakespeare, not JSON: the constraint does the rest), and one cut short is exactly `MAX_NEW_TOKENS`
long, without EOS, and a prefix the constraint accepts."""

from __future__ import annotations

import json
import re

import pytest
from jsonschema import Draft202012Validator

from service.decoding.constraints import Constraint, ConstraintError
from service.decoding.sampling import SamplingSearch
from service.engines.gpt import GPTEngine
from service.repository import ModelRepository
from tests.support import ROOT

MAX_NEW_TOKENS = 160
PROMPT = "ROMEO:\n"  # the released GPT's context is 256 tokens: prompt + MAX_NEW_TOKENS fit
MODES = {"greedy": (0.0, None), "sample seed 1": (1.0, 1), "sample seed 2": (1.0, 2)}
MIN_COMPLETE = 0.9
COMPLETE = ("stop", "eos")


def _object(properties: dict, required=None) -> dict:
    return {"type": "object", "properties": properties, "required": list(properties) if required is None else required,
            "additionalProperties": False}


DIGIT = {"type": "integer", "minimum": 0, "maximum": 9}
WORD = {"type": "string", "maxLength": 8}
POINT = _object({"x": {"type": "integer", "minimum": -99, "maximum": 99}, "y": {"type": "integer", "minimum": -99,
                                                                              "maximum": 99}})
SCHEMAS = [
    _object({"name": {"type": "string", "maxLength": 12}, "age": {"type": "integer", "minimum": 0, "maximum": 120}}),
    _object({"person": _object({"first": WORD, "last": WORD})}),
    _object({"a": _object({"b": _object({"c": DIGIT})})}),
    {"type": "array", "items": {"type": "integer", "minimum": 0, "maximum": 99}, "minItems": 2, "maxItems": 4},
    {"type": "array", "items": {"type": "string", "minLength": 1, "maxLength": 5}, "minItems": 1, "maxItems": 3},
    {"type": "array", "items": {"type": "array", "items": {"type": "boolean"}, "minItems": 1, "maxItems": 2},
     "minItems": 1, "maxItems": 2},
    {"type": "array", "items": _object({"k": {"type": "string", "maxLength": 4}, "v": DIGIT}), "minItems": 1,
     "maxItems": 2},
    {"type": "array", "prefixItems": [{"type": "string", "maxLength": 5}, DIGIT], "items": False, "minItems": 2},
    {"enum": ["red", "green", "blue"]},
    {"enum": [1, "two", None, True]},
    _object({"w": {"enum": ["café", "naïve", "日本"]}}),
    {"type": "integer", "minimum": 10, "maximum": 20},
    {"type": "integer", "exclusiveMinimum": 0, "exclusiveMaximum": 5},
    {"type": "integer", "minimum": -50, "maximum": -40},
    {"type": "number", "minimum": -1.5, "maximum": 2.5, "multipleOf": 0.25},
    {"type": "number", "exclusiveMinimum": 0, "exclusiveMaximum": 1, "multipleOf": 0.01},
    _object({"price": {"type": "number", "minimum": 0, "maximum": 1000}, "qty": {"type": "integer", "minimum": 1,
                                                                                 "maximum": 12}}),
    {"type": "string", "minLength": 3, "maxLength": 6},
    {"type": "string", "pattern": "^[A-Z][a-z]{2,6}$"},
    {"type": "string", "pattern": "^\\d{3}-\\d{4}$"},
    _object({"zip": {"type": "string", "pattern": "^[0-9]{5}$"}, "code": {"type": "string", "pattern": "^[A-Z]{2}$"}}),
    {"type": "string", "format": "date"},
    {"type": "string", "format": "date-time"},
    {"type": "string", "format": "time"},
    {"type": "string", "format": "email", "maxLength": 24},
    {"type": "string", "format": "uuid"},
    {"type": "string", "format": "ipv4"},
    _object({"when": {"type": "string", "format": "date"}, "count": {"type": "integer", "minimum": 1, "maximum": 5}}),
    {"anyOf": [{"type": "integer", "minimum": 0, "maximum": 999}, {"type": "string", "maxLength": 5}]},
    {"oneOf": [_object({"kind": {"const": "a"}, "x": DIGIT}), _object({"kind": {"const": "b"}, "y": {"type":
                                                                                                       "boolean"}})]},
    {"$defs": {"point": POINT}, **_object({"a": {"$ref": "#/$defs/point"}, "b": {"$ref": "#/$defs/point"}})},
    {"$defs": {"s": {"type": "string", "maxLength": 6}}, "anyOf": [{"$ref": "#/$defs/s"}, {"type": "null"}]},
    {"$defs": {"node": _object({"v": DIGIT, "kids": {"type": "array", "items": {"$ref": "#/$defs/node"},
                                                     "maxItems": 2}}, required=["v"])}, "$ref": "#/$defs/node"},
    _object({"a": {"type": "boolean"}, "b": {"type": "null"}}, required=[]),
    _object({"id": {"type": "integer", "minimum": 1, "maximum": 999}, "note": {"type": "string", "maxLength": 10},
             "done": {"type": "boolean"}}, required=["id"]),
    _object({"version": {"const": 2}, "ok": {"type": "boolean"}}),
    {"const": "fixed"},
    {"type": ["string", "null"], "maxLength": 8},
    {"type": ["integer", "null"], "minimum": 0, "maximum": 9},
    _object({"nick": {"type": ["string", "null"], "maxLength": 6}, "score": {"type": ["number", "null"],
                                                                             "minimum": 0, "maximum": 10}}),
    {"type": "boolean"},
    {"type": "null"},
    {"type": "integer", "multipleOf": 5, "minimum": 0, "maximum": 100},
    _object({"email": {"type": "string", "format": "email", "maxLength": 16},
             "id": {"type": "string", "format": "uuid"}}),
]
REGEXES = [r"\d{3}-\d{4}", r"[A-Z][a-z]{2,8}( [A-Z][a-z]{2,8})?", r"(yes|no|maybe)",
           r"[a-z]{2,8}@[a-z]{2,8}\.(com|org)",
           r"\(\d{3}\) \d{3}-\d{4}", r"(0|[1-9][0-9]{0,3})(\.[0-9]{1,2})?", r"[A-Fa-f0-9]{8}",
           r"(ROMEO|JULIET|[A-Z]{3,6}):\n[A-Z][a-z ,]{5,30}[.!?]", r"([a-z]{1,6} ){2,4}[a-z]{1,6}\.", r"\w{1,10}",
           r"[^\n]{5,20}", r"(ab|cd){1,5}e", r"[0-9]{1,3}(,[0-9]{3}){0,2}",
           r"(café|naïve|日本)( [a-zé]{1,6}){0,2}"]
CHOICES = [["yes", "no"], ["ROMEO", "JULIET", "MERCUTIO", "TYBALT"], ["café", "日本", "naïve"], ["a", "ab", "abc"]]
ARITHMETIC_LARK = """start: expr
expr: term (("+" | "-") term){0,3}
term: factor (("*" | "/") factor){0,3}
factor: NUMBER | "(" expr ")"
NUMBER: /[0-9]{1,3}/
"""
ARITHMETIC_GBNF = """root ::= expr
expr ::= term (("+" | "-") term){0,3}
term ::= factor (("*" | "/") factor){0,3}
factor ::= [0-9]{1,3} | "(" expr ")"
"""
WORDS_GBNF = 'root ::= word (", " word){0,3} "."\nword ::= [a-z]{1,8}\n'
WORDS_LARK = 'start: WORD (" " WORD){1,4} "!"\nWORD: /[A-Za-z]{1,8}/\n'
WORDS = {WORDS_GBNF: r"[a-z]{1,8}(, [a-z]{1,8}){0,3}\.", WORDS_LARK: r"[A-Za-z]{1,8}( [A-Za-z]{1,8}){1,4}!"}


def _parses_arithmetic(text: str) -> bool:
    """Recursive descent over `expr := term (("+"|"-") term){0,3}`, `term := factor (("*"|"/") factor){0,3}`,
    `factor := [0-9]{1,3} | "(" expr ")"`, the whole text."""
    position = 0

    def factor() -> bool:
        nonlocal position
        if text[position : position + 1] == "(":
            position += 1
            if not expr() or text[position : position + 1] != ")":
                return False
            position += 1
            return True
        digits = re.match(r"[0-9]{1,3}", text[position:])
        if digits is None:
            return False
        position += digits.end()
        return True

    def chain(operand, operators: str) -> bool:
        nonlocal position
        if not operand():
            return False
        for _ in range(3):
            if not (text[position : position + 1] and text[position] in operators):
                break
            position += 1
            if not operand():
                return False
        return True

    def term() -> bool:
        return chain(factor, "*/")

    def expr() -> bool:
        return chain(term, "+-")

    return expr() and position == len(text)


def _json_check(schema):
    validator = Draft202012Validator(schema, format_checker=Draft202012Validator.FORMAT_CHECKER)
    return lambda text: validator.validate(json.loads(text)) is None


CASES = ([(f"schema {i}", Constraint.of("json_schema", s, "json_schema"), _json_check(s)) for i, s in
          enumerate(SCHEMAS)]
         + [("json_object", Constraint.of("json_object", None, "json_object"), _json_check({"type": "object"}))]
         + [(f"regex {r!r}", Constraint.of("regex", r, "regex"), lambda t, r=r: re.fullmatch(r, t) is not None)
            for r in REGEXES]
         + [(f"choice {c}", Constraint.of("choice", c, "choice"), lambda t, c=c: t in c) for c in CHOICES]
         + [(f"grammar {g[:20]!r}", Constraint.of("grammar", g, "grammar"), _parses_arithmetic)
            for g in (ARITHMETIC_LARK, ARITHMETIC_GBNF)]
         + [(f"grammar {g[:20]!r}", Constraint.of("grammar", g, "grammar"),
             lambda t, p=p: re.fullmatch(p, t) is not None) for g, p in WORDS.items()])


@pytest.fixture(scope="module")
def engine() -> GPTEngine:
    return GPTEngine(ModelRepository(ROOT / "model_repository").get("gpt"))


@pytest.fixture(scope="module")
def outputs(engine) -> dict[str, list]:
    """mode -> per case, (tokens, finish_reason): every case of a mode decoded in one batch."""
    compiled = [engine.constraints.compile(constraint) for _, constraint, _ in CASES]
    prompt = list(PROMPT.encode())
    decoded = {}
    for mode, (temperature, seed) in MODES.items():
        searches = engine.generate([prompt] * len(CASES), lambda i: SamplingSearch(
            MAX_NEW_TOKENS, engine.eos_id, temperature=temperature, seed=seed, constraint=compiled[i].row()))
        decoded[mode] = [(h.tokens, h.finish_reason) for h in (s.results()[0] for s in searches)]
    return decoded


def test_the_suite_has_its_size():
    assert len(SCHEMAS) >= 40 and len(CASES) == len(SCHEMAS) + 1 + len(REGEXES) + len(CHOICES) + 4


@pytest.mark.parametrize("mode", MODES)
def test_every_completed_output_is_valid(outputs, mode):
    invalid = []
    for (name, _, check), (tokens, reason) in zip(CASES, outputs[mode]):
        if reason not in COMPLETE:
            continue
        text = bytes(tokens).decode("utf-8")  # the byte tokenizer's output: valid UTF-8
        try:
            if not check(text):
                invalid.append((name, text))
        except Exception as error:  # jsonschema's ValidationError, json's JSONDecodeError
            invalid.append((name, text, str(error)[:200]))
    assert not invalid, invalid


def test_most_outputs_complete_and_those_cut_short_are_prefixes_the_constraint_accepts(engine, outputs):
    complete, total = 0, 0
    for mode, decoded in outputs.items():
        for (name, constraint, _), (tokens, reason) in zip(CASES, decoded):
            total += 1
            if reason in COMPLETE:
                complete += 1
                continue
            assert reason == "length", (mode, name, reason)
            assert len(tokens) == MAX_NEW_TOKENS and engine.eos_id not in tokens, (mode, name)
            matcher = engine.constraints.compile(constraint).row().matcher
            assert matcher.validate_tokens(tokens) == len(tokens), (mode, name, bytes(tokens))
    print(f"\n{complete} of {total} constrained outputs completed within {MAX_NEW_TOKENS} tokens "
          f"({complete / total:.1%})")
    assert complete / total >= MIN_COMPLETE, (complete, total)


def test_a_formats_output_that_llguidance_accepts_is_what_jsonschema_accepts(outputs):
    """The formats `jsonschema` checks without extra packages (date, email, uuid, ipv4) are among the schemas."""
    checked = set(Draft202012Validator.FORMAT_CHECKER.checkers)
    assert {"date", "email", "uuid", "ipv4"} <= checked
    assert {s.get("format") for s in SCHEMAS} >= {"date", "date-time", "time", "email", "uuid", "ipv4"}


@pytest.mark.parametrize("format_name", ["iri", "uri-reference", "json-pointer", "uri-template", "hostname-x"])
def test_an_unsupported_format_is_an_error_naming_it(engine, format_name):
    schema = _object({"x": {"type": "string", "format": format_name}})
    with pytest.raises(ConstraintError, match=f"Unknown format: {format_name}") as error:
        engine.constraints.compile(Constraint.of("json_schema", schema, "response_format.json_schema"))
    assert error.value.field == "response_format.json_schema"
