"""The OpenAI request fields the tests send for each rule of `service.api.openai.field_rules`, as (endpoint kind,
field, value): ignored ones (accepted, named in X-Ignored-Fields), refused ones (a 400 naming the field), and values
of refusable fields that ask for nothing unsupported (honoured as no-ops). The server tests send them through the
SDK (tests/api/test_openai_fields.py), the unit tests to the request models (tests/unit/api/test_to_params.py)."""

IGNORED = [
    ("completion", "user", "user-1"),
    ("chat", "user", "user-1"),
    ("chat", "metadata", {"run": "7", "team": "eval"}),
    ("chat", "store", True),
    ("chat", "service_tier", "flex"),
    ("chat", "prompt_cache_key", "shakespeare"),
    ("chat", "prompt_cache_retention", "24h"),
    ("chat", "prompt_cache_options", {"mode": "implicit", "ttl": "30m"}),
    ("chat", "safety_identifier", "hash-of-user"),
    ("chat", "parallel_tool_calls", False),
    ("chat", "prediction", {"type": "content", "content": "Good morrow to you."}),
    ("chat", "reasoning_effort", "high"),
    ("chat", "verbosity", "low"),
    ("chat", "modalities", ["text"]),
    ("chat", "audio", None),
    ("chat", "guided_decoding_backend", "xgrammar"),
    ("completion", "guided_whitespace_pattern", "[ ]*"),
]

REFUSED = [
    ("completion", "logit_bias", {"50": 10}),
    ("completion", "suffix", "THE END"),
    ("chat", "logit_bias", {"50": -100}),
    ("chat", "tools", [{"type": "function", "function": {"name": "lookup"}}]),
    ("chat", "tool_choice", "required"),
    ("chat", "tool_choice", {"type": "function", "function": {"name": "lookup"}}),
    ("chat", "functions", [{"name": "lookup"}]),
    ("chat", "function_call", {"name": "lookup"}),
    ("chat", "audio", {"voice": "alloy", "format": "wav"}),
    ("chat", "modalities", ["text", "audio"]),
    ("chat", "web_search_options", {}),
    ("chat", "moderation", {"model": "omni-moderation-latest"}),
]

NO_OP = [
    ("completion", "logit_bias", {}),
    ("completion", "suffix", None),
    ("chat", "tools", []),
    ("chat", "tool_choice", "none"),
    ("chat", "tool_choice", "auto"),
    ("chat", "function_call", "none"),
    ("chat", "response_format", {"type": "text"}),
    ("completion", "response_format", {"type": "text"}),
    ("chat", "web_search_options", None),
]
