"""The output constraint a request names, as every API takes it (native `/v1/generate` and the Open Inference
Protocol's gpt parameters: `json_schema`, `regex`, `choice`, `grammar`, as llama.cpp's server takes `json_schema`
and `grammar`; OpenAI's `response_format` and vLLM's `structured_outputs` / `guided_*`: `service.api.openai.
structured`): at most one per request. `one_constraint` turns what a request sent into the serving layer's
`Constraint`: a 400 naming the field for a value of the wrong shape, naming every field when two were sent.
Compiling it (a 400 naming the field for what does not compile) is the serving layer's (`service.serving.constrain`).
"""

from __future__ import annotations

import json
from collections.abc import Sequence

from service.decoding.constraints import CHOICE, GRAMMAR, JSON_SCHEMA, REGEX, Constraint, ConstraintError
from service.errors import BadInput, json_error_reason

# The native API's constraint fields (the Open Inference Protocol's gpt parameters too) -> their kind
NATIVE_FIELDS = {"json_schema": JSON_SCHEMA, "regex": REGEX, "choice": CHOICE, "grammar": GRAMMAR}
Sent = tuple[str, str, object]  # (the request field, the constraint's kind, its value)


def one_constraint(sent: Sequence[Sent]) -> Constraint | None:
    """The request's one constraint (None without one); a 400 naming every field when it sent more than one, or
    naming the field when its value has the wrong shape (an empty choice list, a schema that is not an object)."""
    if len(sent) > 1:
        names = [name for name, _, _ in sent]
        raise BadInput(f"{' and '.join(names)}: at most one output constraint per request (got {len(names)})",
                       param=", ".join(names))
    if not sent:
        return None
    (name, kind, value), = sent
    try:
        return Constraint.of(kind, value, name)
    except ConstraintError as error:
        raise BadInput(f"{name}: {error}", param=name) from None


def json_text(value, name: str):
    """A value that a request may give as JSON text (a schema over gRPC, a choice list as a parameter): parsed when
    it is a string, as it is otherwise; a 400 naming `name` for text that is not JSON."""
    if not isinstance(value, str):
        return value
    try:
        return json.loads(value)
    except (ValueError, RecursionError) as error:
        raise BadInput(f"{name}: not valid JSON ({json_error_reason(error)})", param=name) from None
