"""Load test of the tserve HTTP API with real inputs: Multi30k validation sentences (German) for /v1/translate,
slices of tinyshakespeare's validation text for /v1/generate and the OpenAI-compatible /v1/completions and
/v1/chat/completions (one user message), Fashion-MNIST test images as PNG files for /v1/classify.

    make loadtest USERS=8 SPAWN_RATE=4 DURATION=60s HOST=127.0.0.1 PORT=8000
    locust -f deploy/locust/locustfile.py --host http://127.0.0.1:8000          # web UI on :8089

Each simulated user runs a closed loop: request, wait `TSERVE_LOAD_THINK_S` on average, next request, chosen by
weight among the tasks below. Every response is checked (status, shape, counts; a stream must end with `[DONE]`
and carry no error event): anything else is a failure in locust's statistics. The OpenAI tasks are plain HTTP, checked
as OpenAI's objects and chunks: one choice, `finish_reason` "stop" or "length" ("length" only at max_tokens), usage
consistent (prompt tokens at most the prompt's bytes, plus 17 for the chat template; completion tokens at most
max_tokens; total = prompt + completion), a chat answer without a blank line (the end of its turn), and a stream with
`stream_options.include_usage`: a usage chunk last, then `[DONE]`. A chat request is one user message (a prompt slice);
the chat template (a `ROMEO:` line before it, a blank line and a `JULIET:` line after it) adds 17 tokens, so its
max_completion_tokens is 17 fewer than max_new_tokens (at least 1): it fits wherever a generate request does.

Request names in the statistics: `translate greedy`, `translate beam`, `generate`, `generate stream`, `classify`,
`openai completion`, `openai completion stream`, `openai chat`, `openai chat stream` (the OpenAI-compatible API),
`oip translate`, `oip generate`, `oip classify` (the Open Inference Protocol, JSON tensors).
A streamed request's response time is the whole stream (to `[DONE]`), not the time to the response headers.
Client-side extras locust does not keep (time to first token of streams, generated tokens, images, sentences),
and locust's final totals (its CSV files are written every second and may miss the last one), are written to
`<csv prefix>_extra.json` when locust runs with `--csv`; `deploy/loadtest.py` reads them.

Settings (environment):
  TSERVE_DATA_DIR              data folder (default ../shared/data, then ./data, as the project's loaders)
  TSERVE_LOAD_WEIGHTS          task weights, default "translate_greedy=3,translate_beam=2,generate=2,
                               generate_stream=2,classify=3,openai_completion=1,openai_completion_stream=1,
                               openai_chat=1,openai_chat_stream=1,oip_translate=1,oip_generate=1,
                               oip_classify=1" (a name left out: weight 0)
  TSERVE_LOAD_THINK_S          mean wait between a user's requests, seconds (default 0.1; 0 = back to back)
  TSERVE_LOAD_NUM_BEAMS        beam width of `translate beam` (default 4)
  TSERVE_LOAD_PROMPT_CHARS     GPT prompt length in characters = tokens, byte-level (default 16)
  TSERVE_LOAD_MAX_NEW_TOKENS   GPT max_new_tokens, and max_tokens of the OpenAI completions (default 32; chat:
                               17 fewer, see above). Prompt + new tokens must fit the model's context: 64 tokens
                               for the tiny preset, 256 for release
  TSERVE_LOAD_MAX_IMAGES       images per classify request, uniformly 1..N (default 4)
  TSERVE_LOAD_TIMEOUT_MS       timeout_ms sent with every native request (default: none, the server's default; the
                               OpenAI routes have no such field and always get the server's default)
  TSERVE_LOAD_GPT_MODEL        `model` of the OpenAI requests (default gpt)
  TSERVE_LOAD_API_KEY          sent as `Authorization: Bearer <key>` on every request when set (for a service
                               with TSERVE_API_KEYS / TSERVE_API_KEYS_FILE)
  TSERVE_LOAD_SEED             seed of the input choices (default 0)
"""

from __future__ import annotations

import base64
import io
import json
import os
import random
import sys
import threading
import time
from pathlib import Path

from locust import HttpUser, between, events, task

try:
    from models.data import load_fashion_mnist, load_multi30k, load_shakespeare
    from service.client.sse import SSEError, SSEParser
