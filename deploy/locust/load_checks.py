"""The checks a response must pass to count as a success: OpenAI's objects and chunks (one choice, `finish_reason`
"stop" or "length", consistent usage within the request's bounds, a chat answer that stops at the end of its turn,
the usage chunk last in a stream), and which stream events carry a token (for the time to first token). Each check
raises `Unexpected` (a failure in locust's statistics) or returns the generated tokens. Standard library only."""

from __future__ import annotations

import json

from load_settings import END_OF_TURN, GPT_MODEL

EXCERPT = 300  # characters of a response body or error quoted in a failure's message
CLASSES = 10  # Fashion-MNIST's classes: the width of the served ViT's PROBABILITIES


def error_text(response) -> str:
    """The error object of a failed response (or its text), shortened for locust's failure statistics."""
    try:
        return json.dumps(response.json().get("error", response.json()))[:EXCERPT]
    except Exception:
        return (response.text or "")[:EXCERPT]


class Unexpected(Exception):
    """A response without the shape, counts or order it must have."""


def expect(condition, what: str) -> None:
    if not condition:
        raise Unexpected(what)


def is_int(value, low: int, high: int | None = None) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and low <= value and (high is None or value <= high)


def check_usage(usage, max_prompt_tokens: int, max_tokens: int) -> int:
    """OpenAI's usage object: consistent counts within the request's bounds. Returns the completion tokens."""
    expect(isinstance(usage, dict), f"usage {usage!r}")
    prompt, completion, total = (usage.get(k) for k in ("prompt_tokens", "completion_tokens", "total_tokens"))
    expect(is_int(prompt, 1, max_prompt_tokens), f"usage.prompt_tokens {prompt!r} not in [1, {max_prompt_tokens}]")
    expect(is_int(completion, 0, max_tokens), f"usage.completion_tokens {completion!r} not in [0, {max_tokens}]")
    expect(total == prompt + completion, f"usage.total_tokens {total!r} != {prompt} + {completion}")
    return completion


def check_finish(finish_reason, tokens: int, max_tokens: int) -> None:
    expect(finish_reason in ("stop", "length"), f"finish_reason {finish_reason!r}")
    expect(finish_reason != "length" or tokens == max_tokens,
           f"finish_reason length after {tokens} of {max_tokens} tokens")


def check_header(event: dict, obj: str, id_prefix: str) -> None:
    """The fields every OpenAI response and chunk has."""
    expect(event.get("object") == obj, f"object {event.get('object')!r}, not {obj}")
    expect(isinstance(event.get("id"), str) and event["id"].startswith(id_prefix), f"id {event.get('id')!r}")
    expect(event.get("model") == GPT_MODEL, f"model {event.get('model')!r}, not {GPT_MODEL}")
    expect(is_int(event.get("created"), 1), f"created {event.get('created')!r}")


def completion_chunk_is_token(event: dict) -> bool:
    return bool(event.get("choices"))  # not the usage chunk


def chat_chunk_is_token(event: dict) -> bool:
    # not the first chunk (the role, sent before any token) nor the usage chunk
    return any((c.get("delta") or {}).get("content") or c.get("finish_reason") for c in event.get("choices") or [])


def check_completion(body: dict, max_prompt_tokens: int, max_tokens: int) -> int:
    """A text completion: one choice with text, no log-probabilities unasked, consistent usage."""
    check_header(body, "text_completion", "cmpl-")
    choices = body.get("choices")
    expect(isinstance(choices, list) and len(choices) == 1, "not one choice")
    choice = choices[0]
    expect(choice.get("index") == 0 and isinstance(choice.get("text"), str), "choice index or text")
    expect(choice.get("logprobs") is None, "logprobs without asking")
    tokens = check_usage(body.get("usage"), max_prompt_tokens, max_tokens)
    check_finish(choice.get("finish_reason"), tokens, max_tokens)
    return tokens


def check_completion_stream(events: list[dict], max_prompt_tokens: int, max_tokens: int) -> int:
    """Text chunks (one choice, `usage: null`), the last of them with finish_reason, then the usage chunk."""
    expect(len(events) >= 2, f"{len(events)} chunks: a text chunk and the usage chunk at least")
    *chunks, last = events
    for event in events:
        check_header(event, "text_completion", "cmpl-")
        expect(event["id"] == events[0]["id"], "chunks of different ids")
    finish = None
    for event in chunks:
        expect(finish is None, "a chunk after the one with finish_reason")
        expect("usage" in event and event["usage"] is None, "a text chunk without usage: null")
        choices = event.get("choices")
        expect(isinstance(choices, list) and len(choices) == 1, "a text chunk without one choice")
        choice = choices[0]
        expect(choice.get("index") == 0 and isinstance(choice.get("text"), str), "choice index or text")
        finish = choice.get("finish_reason")
    expect(last.get("choices") == [], "the last chunk is not the usage chunk (choices [])")
    tokens = check_usage(last.get("usage"), max_prompt_tokens, max_tokens)
    check_finish(finish, tokens, max_tokens)
    return tokens


