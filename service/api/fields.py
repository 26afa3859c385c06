"""Validators and limits that the three protocols' request schemas share (native, OpenAI-compatible and Open
Inference Protocol): valid Unicode in every string (`ValidUnicode`), integers as JSON Schema counts them
(`integer`), model names, stop strings, seeds and the length-penalty range, and `ascii_digits` for a number in a
header or a path. Each protocol module builds its own schemas from these (as vLLM's entrypoints share their
`protocol` validators); nothing here knows one protocol. Validation runs on the event loop: the Unicode check costs
C speed per value, never Python per value.
"""

from __future__ import annotations

from itertools import chain
from typing import Annotated

from pydantic import BaseModel, BeforeValidator, ConfigDict, Field, ValidationError, model_validator
from pydantic_core import InitErrorDetails, PydanticCustomError

# The longest model name a request may give: far above any repository folder's, short enough to echo in a message.
MAX_NAME_CHARS = 128
# Stop strings per request, and characters per stop string: what a stop-string check per token can afford.
MAX_STOP_STRINGS, MAX_STOP_CHARS = 8, 64
# The largest integer every JSON parser reads exactly (IEEE doubles hold 53 bits of mantissa): the bound of an
# integer field that has no other (a seed, a top-k), so that none reaches numpy beyond its 64-bit integers.
MAX_JSON_INTEGER = 2**53 - 1
MAX_SEED = MAX_JSON_INTEGER
# Strict request models: an unknown field is an error naming it, "4" is not an integer, 0 is not a boolean;
# `model` and `model_*` are ordinary field names here (pydantic reserves them otherwise).
STRICT = ConfigDict(extra="forbid", strict=True, protected_namespaces=())


def ascii_digits(text: str) -> bool:
    """Whether `text` is a non-negative decimal integer in ASCII digits: `str.isdigit()` also holds for "²" (which
    `int()` refuses) and for other scripts' digits, which a number in a header or a path must not be."""
    return text.isascii() and text.isdigit()


def _surrogate_in(text: str) -> str | None:
    """The first lone surrogate of `text` (what UTF-8 cannot hold), or None; ASCII, the common case, costs nothing."""
    if text.isascii():
        return None
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as error:
        return text[error.start]
    return None


_SCALARS = frozenset({int, float, bool, type(None)})  # the JSON values that hold no string
# Items per slice when `lone_surrogate` looks for the first list item that holds one: each slice is checked at C
# speed, then only the slice that holds it item by item, so a list of millions of strings costs no Python per item.
SURROGATE_SLICE = 1024


def _clean(values: list) -> bool:
    """Whether no string in `values`, or in the lists and dicts they hold at any depth (field names included),
    holds a lone surrogate. Level by level, each level's strings joined and checked at once and its containers
    flattened into the next (C speed): a body of millions of values costs no Python per value. Python's UTF-8
    codec refuses a surrogate even where two joined strings put a high and a low one side by side."""
    level = values
    while level:
        kinds = set(map(type, level))
        if kinds <= _SCALARS:
            return True

        def of(kind: type) -> list:  # the level's values of `kind`: the level itself when it holds nothing else
            if not any(issubclass(k, kind) for k in kinds):
                return []
            return level if kinds == {kind} else [v for v in level if isinstance(v, kind)]

        if _surrogate_in("".join(of(str))) is not None:
            return False
        dicts = of(dict)
        level = [*chain.from_iterable(of(list)), *chain.from_iterable(dicts),  # the dicts' field names, and values
                 *chain.from_iterable(map(dict.values, dicts))]
    return True


def _first_unclean(items: list) -> int:
    """The index of the first of `items` that holds a lone surrogate (one does)."""
    for start in range(0, len(items), SURROGATE_SLICE):
        part = items[start : start + SURROGATE_SLICE]
        if not _clean(part):
            return start + next(i for i, item in enumerate(part) if not _clean([item]))
    raise AssertionError("no item holds a lone surrogate")


def lone_surrogate(data) -> tuple[tuple, str | None, str] | None:
    """The first lone surrogate in parsed JSON, in document order (a dict's field names before its values): (its
    location, the field name that holds it or None when a value does, the surrogate), or None when every string and
    field name is valid Unicode. A check at C speed first (`_clean`), then a walk down to the first one: its
    cost grows with the body, not with the number of values in it, and nesting is no problem here."""
    if _clean([data]):
        return None
    location, value = (), data
    while not isinstance(value, str):
        if isinstance(value, dict):
            names = list(value)
            if not _clean(names):
                name = names[_first_unclean(names)]
                return location, name, _surrogate_in(name)
            children = list(value.values())
        else:
            names, children = None, value
        index = _first_unclean(children)
        location, value = (*location, names[index] if names is not None else index), children[index]
    return location, None, _surrogate_in(value)


class ValidUnicode(BaseModel):
    """A request model whose every string and field name must be valid Unicode, checked on the raw input before any
    field (a string that reached an unconstrained field would otherwise fail later, in a tokenizer or in rendering
    a response): otherwise a validation error located where the lone surrogate is."""

    @model_validator(mode="before")
    @classmethod
    def _valid_unicode(cls, data):
        if (found := lone_surrogate(data)) is not None:
            location, key, surrogate = found
            escaped = surrogate.encode("utf-8", "backslashreplace").decode()
            message = (f"{'a field name' if key is not None else 'Input'} should be a valid unicode string: it holds "
                       f"the lone surrogate {escaped} (half of a UTF-16 pair)")
            raise ValidationError.from_exception_data(cls.__name__, [InitErrorDetails(
                type=PydanticCustomError("string_unicode", message), loc=location, input=escaped)])
        return data


def _integral(value):
    """JSON Schema counts 7.0 as an integer; strict pydantic does not. Accept integral floats (only)."""
    return int(value) if isinstance(value, float) and value.is_integer() else value


def integer(**bounds):
    """An integer field type with its bounds (ge, le): 7.0 is accepted as 7; "7", 7.5 and true are not integers."""
    return Annotated[int, Field(**bounds), BeforeValidator(_integral)]


Name = Annotated[str, Field(min_length=1, max_length=MAX_NAME_CHARS)]
StopString = Annotated[str, Field(min_length=1, max_length=MAX_STOP_CHARS)]
Seed = integer(ge=0, le=MAX_SEED)
