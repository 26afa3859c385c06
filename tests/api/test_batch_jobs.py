"""Offline batch jobs (`python -m service.batch`, in-process through its `main`) against the HTTP API of an app on the
same tiny models: every output line is what the API answers for the same request (OpenAI completions and chat, native
translate, generate, score and classify, and their 4xx), lines that cannot be sent are error lines, a rerun skips what
the output holds, Ctrl-C leaves complete lines, stdin/stdout, and plain-text translation.

Both apps run with the prefix cache off: `cached_tokens` says what an app computed before, not what a request asks.
Where outputs are compared, the job sends one request at a time (`--max-in-flight 1`): each is alone in its batch, as
the lone HTTP request is (the tiny translator steps by concatenation, not batch-invariant in the last bits).
"""

from __future__ import annotations

import base64
import io
import json
import logging
import signal
import sys

import numpy as np
import pytest

from service.batch import requests_file
from service.batch.__main__ import EXIT_INTERRUPTED, EXIT_LINES_FAILED, main
from service.settings import Settings
from tests.support.images import png_bytes

pytestmark = pytest.mark.slow

IMAGE = png_bytes(np.arange(28 * 28, dtype=np.uint8).reshape(28, 28))
IMAGE_B64 = base64.b64encode(IMAGE).decode()
OPENAI_VOLATILE = ("id", "created")  # OpenAI's responses: a new id and clock time each
SENTENCES = ["Ein Mann fährt Fahrrad.", "Zwei Hunde spielen im Schnee.", "Eine Frau singt auf einer Bühne."]
REQUESTS = [  # (custom_id, url, body)
    ("completion", "/v1/completions", {"model": "gpt", "prompt": "ROMEO:\n", "max_tokens": 12, "temperature": 0}),
    ("completions-seeded", "/v1/completions", {"model": "gpt", "prompt": ["JULIET:\n", "NURSE:\n"], "max_tokens": 8,
                                               "temperature": 0.8, "seed": 3, "n": 2, "logprobs": 2}),
    ("chat", "/v1/chat/completions", {"model": "gpt", "messages": [{"role": "user", "content": "Who art thou?"}],
                                      "max_tokens": 10, "temperature": 0}),
    ("generate", "/v1/generate", {"prompt": "ROMEO:\n", "max_new_tokens": 10, "temperature": 0.7, "top_k": 20,
                                  "seed": 5}),
    ("translate-beams", "/v1/translate", {"text": SENTENCES[:2], "num_beams": 2, "num_return_sequences": 2}),
    ("translate-greedy", "/v1/translate", {"text": SENTENCES[2], "num_beams": 1}),
    ("score", "/v1/translate/score", {"source": SENTENCES[0], "target": ["A man rides a bike.", "A bike."]}),
    ("classify", "/v1/classify", {"images": [IMAGE_B64, IMAGE_B64], "top_k": 3}),
    ("too-many-tokens", "/v1/generate", {"prompt": "ROMEO:\n", "max_new_tokens": 100_000}),  # 422
    ("more-sequences-than-beams", "/v1/translate", {"text": SENTENCES[0], "num_beams": 2,
                                                    "num_return_sequences": 3}),  # 400
    ("unknown-model", "/v1/completions", {"model": "nope", "prompt": "x"}),  # 404
]


@pytest.fixture(scope="module")
def settings(tiny_repository):
    return Settings(repository=tiny_repository, max_text_chars=300, prefix_cache=False)


@pytest.fixture(scope="module")
def client(settings, serving):
    with serving(settings) as client:
        yield client


@pytest.fixture(autouse=True)
def _root_logging():
    """The job configures the root logger as `python -m service.batch` does; put the test session's back."""
    root = logging.getLogger()
    handlers, level = root.handlers[:], root.level
    yield
    root.handlers[:], root.level = handlers, level


def line(custom_id: str, url: str, body: dict) -> str:
    return json.dumps({"custom_id": custom_id, "method": "POST", "url": url, "body": body})


def write_requests(path, requests) -> None:
    path.write_text("".join(line(*request) + "\n" for request in requests))