def check_chat(response: dict, max_prompt_tokens: int, max_tokens: int) -> int:
    """A chat completion: one assistant message that stops at the end of its turn, consistent usage."""
    check_header(response, "chat.completion", "chatcmpl-")
    choices = response.get("choices")
    expect(isinstance(choices, list) and len(choices) == 1, "not one choice")
    choice = choices[0]
    message = choice.get("message")
    expect(choice.get("index") == 0 and isinstance(message, dict) and message.get("role") == "assistant"
           and isinstance(message.get("content"), str), "choice index or message")
    expect(END_OF_TURN not in message["content"], "the answer goes past the end of its turn (a blank line)")
    expect(choice.get("logprobs") is None, "logprobs without asking")
    tokens = check_usage(response.get("usage"), max_prompt_tokens, max_tokens)
    check_finish(choice.get("finish_reason"), tokens, max_tokens)
    return tokens


def check_chat_stream(events: list[dict], max_prompt_tokens: int, max_tokens: int) -> int:
    """The role chunk, content chunks, the last of them with finish_reason, then the usage chunk."""
    expect(len(events) >= 3, f"{len(events)} chunks: role, finish and usage chunks at least")
    first, *chunks, last = events
    for event in events:
        check_header(event, "chat.completion.chunk", "chatcmpl-")
        expect(event["id"] == events[0]["id"], "chunks of different ids")
    role = {"index": 0, "delta": {"role": "assistant", "content": ""}, "logprobs": None, "finish_reason": None}
    expect(first.get("choices") == [role] and "usage" in first and first["usage"] is None,
           "the first chunk is not the assistant's role (with usage: null)")
    content, finish = "", None
    for event in chunks:
        expect(finish is None, "a chunk after the one with finish_reason")
        expect("usage" in event and event["usage"] is None, "a content chunk without usage: null")
        choices = event.get("choices")
        expect(isinstance(choices, list) and len(choices) == 1, "a content chunk without one choice")
        choice = choices[0]
        delta = choice.get("delta")
        expect(choice.get("index") == 0 and isinstance(delta, dict) and set(delta) <= {"content"}
               and isinstance(delta.get("content", ""), str), "choice index or delta")
        content += delta.get("content", "")
        finish = choice.get("finish_reason")
    expect(END_OF_TURN not in content, "the answer goes past the end of its turn (a blank line)")
    expect(last.get("choices") == [], "the last chunk is not the usage chunk (choices [])")
    tokens = check_usage(last.get("usage"), max_prompt_tokens, max_tokens)
    check_finish(finish, tokens, max_tokens)
    return tokens


def check_oip_translation(outputs: dict) -> int:
    """The Open Inference Protocol's translation outputs (by name): one TRANSLATION string, an FP32 SCORE. Returns
    the sentences translated (1)."""
    expect(outputs["TRANSLATION"]["shape"] == [1] and isinstance(outputs["TRANSLATION"]["data"][0], str),
           "TRANSLATION")
    expect(outputs["SCORE"]["datatype"] == "FP32", "SCORE")
    return 1


def check_oip_generation(outputs: dict) -> int:
    """The Open Inference Protocol's generation outputs: a TEXT string and a FINISH_REASON. Returns the generated
    tokens: the text's bytes (the GPT is byte-level, a token a byte)."""
    text = outputs["TEXT"]["data"][0]
    expect(isinstance(text, str) and outputs["FINISH_REASON"]["data"][0] in ("eos", "length", "stop"),
           "TEXT / FINISH_REASON")
    return len(text.encode())


def check_oip_classification(outputs: dict, images: int) -> int:
    """The Open Inference Protocol's classification outputs for `images` images: PROBABILITIES (images, classes)
    and a LABEL each. Returns the images classified."""
    expect(outputs["PROBABILITIES"]["shape"] == [images, CLASSES], "PROBABILITIES shape")
    expect(len(outputs["LABEL"]["data"]) == images, "LABEL")
    return images
