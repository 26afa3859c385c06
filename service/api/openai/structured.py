"""Structured output in the OpenAI-compatible API, as its clients send it: OpenAI's `response_format` (`text`,
`json_object`, `json_schema` with `name`, `schema`, `strict`, `description`: what the SDK's `parse()` sends), vLLM's
`structured_outputs` (exactly one of `json`, `regex`, `choice`, `grammar`, `json_object`) and vLLM's older top-level
`guided_json`, `guided_regex`, `guided_choice`, `guided_grammar`. `ConstrainedFields` holds them for completions and
chat alike (`service.api.openai.protocol`); `constraint()` is the one `Constraint` the request sent (at most one:
a 400 naming each field of a second; `service.api.constraint_fields`). Each field's rule: `field_rules`.

`strict` is accepted either way: the output always matches the schema (it is decoded under it), so `strict: false`
(OpenAI's "best effort") gets what `true` gets.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import BaseModel, Discriminator, Field, StrictBool, Tag

from service.api.constraint_fields import Sent, json_text, one_constraint
from service.api.fields import STRICT
from service.decoding.constraints import CHOICE, GRAMMAR, JSON_OBJECT, JSON_SCHEMA, REGEX, Constraint
from service.errors import BadInput

MAX_FORMAT_NAME_CHARS = 64  # OpenAI's limit of `json_schema.name`, and what it may hold
FORMAT_NAME_PATTERN = r"^[A-Za-z0-9_-]+$"
MAX_OPTION_CHARS = 512  # an option this service ignores (a backend's name, a whitespace pattern)
ANY_JSON: dict = {}  # the schema of a `json_schema` format that gives none: any JSON value
Option = Annotated[str, Field(max_length=MAX_OPTION_CHARS)]
# vLLM's constraint keys of `structured_outputs` -> their kind
VLLM_CONSTRAINTS = {"json": JSON_SCHEMA, "regex": REGEX, "choice": CHOICE, "grammar": GRAMMAR,
                    "json_object": JSON_OBJECT}


class _Strict(BaseModel):
    model_config = STRICT


class TextFormat(_Strict):
    type: Literal["text"]


class JSONObjectFormat(_Strict):
    type: Literal["json_object"]


class JSONSchemaSpec(_Strict):
    name: Annotated[str, Field(min_length=1, max_length=MAX_FORMAT_NAME_CHARS, pattern=FORMAT_NAME_PATTERN)] = Field(
        ..., description="The format's name (letters, digits, _ and -; up to 64).")
    description: str | None = Field(None, description="What the format is for (not shown to the model).")
    schema_: dict[str, Any] | None = Field(None, alias="schema", description="The JSON schema the "
                                                        "output matches; left out: any JSON value.")
    strict: StrictBool | None = Field(None, description="Accepted: the output matches the schema either way.")


class JSONSchemaFormat(_Strict):
    type: Literal["json_schema"]
    json_schema: JSONSchemaSpec


def _format_type(value) -> str | None:
    return value.get("type") if isinstance(value, dict) else getattr(value, "type", None)


# A union told apart by `type`; its members' tags hold a quote, so an error's field path skips them
# (`service.errors.field_path`): `response_format.json_schema.schema`, not `...json_schema.json_schema.schema`.
ResponseFormat = Annotated[
    Annotated[TextFormat, Tag("'text'")] | Annotated[JSONObjectFormat, Tag("'json_object'")]
    | Annotated[JSONSchemaFormat, Tag("'json_schema'")],
    Discriminator(lambda value: f"'{_format_type(value)}'", custom_error_type="response_format_type",
                  custom_error_message='type must be "text", "json_object" or "json_schema"')]


class StructuredOutputs(_Strict):
    """vLLM's `structured_outputs` (its `StructuredOutputsParams`): one constraint, and its options."""

    json_: dict[str, Any] | str | None = Field(None, alias="json", description="A JSON schema (or its "
                                                            "JSON text): the output matches it.")
    regex: str | None = Field(None, description="The output matches this regular expression.")
    choice: list[str] | None = Field(None, description="The output is one of these strings.")
    grammar: str | None = Field(None, description="The output matches this grammar (Lark, or llama.cpp's GBNF).")
    json_object: StrictBool | None = Field(None, description="true: the output is a JSON object.")
    disable_any_whitespace: StrictBool | None = Field(None, description="The JSON is compact either way.")
    disable_additional_properties: StrictBool | None = Field(None, description="Only false.")
    disable_fallback: StrictBool | None = Field(None, description="Ignored (one backend).")
    whitespace_pattern: Option | None = Field(None, description="Ignored (the JSON is compact).")
    structural_tag: str | dict[str, Any] | None = Field(None, description="Not supported (only null).")

    def sent(self, field: str) -> list[Sent]:
        """Its constraint; a 400 unless it holds exactly one (`json_object: false` holds none)."""
        values = {"json": self.json_, "regex": self.regex, "choice": self.choice, "grammar": self.grammar,
                  "json_object": True if self.json_object else None}
        given = [(f"{field}.{key}", kind, values[key]) for key, kind in VLLM_CONSTRAINTS.items()
                 if values[key] is not None]
        if not given:
            raise BadInput(f"{field}: give one of {', '.join(VLLM_CONSTRAINTS)}", param=field)
        return given


class ConstrainedFields(BaseModel):
    """The structured-output fields of completions and chat requests."""

    response_format: ResponseFormat | None = Field(
        None, description='{"type": "text"} (no constraint), {"type": "json_object"} (a JSON object) or '
        '{"type": "json_schema", "json_schema": {"name", "schema", "strict", "description"}} (JSON matching '
        "the schema, whatever strict says).")
    structured_outputs: StructuredOutputs | None = Field(None, description="vLLM's: exactly one of json, regex, "
                                                         "choice, grammar, json_object.")
    guided_json: dict[str, Any] | str | None = Field(None, description="vLLM's: a JSON schema.")
    guided_regex: str | None = Field(None, description="vLLM's: a regular expression.")
    guided_choice: list[str] | None = Field(None, description="vLLM's: the output is one of these strings.")
    guided_grammar: str | None = Field(None, description="vLLM's: a grammar (Lark, or llama.cpp's GBNF).")
    guided_decoding_backend: Option | None = Field(None, description="Ignored (one backend: llguidance).")
    guided_whitespace_pattern: Option | None = Field(None, description="Ignored (the JSON is compact).")

    def constraint(self) -> Constraint | None:
        """The one output constraint the request sent, or None; a 400 naming the fields of two."""
        sent: list[Sent] = []
        form = self.response_format
        if isinstance(form, JSONObjectFormat):
            sent.append(("response_format", JSON_OBJECT, None))
        elif isinstance(form, JSONSchemaFormat):
            schema = form.json_schema.schema_
            sent.append(("response_format.json_schema.schema", JSON_SCHEMA,
                         dict(ANY_JSON) if schema is None else schema))
        if self.structured_outputs is not None:
            sent += self.structured_outputs.sent("structured_outputs")
        for name, kind in (("guided_json", JSON_SCHEMA), ("guided_regex", REGEX), ("guided_choice", CHOICE),
                           ("guided_grammar", GRAMMAR)):
            if (value := getattr(self, name)) is not None:
                sent.append((name, kind, value))
        return one_constraint([(name, kind, json_text(value, name) if kind == JSON_SCHEMA else value)
                               for name, kind, value in sent])
