"""service.client.sse, the clients' parser of the service's server-sent events: strict on a whole body, incremental on
lines or chunks split anywhere."""

from __future__ import annotations

import json

import pytest

from service.client.sse import SSEError, SSEParser, event, parse_sse

EVENTS = [{"token": "é", "index": 0}, {"token": " ü", "index": 1, "finish_reason": "length"}]
BODY = "".join(f"data: {json.dumps(e, ensure_ascii=False)}\n\n" for e in EVENTS) + "data: [DONE]\n\n"


def test_parse_a_whole_body():
    assert parse_sse(BODY) == EVENTS
    assert parse_sse(BODY.encode()) == EVENTS
    assert parse_sse("data: [DONE]\n\n") == []


@pytest.mark.parametrize("body", [
    BODY[:-1],  # no blank line at the end
    BODY.replace("data: [DONE]\n\n", ""),  # no [DONE]
    BODY + 'data: {"late": 1}\n\n',  # data after [DONE]
    'event: x\ndata: {"a": 1}\n\ndata: [DONE]\n\n',  # another field
    "data: [1, 2]\n\ndata: [DONE]\n\n",  # not an object
    "data: {\n\ndata: [DONE]\n\n",  # not JSON
], ids=["no-blank-line", "no-done", "after-done", "other-field", "not-object", "not-json"])
def test_a_body_out_of_the_framing_is_an_error(body):
    with pytest.raises(SSEError):
        parse_sse(body)


@pytest.mark.parametrize("size", [1, 2, 3, 7, len(BODY.encode())])
def test_incremental_chunks_split_anywhere(size):
    raw = BODY.encode()  # bytes: the chunks split the two-byte characters too
    parser, events = SSEParser(), []
    for i in range(0, len(raw), size):
        events += parser.feed(raw[i:i + size])
    assert events == EVENTS and parser.done


def test_incremental_lines():
    parser = SSEParser()
    lines = [": a comment", *BODY.splitlines()]
    events = [e for e in map(parser.feed_line, lines) if e is not None]
    assert events == EVENTS and parser.done
    with pytest.raises(SSEError):
        parser.feed_line('data: {"late": 1}')
    with pytest.raises(SSEError):
        SSEParser().feed_line(b"data: 5\r\n")


@pytest.mark.parametrize("payload, expected", [
    ({"text": "\ud800"}, b'data: {"text": "\\ud800"}\n\n'),  # a lone surrogate echoed in an error: its escape
    ({"text": "é"}, 'data: {"text": "é"}\n\n'.encode()),
    ("[DONE]", b"data: [DONE]\n\n"),
])
def test_an_event_always_encodes(payload, expected):
    assert event(payload) == expected


@pytest.mark.parametrize("number", [float("nan"), float("inf"), float("-inf")])
def test_an_event_never_carries_a_non_finite_number(number):
    with pytest.raises(ValueError):
        event({"logprob": number})
