"""Settings that take one value for every model or one per model (`TSERVE_VARIANT=gpt=int8+gqa,translation=stored`,
`TSERVE_DEFAULT_PRIORITY=1,vit=0`): `VALUE` for all, `MODEL=VALUE` for one, each model once; what a model gets is its
own value, else the one for all (`ALL_MODELS`), else the setting's default."""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import TypeVar

T = TypeVar("T")
ALL_MODELS = "*"  # the key of a value given without a model name


def parse_per_model(spec: str, setting: str, convert: Callable[[str], T]) -> dict[str, T]:
    """`spec` -> model name (or ALL_MODELS) -> value; `convert` turns a value's text into the value or raises
    ValueError saying what it expected. ValueError naming `setting` and the bad entry."""
    values: dict[str, T] = {}
    for part in filter(None, (p.strip() for p in spec.split(","))):
        name, equals, text = (x.strip() for x in part.rpartition("=")) if "=" in part else (ALL_MODELS, "", part)
        try:
            if (equals and not name) or name in values:
                raise ValueError("each model once")
            values[name] = convert(text)
        except ValueError as error:
            raise ValueError(f"bad {setting} entry {part!r}: expected VALUE or MODEL=VALUE, each model once, VALUE "
                             f"{error}") from None
    return values


def value_for(values: Mapping[str, T], name: str, default: T) -> T:
    """What model `name` gets: its own value, else the one for all models, else `default`."""
    return values.get(name, values.get(ALL_MODELS, default))
