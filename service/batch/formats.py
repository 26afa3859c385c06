"""The batch files, after OpenAI's Batch API (and vLLM's `run-batch`, which reads and writes the same): input lines
`{"custom_id", "method", "url", "body"}` read into `Line`s, output lines `{"id", "custom_id", "response":
{"status_code", "request_id", "body"}, "error"}` written from what the app answered. An answer of any status is a
`response` (its body the API's JSON, as parsed); one of 400 or more also fills `error` with the API's code
and message. A line that never reached the app (not JSON, no custom_id, an unknown url, a stream, an image file that
cannot be read) has `response` null and `error` saying why. Each output line is known again by its `custom_id`, or,
for a line that had none, by its input line number in `id` (`batch_req_line_<n>`): what a resumed job skips.
"""

from __future__ import annotations

import base64
import json
import uuid
from dataclasses import dataclass
from pathlib import Path

from service.batch.asgi import Answer
from service.errors import json_error_reason
from service.http.middleware import REQUEST_ID_HEADER

METHOD = "POST"
CLASSIFY = "/v1/classify"
TRANSLATE = "/v1/translate"
ROUTES = ("/v1/completions", "/v1/chat/completions", "/v1/generate", TRANSLATE, "/v1/translate/score", CLASSIFY)
FIELDS = ("custom_id", "method", "url", "body")
IMAGE_FILES = "files"  # /v1/classify in a batch: image paths, sent as the JSON API's base64 `images`
ID_PREFIX = "batch_req_"
LINE_ID_PREFIX = ID_PREFIX + "line_"  # the id of an output line whose input line had no custom_id

# error codes of the lines that never reached the app
INVALID_JSON = "invalid_json"
INVALID_LINE = "invalid_request_line"
DUPLICATE_ID = "duplicate_custom_id"
UNKNOWN_URL = "unknown_url"
STREAM = "stream_not_supported"
IMAGE_FILE = "image_file_unreadable"


class LineProblem(Exception):
    """An input line that cannot be sent: `code` (one of the codes above) and the message of its error line."""

    def __init__(self, code: str, message: str):
        super().__init__(message)
        self.code, self.message = code, message


@dataclass(frozen=True)
class Line:
    """One request of the input: its line number (from 1), custom_id, url and body, or the problem that keeps it
    from being sent; `size` (its length in bytes) orders the work."""

    number: int
    custom_id: str | None = None
    url: str = ""
    body: dict | None = None
    problem: LineProblem | None = None
    size: int = 0

    @property
    def key(self) -> str:
        """What a resumed job knows it by: its custom_id, else its line number."""
        return self.custom_id if self.custom_id is not None else f"line {self.number}"


def parse_line(number: int, raw: bytes) -> Line:
    """An input line (without its newline) as a `Line`, its problem set where it cannot be sent."""
    try:
        data = json.loads(raw)  # bytes: json.loads decodes them (not UTF-8: its error)
    except (ValueError, RecursionError) as error:
        problem = LineProblem(INVALID_JSON, f"line {number} is not JSON: {json_error_reason(error)}")
        return Line(number, problem=problem, size=len(raw))
    custom_id = data.get("custom_id") if isinstance(data, dict) else None
    custom_id = custom_id if isinstance(custom_id, str) and custom_id else None
    try:
        _check(number, data, custom_id)
    except LineProblem as problem:
        return Line(number, custom_id, problem=problem, size=len(raw))
    return Line(number, custom_id, data["url"], data["body"], size=len(raw))