except ImportError:  # run from a checkout without the project installed
    sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
    from models.data import load_fashion_mnist, load_multi30k, load_shakespeare
    from service.client.sse import SSEError, SSEParser

DEFAULT_WEIGHTS = ("translate_greedy=3,translate_beam=2,generate=2,generate_stream=2,classify=3,"
                   "openai_completion=1,openai_completion_stream=1,openai_chat=1,openai_chat_stream=1,"
                   "oip_translate=1,oip_generate=1,oip_classify=1")
OPENAI_TASKS = ("openai_completion", "openai_completion_stream", "openai_chat", "openai_chat_stream")
OIP_TASKS = ("oip_translate", "oip_generate", "oip_classify")  # the Open Inference Protocol (KServe v2), JSON
TASKS = ("translate_greedy", "translate_beam", "generate", "generate_stream", "classify", *OPENAI_TASKS, *OIP_TASKS)
# service.api.openai.chat_template: "ROMEO:\n" before the user's text, "\n\nJULIET:\n" after it (byte-level: 1 token a byte);
# it may strip the text and merge blank lines in it, never add to it
CHAT_TEMPLATE_TOKENS = len("ROMEO:\n" + "\n\nJULIET:\n")
END_OF_TURN = "\n\n"  # a chat answer ends at the first blank line, which is not part of it


def _env_int(name: str, default: int, minimum: int = 0) -> int:
    value = int(os.environ.get(name, default))
    if value < minimum:
        raise ValueError(f"{name}={value}: must be >= {minimum}")
    return value


def _weights(text: str) -> dict[str, int]:
    weights = dict.fromkeys(TASKS, 0)
    for item in filter(None, (part.strip() for part in text.split(","))):
        name, _, value = item.partition("=")
        if name not in weights or not value.strip().isdigit():
            raise ValueError(f"TSERVE_LOAD_WEIGHTS: bad item {item!r}; expected NAME=INT with NAME in {TASKS}")
        weights[name] = int(value)
    if not any(weights.values()):
        raise ValueError("TSERVE_LOAD_WEIGHTS: every weight is 0")
    return weights


DATA_DIR = os.environ.get("TSERVE_DATA_DIR") or None  # None: the loaders' defaults (../shared/data, ./data)
WEIGHTS = _weights(os.environ.get("TSERVE_LOAD_WEIGHTS") or DEFAULT_WEIGHTS)  # unset or empty: the default
THINK_S = float(os.environ.get("TSERVE_LOAD_THINK_S", "0.1"))
NUM_BEAMS = _env_int("TSERVE_LOAD_NUM_BEAMS", 4, minimum=2)
PROMPT_CHARS = _env_int("TSERVE_LOAD_PROMPT_CHARS", 16, minimum=1)
MAX_NEW_TOKENS = _env_int("TSERVE_LOAD_MAX_NEW_TOKENS", 32, minimum=1)
CHAT_MAX_TOKENS = max(1, MAX_NEW_TOKENS - CHAT_TEMPLATE_TOKENS)  # the chat prompt + answer fit as generate's do
MAX_IMAGES = _env_int("TSERVE_LOAD_MAX_IMAGES", 4, minimum=1)
TIMEOUT_MS = _env_int("TSERVE_LOAD_TIMEOUT_MS", 0)
SEED = _env_int("TSERVE_LOAD_SEED", 0)
GPT_MODEL = os.environ.get("TSERVE_LOAD_GPT_MODEL", "gpt")
API_KEY = os.environ.get("TSERVE_LOAD_API_KEY", "").strip() or None
N_INPUTS = 500  # distinct sentences / prompts / images kept in memory


def _load_inputs():
    rng = random.Random(SEED)
    pairs = load_multi30k(DATA_DIR, "val")
    sentences = [de for de, _ in rng.sample(pairs, min(N_INPUTS, len(pairs))) if de]
    _, val_text = load_shakespeare(DATA_DIR)
    prompts = []
    while len(prompts) < N_INPUTS:
        start = rng.randrange(0, len(val_text) - PROMPT_CHARS)
        prompt = val_text[start : start + PROMPT_CHARS]
        if prompt.strip():
            prompts.append(prompt)
    from PIL import Image

    images, labels = load_fashion_mnist(DATA_DIR, "test")
    pngs = []
    for index in rng.sample(range(len(images)), min(N_INPUTS, len(images))):
        buffer = io.BytesIO()
        Image.fromarray(images[index]).save(buffer, format="PNG")
        pngs.append((f"fashion-mnist-test-{index}.png", buffer.getvalue(), int(labels[index])))
    return sentences, prompts, pngs


