"""What the OpenAI-compatible API does with each request field of `/v1/completions` and `/v1/chat/completions`: every
field OpenAI defines (the `openai` SDK's `CompletionCreateParams` types list them; a test fails on a field that has
no rule here) and the vLLM extensions the service takes (sampling, structured outputs), one rule each:

- honoured: the field does what OpenAI (or vLLM) documents; so does a value that asks for nothing this service
  cannot do (`tool_choice: "none"`, `logit_bias: {}`);
- ignored: it only labels the request or tunes a hosted service (`metadata`, `store`, `service_tier`, `user`, ...),
  so ignoring it changes nothing the caller gets; accepted, and named in the response's `X-Ignored-Fields` header;
- refused: ignoring it would change what the caller gets (tools to call, audio, web search, `logit_bias`): a 400
  naming the field and why.

A rule may depend on the value (`modalities: ["text"]` is ignored, one with "audio" refused). The request schemas
(`service.api.openai.protocol`) type every field; `check(body, rules)` applies the rules to a validated request.
docs/openai-fields.md is this table for people (a test keeps the two equal).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

from pydantic import BaseModel

from service.api.fields import MAX_STOP_STRINGS
from service.errors import BadInput

HONOURED, IGNORED, REFUSED = "honoured", "ignored", "refused"
# The response header that names the ignored fields a request sent, comma-separated in the table's order.
IGNORED_FIELDS_HEADER = "X-Ignored-Fields"
NESTED = "."  # a field of an object field, as the table names it: "stream_options.include_obfuscation"


@dataclass(frozen=True)
class FieldRule:
    rule: str  # the table's rule column: honoured, ignored, refused, or "refused unless ..." for a value's rule
    note: str  # what the service does with it (the table's last column); for a refused value, the 400's reason
    decide: Callable[[Any], str] | None = None  # value -> HONOURED / IGNORED / REFUSED; None: `rule` for any value

    def of(self, value) -> str:
        """The rule for this value of the field."""
        return self.decide(value) if self.decide is not None else self.rule


def honoured(note: str) -> FieldRule:
    return FieldRule(HONOURED, note)


def ignored(note: str) -> FieldRule:
    return FieldRule(IGNORED, note)


def refused_unless(no_op: str, test: Callable[[Any], bool], note: str) -> FieldRule:
    """A field honoured at the values `test` holds for (those asking for nothing this service does not do), refused
    at any other."""
    return FieldRule(f"refused unless {no_op}", note, lambda value: HONOURED if test(value) else REFUSED)


def _empty(value) -> bool:
    return not value


# --- the table -------------------------------------------------------------------------------------------------

SAMPLING = {
    "model": honoured("A loaded GPT model (`GET /v1/models`); another kind or an unknown name is a 404."),
    "temperature": honoured("0 (or below 1e-5) is greedy decoding; default 1."),
    "top_p": honoured("Nucleus sampling; default 1."),
    "n": honoured("Choices per prompt, sampled with seeds `seed + i`; at most `TSERVE_MAX_NUM_BEAMS`."),
    "stream": honoured("Server-sent chunks as OpenAI streams them, ending with `data: [DONE]`."),
    "stream_options": honoured("An object; its fields have their own rules."),
    "stream_options.include_usage": honoured("A last chunk with the usage and no choices."),
    "stream_options.include_obfuscation": ignored("OpenAI pads chunks against side channels on its network; the "
                                                  "chunks here have no padding."),
    "stop": honoured(f"Up to {MAX_STOP_STRINGS} stop strings; the text ends before the first."),
    "seed": honoured("Same seed, same text (choice i: seed + i)."),
    "presence_penalty": honoured("Minus this from the logit of every token already generated."),
    "frequency_penalty": honoured("Minus this times each token's count so far."),
    "logit_bias": refused_unless("empty", _empty, "logit_bias is not supported (only {}: the sampler biases no "
                                 "token)"),
    "user": ignored("A label of the end user for OpenAI's abuse monitoring."),
}
def _false(value) -> bool:
    return not value


# The structured outputs (`service.api.openai.structured`): OpenAI's `response_format`, vLLM's `structured_outputs`
# and its older `guided_*` fields; at most one constraint per request.
RESPONSE_FORMAT = honoured('`{"type": "text"}`: no constraint; `{"type": "json_object"}`: a JSON object; '
                           '`{"type": "json_schema", "json_schema": {"name", "schema", "strict", "description"}}`: '
                           "JSON matching `schema` (any JSON without one), whatever `strict` says: the output is "
                           "decoded under the schema. At most one constraint per request (with `structured_outputs` "
                           "or a `guided_*` field: a 400 naming both).")
STRUCTURED = {
    "structured_outputs": honoured("vLLM's: exactly one of `json`, `regex`, `choice`, `grammar`, `json_object` "
                                   "(none, or two, is a 400); its other fields have their own rules."),
    "structured_outputs.json": honoured("vLLM's: the output is JSON matching this JSON schema (an object, or its "
                                        "JSON text)."),
    "structured_outputs.regex": honoured("vLLM's: the output matches this regular expression, all of it."),
    "structured_outputs.choice": honoured("vLLM's: the output is one of these strings."),
    "structured_outputs.grammar": honoured("vLLM's: the output matches this grammar (Lark, or llama.cpp's GBNF)."),
    "structured_outputs.json_object": honoured("vLLM's: `true`: the output is a JSON object."),
    "structured_outputs.disable_any_whitespace": honoured("vLLM's: the JSON is compact (no whitespace between "
                                                          "tokens) whatever the value."),
    "structured_outputs.disable_additional_properties": refused_unless(
        "false", _false, "disable_additional_properties is not supported (a schema's own "
        '"additionalProperties": false is honoured)'),
    "structured_outputs.disable_fallback": ignored("vLLM's: one backend (llguidance), no fallback: a constraint "
                                                   "that does not compile is a 400 either way."),
    "structured_outputs.whitespace_pattern": ignored("vLLM's: the JSON is compact, no whitespace between tokens."),
    "structured_outputs.structural_tag": refused_unless("null", lambda value: value is None,
                                                        "structural_tag is not supported (the model calls no tools)"),
    "guided_json": honoured("vLLM's older name of `structured_outputs.json`."),
    "guided_regex": honoured("vLLM's older name of `structured_outputs.regex`."),
    "guided_choice": honoured("vLLM's older name of `structured_outputs.choice`."),
    "guided_grammar": honoured("vLLM's older name of `structured_outputs.grammar`."),
    "guided_decoding_backend": ignored("vLLM's: one backend (llguidance), whatever the name."),
    "guided_whitespace_pattern": ignored("vLLM's: the JSON is compact, no whitespace between tokens."),
}
# vLLM's sampling extensions, as tools written for vLLM send them (the SDK: `extra_body`): the native API's options.
EXTENSIONS = {
    "top_k": honoured("vLLM's: keep the k most likely tokens; 0 or -1 = off (the native `top_k`)."),
    "min_tokens": honoured("vLLM's: the end of text is blocked before this many tokens (the native "
                           "`min_new_tokens`); at most `max_tokens`."),
    "ignore_eos": honoured("vLLM's: the end of text never stops the choice, only `max_tokens` or a stop string do "
                           "(the end of text blocked for all `max_tokens` tokens, as `min_tokens`)."),
    "repetition_penalty": honoured("vLLM's (and transformers'): > 1 discourages tokens already present, prompt "
                                   "included (the native `repetition_penalty`)."),
    "priority": honoured("vLLM's: the request's queue level, lower served first (0 to TSERVE_PRIORITY_LEVELS - 1; "
                         "default: the model's, TSERVE_DEFAULT_PRIORITY); docs/priority.md."),
    **STRUCTURED,
}
COMPLETION_EXTENSIONS = {
    **EXTENSIONS,
    "prompt_logprobs": honoured("vLLM's: each prompt token's log-probability, rank and top alternatives (0-20) in "
                                "`choices[i].prompt_logprobs`, the first token's null; not with `stream`."),
    "response_format": RESPONSE_FORMAT,  # vLLM's completions take it; OpenAI's legacy completions do not
}
COMPLETION = {
    **SAMPLING,
    "prompt": honoured("A text or token ids, or a list of either (at most `TSERVE_MAX_TEXTS`)."),
    "max_tokens": honoured("Most tokens per choice; default 16. Prompt + max_tokens must fit the context."),
    "logprobs": honoured("The chosen token's log-probability and the top alternatives (0-20), OpenAI's legacy "
                         "shape; with `echo` the prompt's tokens first (the first one's null)."),
    "echo": honoured("The prompt in front of the text; with `max_tokens` 0 the prompt is only scored."),
    "best_of": honoured("Samples this many choices and returns the `n` with the highest log-probability per token; "
                        "at temperature 0 a beam search of this width."),
    "suffix": refused_unless("empty", _empty, "suffix is not supported (the model has no fill-in-the-middle "
                             "training)"),
    **COMPLETION_EXTENSIONS,
}


def _no_tool_choice(value) -> bool:
    return value in (None, "none", "auto")  # "auto" with no tools to choose from: none is called


def _no_function_call(value) -> bool:
    return value in (None, "none", "auto")


def _modalities(value) -> str:
    return REFUSED if value and "audio" in value else IGNORED


def _audio(value) -> str:
    return IGNORED if value is None else REFUSED


def _absent(value) -> bool:
    return value is None


CHAT = {
    **SAMPLING,
    "messages": honoured("Rendered as a play (system, developer, user, assistant; text content); the model speaks "
                         "the next turn. Other roles and content parts are a 400 naming them."),
    "max_tokens": honoured("Most tokens per choice (OpenAI's deprecated name of `max_completion_tokens`)."),
    "max_completion_tokens": honoured("Most tokens per choice; default: what the context leaves, up to "
                                      "`TSERVE_MAX_NEW_TOKENS`. Wins over `max_tokens`."),
    "logprobs": honoured("Each generated token's log-probability."),
    "top_logprobs": honoured("Alternatives per token (0-20), with `logprobs`."),
    "response_format": RESPONSE_FORMAT,
    "tools": refused_unless("empty", _empty, "tools are not supported (the model calls no tools)"),
    "tool_choice": refused_unless('"none" or "auto"', _no_tool_choice,
                                  "tool_choice: the model calls no tools (only \"none\" or \"auto\")"),
    "parallel_tool_calls": ignored("No tools are called, in parallel or not."),
    "functions": refused_unless("empty", _empty, "functions are not supported (the model calls no functions)"),
    "function_call": refused_unless('"none" or "auto"', _no_function_call,
                                    'function_call: the model calls no functions (only "none" or "auto")'),
    "audio": FieldRule("ignored if null, else refused", "audio output is not supported (the model writes text)",
                       _audio),
    "modalities": FieldRule('ignored if text only, else refused', 'modalities: only ["text"] is supported (no '
                            'audio output)', _modalities),
    "web_search_options": refused_unless("null", _absent, "web_search_options: web search is not supported"),
    "moderation": refused_unless("null", _absent, "moderation is not supported (nothing is moderated or "
                                 "blocked)"),
    "prediction": ignored("A predicted output only makes OpenAI's answer faster; the text is the same."),
    "reasoning_effort": ignored("The GPT has no reasoning phase to tune (it answers at once, whatever the value)."),
    "verbosity": ignored("The GPT has no verbosity control."),
    "metadata": ignored("Labels for OpenAI's dashboard and stored completions (at most 16 pairs)."),
    "store": ignored("Nothing is stored for OpenAI's distillation or evals."),
    "service_tier": ignored("OpenAI's processing tier; this service has one."),
    "prompt_cache_key": ignored("A hint for OpenAI's prompt cache."),
    "prompt_cache_retention": ignored("How long OpenAI keeps a cached prompt."),
    "prompt_cache_options": ignored("OpenAI's cache breakpoints."),
    "safety_identifier": ignored("A label of the end user for OpenAI's abuse monitoring."),
    **EXTENSIONS,
}
# per endpoint, the fields that are no OpenAI field of it (the docs mark them "(vLLM)")
EXTENSION_FIELDS = {"completion": frozenset(COMPLETION_EXTENSIONS), "chat": frozenset(EXTENSIONS)}


def check(body: BaseModel, rules: Mapping[str, FieldRule]) -> list[str]:
    """The ignored fields `body` sent (for `IGNORED_FIELDS_HEADER`), in the table's order; a 400 naming the first
    refused one. Only fields the request sent count (a default is the no-op)."""
    sent = _sent(body)
    found = []
    for name, rule in rules.items():
        if name not in sent:
            continue
        decision = rule.of(sent[name])
        if decision == REFUSED:
            raise BadInput(rule.note, param=name)
        if decision == IGNORED:
            found.append(name)
    return found


def _sent(body: BaseModel) -> dict[str, Any]:
    """The fields the request sent, with their values; those of a sent object field too, as "field.inner"."""
    sent = {}
    for name in body.model_fields_set:
        value = getattr(body, name)
        sent[name] = value
        if isinstance(value, BaseModel):  # by the names a request sends (an alias: `structured_outputs.json`)
            fields = type(value).model_fields
            sent.update((f"{name}{NESTED}{fields[inner].alias or inner}", getattr(value, inner))
                        for inner in value.model_fields_set)
    return sent