def _check(number: int, data, custom_id: str | None) -> None:
    """LineProblem unless `data` is a request line this job can send."""
    if not isinstance(data, dict):
        raise LineProblem(INVALID_LINE, f"line {number} is not a JSON object")
    if custom_id is None:
        raise LineProblem(INVALID_LINE, f"line {number}: custom_id must be a non-empty string")
    if unknown := sorted(set(data) - set(FIELDS)):
        raise LineProblem(INVALID_LINE, f"line {number}: unknown fields {unknown}; a line has {list(FIELDS)}")
    if data.get("method") != METHOD:
        raise LineProblem(INVALID_LINE, f"line {number}: method must be {METHOD!r}, got {data.get('method')!r}")
    if data.get("url") not in ROUTES:
        raise LineProblem(UNKNOWN_URL, f"line {number}: url {data.get('url')!r} is not one of {', '.join(ROUTES)}")
    if not isinstance(data.get("body"), dict):
        raise LineProblem(INVALID_LINE, f"line {number}: body must be a JSON object")
    if data["body"].get("stream") is True:
        raise LineProblem(STREAM, f"line {number}: stream=true: a batch answers each request whole; send it "
                                  "without stream (the streamed text concatenates to the same)")


def request_body(line: Line, base: Path) -> bytes:
    """The JSON body sent for `line`: its body as written, where a classify line's `files` (paths, relative to
    `base`) are read and sent as base64 `images`. LineProblem when a file cannot be read."""
    body = line.body
    if line.url == CLASSIFY and IMAGE_FILES in body:
        paths = body[IMAGE_FILES]
        if "images" in body or not isinstance(paths, list) or not all(isinstance(p, str) for p in paths):
            raise LineProblem(INVALID_LINE, f"line {line.number}: {IMAGE_FILES} must be a list of paths, given "
                                            "instead of images")
        images = []
        for path in paths:
            try:
                images.append(base64.b64encode((base / path).read_bytes()).decode("ascii"))
            except OSError as error:
                raise LineProblem(IMAGE_FILE, f"line {line.number}: cannot read {path!r}: "
                                              f"{error.strerror or error}") from None
        body = {**{k: v for k, v in body.items() if k != IMAGE_FILES}, "images": images}
    return json.dumps(body).encode()


def output_line(line: Line, answer: Answer | None = None, problem: LineProblem | None = None) -> dict:
    """The output line for `line`: the app's `answer`, or the `problem` that kept the line from being sent."""
    if answer is None:
        problem = problem or line.problem
        return {"id": _id(line), "custom_id": line.custom_id, "response": None,
                "error": {"code": problem.code, "message": problem.message}}
    try:
        body = answer.json()
    except ValueError:  # not JSON (the app answers JSON everywhere a batch reaches): kept as text
        body = answer.body.decode("utf-8", "replace")
    request_id = answer.headers.get(REQUEST_ID_HEADER.decode())
    response = {"status_code": answer.status, "request_id": request_id, "body": body}
    return {"id": _id(line), "custom_id": line.custom_id, "response": response, "error": _api_error(answer, body)}


def _id(line: Line) -> str:
    return ID_PREFIX + uuid.uuid4().hex if line.custom_id is not None else f"{LINE_ID_PREFIX}{line.number}"


def _api_error(answer: Answer, body) -> dict | None:
    """OpenAI's `error` for an answer of 400 or more: the code and message of the API's error body (the native
    API's `type`, OpenAI's `code` or `type`)."""
    if answer.status < 400:
        return None
    error = body.get("error") if isinstance(body, dict) else None
    if not isinstance(error, dict):
        return {"code": str(answer.status), "message": str(body)}
    return {"code": error.get("code") or error.get("type") or str(answer.status), "message": error.get("message")}


def done_key(record: dict) -> str | None:
    """The key (`Line.key`) of the input line an output line answered, None if it names none."""
    custom_id, line_id = record.get("custom_id"), record.get("id")
    if isinstance(custom_id, str):
        return custom_id
    if isinstance(line_id, str) and line_id.startswith(LINE_ID_PREFIX) and line_id[len(LINE_ID_PREFIX):].isdigit():
        return f"line {int(line_id[len(LINE_ID_PREFIX):])}"
    return None


def split_lines(data: bytes) -> list[bytes]:
    """A file's lines without their line ends (`\\n` or `\\r\\n`); a last line without one counts."""
    lines = data.split(b"\n")
    if lines and not lines[-1]:
        lines.pop()
    return [line.removesuffix(b"\r") for line in lines]