SENTENCES, PROMPTS, PNGS = _load_inputs()


class _Extra:
    """Client-side measurements locust's statistics do not keep, written next to its CSV files at the end."""

    def __init__(self):
        self.lock = threading.Lock()
        self.ttft_ms: list[float] = []
        self.tokens = {"generate": 0, "generate stream": 0, "openai completion": 0, "openai completion stream": 0,
                       "openai chat": 0, "openai chat stream": 0, "oip generate": 0}
        self.images = 0
        self.sentences = {"translate greedy": 0, "translate beam": 0, "oip translate": 0}

    def as_dict(self) -> dict:
        with self.lock:
            return {"ttft_ms": list(self.ttft_ms), "generated_tokens": dict(self.tokens), "images": self.images,
                    "sentences": dict(self.sentences),
                    "settings": {"weights": WEIGHTS, "think_s": THINK_S, "num_beams": NUM_BEAMS,
                                 "prompt_chars": PROMPT_CHARS, "max_new_tokens": MAX_NEW_TOKENS,
                                 "chat_max_tokens": CHAT_MAX_TOKENS,
                                 "max_images": MAX_IMAGES, "timeout_ms": TIMEOUT_MS or None, "seed": SEED,
                                 "gpt_model": GPT_MODEL, "api_key": API_KEY is not None}}


EXTRA = _Extra()


@events.test_start.add_listener
def _reset_extra(environment, **_):
    global EXTRA
    EXTRA = _Extra()


def _final_stats(environment) -> dict:
    """locust's totals at the end of the run: its CSV files are written every second and can miss the last one."""

    def entry(stats) -> dict:
        return {"requests": stats.num_requests, "failures": stats.num_failures, "requests_per_s": stats.total_rps,
                "mean_ms": stats.avg_response_time,
                **{f"p{q}_ms": stats.get_response_time_percentile(q / 100) if stats.num_requests else None
                   for q in (50, 95, 99)}}

    total = environment.stats.total
    return {"total": entry(total), "endpoints": {name: entry(s) for (name, _), s in environment.stats.entries.items()},
            "seconds": max(0.0, (total.last_request_timestamp or total.start_time) - total.start_time)}


@events.quitting.add_listener
def _write_extra(environment, **_):
    prefix = getattr(environment.parsed_options, "csv_prefix", None) if environment.parsed_options else None
    if prefix:
        Path(f"{prefix}_extra.json").write_text(json.dumps({**EXTRA.as_dict(), "final": _final_stats(environment)}))


def _error_text(response) -> str:
    try:
        return json.dumps(response.json().get("error", response.json()))[:300]
    except Exception:
        return (response.text or "")[:300]


class _Unexpected(Exception):
    """A response without the shape, counts or order it must have."""


def _expect(condition, what: str) -> None:
    if not condition:
        raise _Unexpected(what)


def _is_int(value, low: int, high: int | None = None) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and low <= value and (high is None or value <= high)


def _check_usage(usage, max_prompt_tokens: int, max_tokens: int) -> int:
    """OpenAI's usage object: consistent counts within the request's bounds. Returns the completion tokens."""
    _expect(isinstance(usage, dict), f"usage {usage!r}")
    prompt, completion, total = (usage.get(k) for k in ("prompt_tokens", "completion_tokens", "total_tokens"))
    _expect(_is_int(prompt, 1, max_prompt_tokens), f"usage.prompt_tokens {prompt!r} not in [1, {max_prompt_tokens}]")
    _expect(_is_int(completion, 0, max_tokens), f"usage.completion_tokens {completion!r} not in [0, {max_tokens}]")
    _expect(total == prompt + completion, f"usage.total_tokens {total!r} != {prompt} + {completion}")
    return completion


def _check_finish(finish_reason, tokens: int, max_tokens: int) -> None:
    _expect(finish_reason in ("stop", "length"), f"finish_reason {finish_reason!r}")
    _expect(finish_reason != "length" or tokens == max_tokens,
            f"finish_reason length after {tokens} of {max_tokens} tokens")