def read_output(path) -> dict[str, dict]:
    records = [json.loads(text) for text in path.read_text().splitlines()]
    by_id = {record["custom_id"]: record for record in records}
    assert len(by_id) == len(records), "a custom_id answered twice"
    return by_id


def comparable(body):
    return {k: v for k, v in body.items() if k not in OPENAI_VOLATILE} if isinstance(body, dict) else body


def test_every_output_line_is_what_the_http_api_answers(client, settings, tmp_path):
    (tmp_path / "shoe.png").write_bytes(IMAGE)
    requests = [*REQUESTS, ("classify-files", "/v1/classify", {"files": ["shoe.png"], "top_k": 3})]
    write_requests(tmp_path / "in.jsonl", requests)
    assert main(["-i", str(tmp_path / "in.jsonl"), "-o", str(tmp_path / "out.jsonl"), "--max-in-flight", "1"],
                settings) == 0
    output = read_output(tmp_path / "out.jsonl")
    assert set(output) == {custom_id for custom_id, _, _ in requests}
    for custom_id, url, body in REQUESTS:
        http = client.post(url, json=body)
        response = output[custom_id]["response"]
        assert response["status_code"] == http.status_code, custom_id
        assert comparable(response["body"]) == comparable(http.json()), custom_id
        assert response["request_id"] and output[custom_id]["id"].startswith("batch_req_")
        assert (output[custom_id]["error"] is None) == (http.status_code == 200), custom_id
    # an image by path: what the JSON API answers for its base64, and what a multipart upload of the file answers
    by_path = output["classify-files"]["response"]["body"]
    assert by_path == client.post("/v1/classify", json={"images": [IMAGE_B64], "top_k": 3}).json()
    assert by_path == client.post("/v1/classify", files=[("files", ("shoe.png", IMAGE, "image/png"))],
                                  data={"top_k": "3"}).json()
    assert output["too-many-tokens"]["error"]["code"] == "invalid_request"


def test_lines_that_cannot_be_sent_are_error_lines_and_the_job_goes_on(settings, tmp_path):
    good = line("good", "/v1/generate", {"prompt": "ROMEO:\n", "max_new_tokens": 4, "temperature": 0})
    lines = ["{not json", json.dumps({"method": "POST", "url": "/v1/generate", "body": {}}), good, "",
             line("nowhere", "/v1/embeddings", {"input": "x"}),
             line("stream", "/v1/generate", {"prompt": "x", "stream": True}),
             line("no-file", "/v1/classify", {"files": ["missing.png"]}), line("good", "/v1/generate", {"prompt": "y"})]
    (tmp_path / "in.jsonl").write_text("\n".join(lines) + "\n")
    assert main(["-i", str(tmp_path / "in.jsonl"), "-o", str(tmp_path / "out.jsonl")], settings) == 0
    records = [json.loads(text) for text in (tmp_path / "out.jsonl").read_text().splitlines()]
    assert len(records) == len(lines) - 1  # the blank line is no request
    errors = {(r["custom_id"], r["error"]["code"]) for r in records if r["response"] is None}
    assert errors == {(None, "invalid_json"), (None, "invalid_request_line"), ("nowhere", "unknown_url"),
                      ("stream", "stream_not_supported"), ("no-file", "image_file_unreadable"),
                      ("good", "duplicate_custom_id")}
    (answered,) = [r for r in records if r["response"] is not None]
    assert answered["custom_id"] == "good" and answered["response"]["status_code"] == 200


def test_a_rerun_skips_what_the_output_answers_and_redoes_a_partial_last_line(settings, tmp_path):
    requests = [(f"g{i}", "/v1/generate", {"prompt": f"ROMEO:\n{i}", "max_new_tokens": 4, "temperature": 0})
                for i in range(6)]
    write_requests(tmp_path / "first.jsonl", requests[:2])
    out = tmp_path / "out.jsonl"
    assert main(["-i", str(tmp_path / "first.jsonl"), "-o", str(out)], settings) == 0
    earlier = out.read_text()
    with out.open("a") as file:  # a job killed while writing its third line
        file.write(line(*requests[2])[:20])
    write_requests(tmp_path / "all.jsonl", [*requests, ("bad", "/v1/nowhere", {})])
    assert main(["-i", str(tmp_path / "all.jsonl"), "-o", str(out)], settings) == 0
    assert out.read_text().startswith(earlier)
    assert set(read_output(out)) == {custom_id for custom_id, _, _ in requests} | {"bad"}
    assert main(["-i", str(tmp_path / "all.jsonl"), "-o", str(out)], settings) == 0  # nothing left to do
    assert len(out.read_text().splitlines()) == len(requests) + 1


