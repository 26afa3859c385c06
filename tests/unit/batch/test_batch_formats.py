"""The batch files' pure parts (service.batch.formats, .outputs, .job): reading request lines, the output line of an
answer or a problem, the keys a resumed job skips, a partial last line cut off, and the order lines are sent in."""

from __future__ import annotations

import base64
import json

import pytest

from service.batch import formats
from service.batch.asgi import Answer
from service.batch.formats import Line, LineProblem, done_key, output_line, parse_line, request_body
from service.batch.job import bucketed
from service.batch.outputs import OutputProblem, done_keys, resumed_lines


def request(**fields) -> bytes:
    line = {"custom_id": "a", "method": "POST", "url": "/v1/generate", "body": {"prompt": "x"}}
    return json.dumps({**line, **fields}).encode()


@pytest.mark.parametrize("raw, code, custom_id", [
    (b"not json", formats.INVALID_JSON, None),
    (b"\xff\xfe{", formats.INVALID_JSON, None),
    (b"[1, 2]", formats.INVALID_LINE, None),
    (request(custom_id=""), formats.INVALID_LINE, None),
    (request(custom_id=7), formats.INVALID_LINE, None),
    (request(method="GET"), formats.INVALID_LINE, "a"),
    (request(extra=1), formats.INVALID_LINE, "a"),
    (request(url="/v1/embeddings"), formats.UNKNOWN_URL, "a"),
    (request(url="/v2/models/gpt/infer"), formats.UNKNOWN_URL, "a"),
    (request(body=["x"]), formats.INVALID_LINE, "a"),
    (request(body={"prompt": "x", "stream": True}), formats.STREAM, "a"),
])
def test_a_line_that_cannot_be_sent_keeps_its_custom_id_and_says_why(raw, code, custom_id):
    line = parse_line(3, raw)
    assert line.problem.code == code and "line 3" in line.problem.message
    assert line.custom_id == custom_id
    assert line.key == (custom_id if custom_id is not None else "line 3")


def test_a_request_line_is_read_whole():
    line = parse_line(1, request(body={"prompt": "x", "stream": False}))
    assert (line.problem, line.custom_id, line.url, line.body) == (None, "a", "/v1/generate",
                                                                   {"prompt": "x", "stream": False})
    assert line.size == len(request(body={"prompt": "x", "stream": False}))


def test_a_classify_lines_files_are_sent_as_base64_images(tmp_path):
    (tmp_path / "a.png").write_bytes(b"\x89PNG-a")
    line = Line(1, "c", formats.CLASSIFY, {"files": ["a.png"], "top_k": 2})
    assert json.loads(request_body(line, tmp_path)) == {"top_k": 2, "images": [base64.b64encode(b"\x89PNG-a").decode()]}
    with pytest.raises(LineProblem) as missing:
        request_body(Line(1, "c", formats.CLASSIFY, {"files": ["b.png"]}), tmp_path)
    assert missing.value.code == formats.IMAGE_FILE and "b.png" in missing.value.message
    with pytest.raises(LineProblem) as both:
        request_body(Line(1, "c", formats.CLASSIFY, {"files": ["a.png"], "images": ["AAAA"]}), tmp_path)
    assert both.value.code == formats.INVALID_LINE
    other = Line(1, "c", "/v1/generate", {"files": ["a.png"]})  # only classify reads files
    assert json.loads(request_body(other, tmp_path)) == {"files": ["a.png"]}


def test_an_answer_is_a_response_and_an_error_answer_fills_error_too():
    line = Line(1, "a", "/v1/generate", {})
    ok = output_line(line, Answer(200, {"x-request-id": "r1"}, b'{"text": "hi"}'))
    assert ok["id"].startswith(formats.ID_PREFIX) and ok["custom_id"] == "a" and ok["error"] is None
    assert ok["response"] == {"status_code": 200, "request_id": "r1", "body": {"text": "hi"}}
    native = output_line(line, Answer(422, {}, b'{"error": {"type": "invalid_request", "message": "m"}}'))
    assert native["response"]["status_code"] == 422
    assert native["error"] == {"code": "invalid_request", "message": "m"}
    openai = output_line(line, Answer(400, {}, b'{"error": {"message": "m", "type": "t", "param": "p", "code": "c"}}'))
    assert openai["error"] == {"code": "c", "message": "m"}


def test_a_line_never_sent_is_an_error_line_known_by_its_custom_id_or_line_number():
    sent_none = output_line(parse_line(4, b"{"))
    assert sent_none == {"id": formats.LINE_ID_PREFIX + "4", "custom_id": None, "response": None,
                         "error": {"code": formats.INVALID_JSON, "message": sent_none["error"]["message"]}}
    assert done_key(sent_none) == "line 4" == parse_line(4, b"{").key
    stream = output_line(parse_line(2, request(body={"stream": True})))
    assert done_key(stream) == "a" and stream["error"]["code"] == formats.STREAM


def test_resuming_reads_the_done_keys_and_cuts_a_partial_last_line(tmp_path):
    out = tmp_path / "out.jsonl"
    first = json.dumps(output_line(parse_line(1, request(custom_id="x"), ), Answer(200, {}, b"{}")))
    second = json.dumps(output_line(parse_line(2, b"oops")))
    out.write_bytes(f"{first}\n{second}\n".encode() + b'{"id": "batch_req_')
    lines = resumed_lines(str(out), overwrite=False)
    assert out.read_text() == f"{first}\n{second}\n"
    assert done_keys(str(out), lines) == {"x", "line 2"}
    assert resumed_lines(str(out), overwrite=True) == [] and resumed_lines(str(tmp_path / "new"), False) == []
    with pytest.raises(OutputProblem, match="line 1"):
        done_keys(str(out), [b"some text"])


def test_lines_are_sent_longest_first_within_each_chunk():
    lines = [Line(n, size=size) for n, size in enumerate([1, 5, 3, 9, 2, 2], 1)]
    assert [line.number for line in bucketed(lines, chunk=3)] == [2, 3, 1, 4, 5, 6]
    assert [line.number for line in bucketed(lines, chunk=100)] == [4, 2, 3, 5, 6, 1]