def _check_header(event: dict, obj: str, id_prefix: str) -> None:
    """The fields every OpenAI response and chunk has."""
    _expect(event.get("object") == obj, f"object {event.get('object')!r}, not {obj}")
    _expect(isinstance(event.get("id"), str) and event["id"].startswith(id_prefix), f"id {event.get('id')!r}")
    _expect(event.get("model") == GPT_MODEL, f"model {event.get('model')!r}, not {GPT_MODEL}")
    _expect(_is_int(event.get("created"), 1), f"created {event.get('created')!r}")


class _Stream:
    """What a server-sent event stream delivered: its JSON events up to `[DONE]`, or the problem that ended it."""

    def __init__(self):
        self.events: list[dict] = []
        self.done = False
        self.problem: str | None = None
        self.first_token_ms: float | None = None


def _read_stream(response, started: float, is_token) -> _Stream:
    """Reads `data: ...` lines to `[DONE]`; an error event, a broken connection or a missing `[DONE]` is a problem.
    Sets the request's response time to the whole stream; the time to first token is at the first event for which
    `is_token(event)` holds."""
    stream, length, sse = _Stream(), 0, SSEParser()
    try:
        for line in response.iter_lines():
            length += len(line) + 1
            event = sse.feed_line(line)
            if sse.done:
                stream.done = True
                break
            if event is None:
                continue
            if "error" in event:
                stream.problem = f"error event: {json.dumps(event['error'])[:300]}"
                break
            if stream.first_token_ms is None and is_token(event):
                stream.first_token_ms = (time.perf_counter() - started) * 1000
            stream.events.append(event)
    except SSEError as error:  # not JSON, not an object
        stream.problem = f"after {len(stream.events)} events: {error}"
    except Exception as error:  # connection reset mid-stream
        stream.problem = f"stream broken after {len(stream.events)} events: {error!r}"
    finally:
        response.request_meta["response_time"] = (time.perf_counter() - started) * 1000
        response.request_meta["response_length"] = length
    if stream.problem is None and not stream.done:
        stream.problem = f"stream ended without [DONE] after {len(stream.events)} events"
    return stream


def _completion_chunk_is_token(event: dict) -> bool:
    return bool(event.get("choices"))  # not the usage chunk


def _chat_chunk_is_token(event: dict) -> bool:
    # not the first chunk (the role, sent before any token) nor the usage chunk
    return any((c.get("delta") or {}).get("content") or c.get("finish_reason") for c in event.get("choices") or [])