def test_ctrl_c_leaves_complete_lines_and_a_rerun_completes_the_job(settings, tmp_path, monkeypatch):
    requests = [(f"g{i}", "/v1/generate", {"prompt": f"ROMEO:\n{i}", "max_new_tokens": 8, "temperature": 0})
                for i in range(24)]
    write_requests(tmp_path / "in.jsonl", requests)
    out = tmp_path / "out.jsonl"
    write_line = requests_file.write_line

    def then_ctrl_c(stream, text):  # SIGINT right after the first line is written, with more in flight
        write_line(stream, text)
        monkeypatch.setattr(requests_file, "write_line", write_line)
        signal.raise_signal(signal.SIGINT)

    monkeypatch.setattr(requests_file, "write_line", then_ctrl_c)
    args = ["-i", str(tmp_path / "in.jsonl"), "-o", str(out), "--max-in-flight", "2"]
    assert main(args, settings) == EXIT_INTERRUPTED
    written = read_output(out)  # every line complete JSON
    assert 1 <= len(written) <= 2  # the one being written, and at most the other request in flight
    assert main(args, settings) == 0
    assert set(read_output(out)) == {custom_id for custom_id, _, _ in requests}


def test_standard_input_and_output(settings, monkeypatch, capsys):
    requests = [(f"c{i}", "/v1/completions", {"model": "gpt", "prompt": "ROMEO:\n" * (i + 1), "max_tokens": 4})
                for i in range(5)]
    stdin = "".join(line(*request) + "\n" for request in requests).encode()
    monkeypatch.setattr(sys, "stdin", io.TextIOWrapper(io.BytesIO(stdin)))
    assert main(["-i", "-", "-o", "-"], settings) == 0
    captured = capsys.readouterr()
    records = [json.loads(text) for text in captured.out.splitlines()]
    assert sorted(r["custom_id"] for r in records) == [f"c{i}" for i in range(5)]
    assert all(r["response"]["status_code"] == 200 and r["error"] is None for r in records)
    assert "5 lines in" in captured.err and "0 errors" in captured.err


def test_plain_text_translation_is_what_the_api_translates_line_by_line(client, settings, tmp_path, capsys):
    too_long = "Ein Mann " * 40  # over the settings' 300 characters: the API's 422
    (tmp_path / "in.de").write_text("\n".join([SENTENCES[0], "", SENTENCES[1], too_long, SENTENCES[2]]) + "\n")
    out = tmp_path / "out.en"
    expected = [client.post("/v1/translate", json={"text": s, "num_beams": 2, "length_penalty": 0.6}).json()
                ["translations"][0][0]["text"] for s in SENTENCES]
    out.write_text(expected[0] + "\n")  # a first run's line: resumed after it
    args = ["--text", "-i", str(tmp_path / "in.de"), "-o", str(out), "-O", "num_beams=2", "-O",
            "length_penalty=0.6", "--max-in-flight", "1"]
    assert main(args, settings) == EXIT_LINES_FAILED
    assert out.read_text().splitlines() == [expected[0], "", expected[1], "", expected[2]]
    assert "line 4: not translated (invalid_request)" in capsys.readouterr().err


@pytest.mark.parametrize("option", ["num_beams=99", "stream=true", "num_return_sequences=2", "colour=blue"])
def test_plain_text_options_are_the_apis_and_are_checked_before_the_job(settings, tmp_path, option, capsys):
    (tmp_path / "in.de").write_text(SENTENCES[0] + "\n")
    args = ["--text", "-i", str(tmp_path / "in.de"), "-o", str(tmp_path / "out.en"), "-O", option]
    assert main(args, settings) == 2
    assert option.partition("=")[0] in capsys.readouterr().err and not (tmp_path / "out.en").exists()