class TserveUser(HttpUser):
    wait_time = between(0, 2 * THINK_S)

    def on_start(self):
        self.rng = random.Random(f"{SEED}-{id(self)}")
        if API_KEY:
            self.client.headers["Authorization"] = f"Bearer {API_KEY}"

    def _with_timeout(self, body: dict) -> dict:
        if TIMEOUT_MS:
            body["timeout_ms"] = TIMEOUT_MS
        return body

    # --- translation ------------------------------------------------------------------------------------------

    def _translate(self, name: str, num_beams: int) -> None:
        body = self._with_timeout({"text": self.rng.choice(SENTENCES), "num_beams": num_beams})
        with self.client.post("/v1/translate", json=body, name=name, catch_response=True) as response:
            if response.status_code != 200:
                return response.failure(f"HTTP {response.status_code}: {_error_text(response)}")
            translations = response.json().get("translations")
            if not (isinstance(translations, list) and len(translations) == 1 and translations[0]
                    and isinstance(translations[0][0].get("text"), str)):
                return response.failure(f"unexpected body: {response.text[:300]}")
            with EXTRA.lock:
                EXTRA.sentences[name] += 1

    @task(WEIGHTS["translate_greedy"])
    def translate_greedy(self):
        self._translate("translate greedy", 1)

    @task(WEIGHTS["translate_beam"])
    def translate_beam(self):
        self._translate("translate beam", NUM_BEAMS)

    # --- generation -------------------------------------------------------------------------------------------

    def _generate_body(self, stream: bool) -> dict:
        return self._with_timeout({"prompt": self.rng.choice(PROMPTS), "max_new_tokens": MAX_NEW_TOKENS,
                                   "temperature": 0.8, "top_k": 40, "seed": self.rng.randrange(2**31),
                                   "stream": stream})

    @task(WEIGHTS["generate"])
    def generate(self):
        with self.client.post("/v1/generate", json=self._generate_body(False), name="generate",
                              catch_response=True) as response:
            if response.status_code != 200:
                return response.failure(f"HTTP {response.status_code}: {_error_text(response)}")
            body = response.json()
            tokens = body.get("usage", {}).get("completion_tokens")
            if not isinstance(body.get("text"), str) or not isinstance(tokens, int) or tokens > MAX_NEW_TOKENS:
                return response.failure(f"unexpected body: {response.text[:300]}")
            with EXTRA.lock:
                EXTRA.tokens["generate"] += tokens

    @task(WEIGHTS["generate_stream"])
    def generate_stream(self):
        def tokens(events: list[dict]) -> int:
            return next((e["usage"]["completion_tokens"] for e in reversed(events) if "usage" in e), 0)

        self._stream_task("/v1/generate", "generate stream", self._generate_body(True), lambda event: True, tokens)

    def _stream_task(self, path: str, name: str, body: dict, is_token, check) -> None:
        """A streamed request: read to `[DONE]`, `check(events)` (raises _Unexpected, returns generated tokens),
        count its tokens and time to first token."""
        started = time.perf_counter()
        with self.client.post(path, json=body, name=name, stream=True, catch_response=True) as response:
            if response.status_code != 200:
                response.request_meta["response_length"] = len(response.content or b"")
                return response.failure(f"HTTP {response.status_code}: {_error_text(response)}")
            stream = _read_stream(response, started, is_token)
            if stream.problem:
                return response.failure(stream.problem)
            try:
                tokens = check(stream.events)
            except (_Unexpected, KeyError, TypeError, AttributeError) as error:
                return response.failure(f"unexpected stream: {error!r} in {json.dumps(stream.events)[:300]}")
            with EXTRA.lock:
                if stream.first_token_ms is not None:
                    EXTRA.ttft_ms.append(stream.first_token_ms)
                EXTRA.tokens[name] += tokens

    # --- OpenAI-compatible generation ----------------------------------------------------------------------------

    def _openai_body(self, stream: bool, **fields) -> dict:
        body = {"model": GPT_MODEL, **fields, "temperature": 0.8, "top_p": 0.95, "seed": self.rng.randrange(2**31)}
        if stream:
            body.update(stream=True, stream_options={"include_usage": True})
        return body

    def _openai_task(self, path: str, name: str, body: dict, check) -> None:
        """A non-streamed OpenAI request: `check(json)` raises _Unexpected or returns the generated tokens."""
        with self.client.post(path, json=body, name=name, catch_response=True) as response:
            if response.status_code != 200:
                return response.failure(f"HTTP {response.status_code}: {_error_text(response)}")
            try:
                tokens = check(response.json())
            except (_Unexpected, KeyError, TypeError, AttributeError, ValueError) as error:
                return response.failure(f"unexpected body: {error!r} in {response.text[:300]}")
            with EXTRA.lock:
                EXTRA.tokens[name] += tokens

    @task(WEIGHTS["openai_completion"])
    def openai_completion(self):
        prompt = self.rng.choice(PROMPTS)

        def check(body: dict) -> int:
            _check_header(body, "text_completion", "cmpl-")
            choices = body.get("choices")
            _expect(isinstance(choices, list) and len(choices) == 1, "not one choice")
            choice = choices[0]
            _expect(choice.get("index") == 0 and isinstance(choice.get("text"), str), "choice index or text")
            _expect(choice.get("logprobs") is None, "logprobs without asking")
            tokens = _check_usage(body.get("usage"), len(prompt.encode()), MAX_NEW_TOKENS)
            _check_finish(choice.get("finish_reason"), tokens, MAX_NEW_TOKENS)
            return tokens

        body = self._openai_body(False, prompt=prompt, max_tokens=MAX_NEW_TOKENS)
        self._openai_task("/v1/completions", "openai completion", body, check)

    @task(WEIGHTS["openai_completion_stream"])
    def openai_completion_stream(self):
        prompt = self.rng.choice(PROMPTS)

        def check(events: list[dict]) -> int:
            """Text chunks (one choice, `usage: null`), the last of them with finish_reason, then the usage chunk."""
            _expect(len(events) >= 2, f"{len(events)} chunks: a text chunk and the usage chunk at least")
            *chunks, last = events
            for event in events:
                _check_header(event, "text_completion", "cmpl-")
                _expect(event["id"] == events[0]["id"], "chunks of different ids")
            finish = None
            for event in chunks:
                _expect(finish is None, "a chunk after the one with finish_reason")
                _expect("usage" in event and event["usage"] is None, "a text chunk without usage: null")
                choices = event.get("choices")
                _expect(isinstance(choices, list) and len(choices) == 1, "a text chunk without one choice")
                choice = choices[0]
                _expect(choice.get("index") == 0 and isinstance(choice.get("text"), str), "choice index or text")
                finish = choice.get("finish_reason")
            _expect(last.get("choices") == [], "the last chunk is not the usage chunk (choices [])")
            tokens = _check_usage(last.get("usage"), len(prompt.encode()), MAX_NEW_TOKENS)
            _check_finish(finish, tokens, MAX_NEW_TOKENS)
            return tokens

        body = self._openai_body(True, prompt=prompt, max_tokens=MAX_NEW_TOKENS)
        self._stream_task("/v1/completions", "openai completion stream", body, _completion_chunk_is_token, check)

    def _chat_body(self, stream: bool) -> tuple[dict, int]:
        """A chat request of one user message, and the most prompt tokens it can be (its bytes + the template)."""
        text = self.rng.choice(PROMPTS)
        body = self._openai_body(stream, messages=[{"role": "user", "content": text}],
                                 max_completion_tokens=CHAT_MAX_TOKENS)
        return body, len(text.encode()) + CHAT_TEMPLATE_TOKENS

    @task(WEIGHTS["openai_chat"])
    def openai_chat(self):
        body, max_prompt_tokens = self._chat_body(False)

        def check(response: dict) -> int:
            _check_header(response, "chat.completion", "chatcmpl-")
            choices = response.get("choices")
            _expect(isinstance(choices, list) and len(choices) == 1, "not one choice")
            choice = choices[0]
            message = choice.get("message")
            _expect(choice.get("index") == 0 and isinstance(message, dict) and message.get("role") == "assistant"
                    and isinstance(message.get("content"), str), "choice index or message")
            _expect(END_OF_TURN not in message["content"], "the answer goes past the end of its turn (a blank line)")
            _expect(choice.get("logprobs") is None, "logprobs without asking")
            tokens = _check_usage(response.get("usage"), max_prompt_tokens, CHAT_MAX_TOKENS)
            _check_finish(choice.get("finish_reason"), tokens, CHAT_MAX_TOKENS)
            return tokens

        self._openai_task("/v1/chat/completions", "openai chat", body, check)

    @task(WEIGHTS["openai_chat_stream"])
    def openai_chat_stream(self):
        body, max_prompt_tokens = self._chat_body(True)

        def check(events: list[dict]) -> int:
            """The role chunk, content chunks, the last of them with finish_reason, then the usage chunk."""
            _expect(len(events) >= 3, f"{len(events)} chunks: role, finish and usage chunks at least")
            first, *chunks, last = events
            for event in events:
                _check_header(event, "chat.completion.chunk", "chatcmpl-")
                _expect(event["id"] == events[0]["id"], "chunks of different ids")
            role = {"index": 0, "delta": {"role": "assistant", "content": ""}, "logprobs": None, "finish_reason": None}
            _expect(first.get("choices") == [role] and "usage" in first and first["usage"] is None,
                    "the first chunk is not the assistant's role (with usage: null)")
            content, finish = "", None
            for event in chunks:
                _expect(finish is None, "a chunk after the one with finish_reason")
                _expect("usage" in event and event["usage"] is None, "a content chunk without usage: null")
                choices = event.get("choices")
                _expect(isinstance(choices, list) and len(choices) == 1, "a content chunk without one choice")
                choice = choices[0]
                delta = choice.get("delta")
                _expect(choice.get("index") == 0 and isinstance(delta, dict) and set(delta) <= {"content"}
                        and isinstance(delta.get("content", ""), str), "choice index or delta")
                content += delta.get("content", "")
                finish = choice.get("finish_reason")
            _expect(END_OF_TURN not in content, "the answer goes past the end of its turn (a blank line)")
            _expect(last.get("choices") == [], "the last chunk is not the usage chunk (choices [])")
            tokens = _check_usage(last.get("usage"), max_prompt_tokens, CHAT_MAX_TOKENS)
            _check_finish(finish, tokens, CHAT_MAX_TOKENS)
            return tokens

        self._stream_task("/v1/chat/completions", "openai chat stream", body, _chat_chunk_is_token, check)

    # --- the Open Inference Protocol (KServe v2), JSON tensors ----------------------------------------------------

    def _oip_task(self, model: str, name: str, body: dict, check) -> None:
        """`check(outputs by name)` raises _Unexpected or returns what to count."""
        with self.client.post(f"/v2/models/{model}/infer", json=body, name=name, catch_response=True) as response:
            if response.status_code != 200:
                return response.failure(f"HTTP {response.status_code}: {_error_text(response)}")
            try:
                payload = response.json()
                _expect(payload.get("model_name") == model, "model_name")
                check({o["name"]: o for o in payload["outputs"]})
            except (_Unexpected, KeyError, TypeError, AttributeError, ValueError) as error:
                return response.failure(f"unexpected body: {error!r} in {response.text[:300]}")

    @task(WEIGHTS["oip_translate"])
    def oip_translate(self):
        body = {"inputs": [{"name": "TEXT", "shape": [1], "datatype": "BYTES", "data": [self.rng.choice(SENTENCES)]}],
                "parameters": {"num_beams": NUM_BEAMS}}

        def check(outputs: dict) -> None:
            _expect(outputs["TRANSLATION"]["shape"] == [1] and isinstance(outputs["TRANSLATION"]["data"][0], str),
                    "TRANSLATION")
            _expect(outputs["SCORE"]["datatype"] == "FP32", "SCORE")
            with EXTRA.lock:
                EXTRA.sentences["oip translate"] += 1

        self._oip_task("translation", "oip translate", body, check)

    @task(WEIGHTS["oip_generate"])
    def oip_generate(self):
        body = {"inputs": [{"name": "PROMPT", "shape": [1], "datatype": "BYTES", "data": [self.rng.choice(PROMPTS)]}],
                "parameters": {"max_new_tokens": MAX_NEW_TOKENS, "temperature": 0.8, "top_k": 40,
                               "seed": self.rng.randrange(2**31)}}

        def check(outputs: dict) -> None:
            text = outputs["TEXT"]["data"][0]
            _expect(isinstance(text, str) and outputs["FINISH_REASON"]["data"][0] in ("eos", "length", "stop"),
                    "TEXT / FINISH_REASON")
            with EXTRA.lock:
                EXTRA.tokens["oip generate"] += len(text.encode())  # byte-level GPT: a token a byte

        self._oip_task(GPT_MODEL, "oip generate", body, check)

    @task(WEIGHTS["oip_classify"])
    def oip_classify(self):
        chosen = self.rng.sample(PNGS, self.rng.randint(1, MAX_IMAGES))
        images = [base64.b64encode(data).decode() for _, data, _ in chosen]  # BYTES in JSON: base64 text
        body = {"inputs": [{"name": "IMAGE", "shape": [len(images)], "datatype": "BYTES", "data": images}]}

        def check(outputs: dict) -> None:
            _expect(outputs["PROBABILITIES"]["shape"] == [len(images), 10], "PROBABILITIES shape")
            _expect(len(outputs["LABEL"]["data"]) == len(images), "LABEL")
            with EXTRA.lock:
                EXTRA.images += len(images)

        self._oip_task("vit", "oip classify", body, check)

    # --- classification ---------------------------------------------------------------------------------------

    @task(WEIGHTS["classify"])
    def classify(self):
        chosen = self.rng.sample(PNGS, self.rng.randint(1, MAX_IMAGES))
        files = [("files", (name, data, "image/png")) for name, data, _ in chosen]
        fields = {"top_k": "3", **({"timeout_ms": str(TIMEOUT_MS)} if TIMEOUT_MS else {})}
        with self.client.post("/v1/classify", files=files, data=fields, name="classify",
                              catch_response=True) as response:
            if response.status_code != 200:
                return response.failure(f"HTTP {response.status_code}: {_error_text(response)}")
            predictions = response.json().get("predictions")
            if not (isinstance(predictions, list) and len(predictions) == len(chosen)
                    and all(len(p) == 3 for p in predictions)):
                return response.failure(f"unexpected body: {response.text[:300]}")
            with EXTRA.lock:
                EXTRA.images += len(chosen)
