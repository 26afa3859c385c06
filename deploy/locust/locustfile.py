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
`oip translate`, `oip generate`, `oip classify` (the Open Inference Protocol, JSON tensors), `grpc generate stream`,
`grpc classify` (the same protocol over gRPC, raw tensors: load_grpc.py, locust's gRPC pattern).
A streamed request's response time is the whole stream (to `[DONE]`), not the time to the response headers.
Client-side extras locust does not keep (time to first token of streams, generated tokens, images, sentences),
and locust's final totals (its CSV files are written every second and may miss the last one), are written to
`<csv prefix>_extra.json` when locust runs with `--csv`; `deploy/loadtest.py` reads them.

Settings: the TSERVE_LOAD_* variables (and TSERVE_DATA_DIR), listed in load_settings.py beside this file.

Code: this file (the inputs, the user and its tasks, the stream reader, the event hooks); beside it, standard library
only: load_settings.py (the settings), load_checks.py (what a response must be), load_extra.py (the client-side
measurements), load_grpc.py (the gRPC calls; grpcio and the project's generated stubs). The project modules the load test needs are this file's imports (the locust image copies them,
deploy/Dockerfile.locust). This folder is importable both ways: locust puts it first on sys.path while it loads the
locustfile, and the locustfile adds it when imported otherwise.
"""

from __future__ import annotations

import base64
import io
import json
import random
import sys
import time
from functools import partial
from pathlib import Path

from locust import HttpUser, between, events, task

HERE = Path(__file__).resolve().parent
if str(HERE) not in sys.path:  # the modules beside this file
    sys.path.insert(0, str(HERE))
try:
    from models.data import load_fashion_mnist, load_multi30k, load_shakespeare
    from service.client.sse import SSEError, SSEParser
except ImportError:  # run from a checkout without the project installed
    sys.path.insert(0, str(HERE.parents[1]))
    from models.data import load_fashion_mnist, load_multi30k, load_shakespeare
    from service.client.sse import SSEError, SSEParser

from load_checks import (  # noqa: E402 - after the sys.path set-up
    EXCERPT,
    Unexpected,
    chat_chunk_is_token,
    check_chat,
    check_chat_stream,
    check_completion,
    check_completion_stream,
    check_oip_classification,
    check_oip_generation,
    check_oip_translation,
    completion_chunk_is_token,
    error_text,
    expect,
)
from load_extra import Extra, final_stats  # noqa: E402
from load_grpc import GrpcInference, default_target  # noqa: E402
from load_settings import (  # noqa: E402
    API_KEY,
    CHAT_MAX_TOKENS,
    CHAT_TEMPLATE_TOKENS,
    CLASSIFY_TOP_K,
    DATA_DIR,
    GPT_MODEL,
    GRPC_HOST,
    MAX_IMAGES,
    MAX_NEW_TOKENS,
    N_INPUTS,
    NUM_BEAMS,
    OPENAI_SAMPLING,
    PROMPT_CHARS,
    SAMPLING,
    SEED,
    SEEDS,
    THINK_S,
    TIMEOUT_MS,
    WEIGHTS,
)


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


EXTRA = Extra()


@events.test_start.add_listener
def _reset_extra(environment, **_):
    global EXTRA
    EXTRA = Extra()


@events.quitting.add_listener
def _write_extra(environment, **_):
    prefix = getattr(environment.parsed_options, "csv_prefix", None) if environment.parsed_options else None
    if prefix:
        Path(f"{prefix}_extra.json").write_text(json.dumps({**EXTRA.as_dict(), "final": final_stats(environment)}))


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
                stream.problem = f"error event: {json.dumps(event['error'])[:EXCERPT]}"
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


class TserveUser(HttpUser):
    wait_time = between(0, 2 * THINK_S)

    def on_start(self):
        self.rng = random.Random(f"{SEED}-{id(self)}")
        if API_KEY:
            self.client.headers["Authorization"] = f"Bearer {API_KEY}"
        self._grpc_client = None

    def on_stop(self):
        if self._grpc_client is not None:
            self._grpc_client.close()

    def _grpc(self) -> GrpcInference:
        """This user's gRPC channel (made at its first gRPC task), reporting each call as a locust request."""
        if self._grpc_client is None:
            def fire(name: str, started: float, length: int, exception) -> None:
                self.environment.events.request.fire(
                    request_type="grpc", name=name, response_time=(time.perf_counter() - started) * 1000,
                    response_length=length, exception=exception, context={})

            self._grpc_client = GrpcInference(GRPC_HOST or default_target(self.host), API_KEY, fire)
        return self._grpc_client

    def _with_timeout(self, body: dict) -> dict:
        if TIMEOUT_MS:
            body["timeout_ms"] = TIMEOUT_MS
        return body

    # --- translation ------------------------------------------------------------------------------------------

    def _translate(self, name: str, num_beams: int) -> None:
        body = self._with_timeout({"text": self.rng.choice(SENTENCES), "num_beams": num_beams})
        with self.client.post("/v1/translate", json=body, name=name, catch_response=True) as response:
            if response.status_code != 200:
                return response.failure(f"HTTP {response.status_code}: {error_text(response)}")
            translations = response.json().get("translations")
            if not (isinstance(translations, list) and len(translations) == 1 and translations[0]
                    and isinstance(translations[0][0].get("text"), str)):
                return response.failure(f"unexpected body: {response.text[:EXCERPT]}")
            EXTRA.add(name, 1)

    @task(WEIGHTS["translate_greedy"])
    def translate_greedy(self):
        self._translate("translate greedy", 1)

    @task(WEIGHTS["translate_beam"])
    def translate_beam(self):
        self._translate("translate beam", NUM_BEAMS)

    # --- generation -------------------------------------------------------------------------------------------

    def _generate_body(self, stream: bool) -> dict:
        return self._with_timeout({"prompt": self.rng.choice(PROMPTS), "max_new_tokens": MAX_NEW_TOKENS,
                                   **SAMPLING, "seed": self.rng.randrange(SEEDS), "stream": stream})

    @task(WEIGHTS["generate"])
    def generate(self):
        with self.client.post("/v1/generate", json=self._generate_body(False), name="generate",
                              catch_response=True) as response:
            if response.status_code != 200:
                return response.failure(f"HTTP {response.status_code}: {error_text(response)}")
            body = response.json()
            tokens = body.get("usage", {}).get("completion_tokens")
            if not isinstance(body.get("text"), str) or not isinstance(tokens, int) or tokens > MAX_NEW_TOKENS:
                return response.failure(f"unexpected body: {response.text[:EXCERPT]}")
            EXTRA.add("generate", tokens)

    @task(WEIGHTS["generate_stream"])
    def generate_stream(self):
        def tokens(events: list[dict]) -> int:
            return next((e["usage"]["completion_tokens"] for e in reversed(events) if "usage" in e), 0)

        self._stream_task("/v1/generate", "generate stream", self._generate_body(True), lambda event: True, tokens)

    def _stream_task(self, path: str, name: str, body: dict, is_token, check) -> None:
        """A streamed request: read to `[DONE]`, `check(events)` (raises Unexpected, returns generated tokens),
        count its tokens and time to first token."""
        started = time.perf_counter()
        with self.client.post(path, json=body, name=name, stream=True, catch_response=True) as response:
            if response.status_code != 200:
                response.request_meta["response_length"] = len(response.content or b"")
                return response.failure(f"HTTP {response.status_code}: {error_text(response)}")
            stream = _read_stream(response, started, is_token)
            if stream.problem:
                return response.failure(stream.problem)
            try:
                tokens = check(stream.events)
            except (Unexpected, KeyError, TypeError, AttributeError) as error:
                return response.failure(f"unexpected stream: {error!r} in {json.dumps(stream.events)[:EXCERPT]}")
            EXTRA.add(name, tokens, stream.first_token_ms)

    # --- OpenAI-compatible generation ----------------------------------------------------------------------------

    def _openai_body(self, stream: bool, **fields) -> dict:
        body = {"model": GPT_MODEL, **fields, **OPENAI_SAMPLING, "seed": self.rng.randrange(SEEDS)}
        if stream:
            body.update(stream=True, stream_options={"include_usage": True})
        return body

    def _openai_task(self, path: str, name: str, body: dict, check) -> None:
        """A non-streamed OpenAI request: `check(json)` raises Unexpected or returns the generated tokens."""
        with self.client.post(path, json=body, name=name, catch_response=True) as response:
            if response.status_code != 200:
                return response.failure(f"HTTP {response.status_code}: {error_text(response)}")
            try:
                tokens = check(response.json())
            except (Unexpected, KeyError, TypeError, AttributeError, ValueError) as error:
                return response.failure(f"unexpected body: {error!r} in {response.text[:EXCERPT]}")
            EXTRA.add(name, tokens)

    @task(WEIGHTS["openai_completion"])
    def openai_completion(self):
        prompt = self.rng.choice(PROMPTS)
        check = partial(check_completion, max_prompt_tokens=len(prompt.encode()), max_tokens=MAX_NEW_TOKENS)
        body = self._openai_body(False, prompt=prompt, max_tokens=MAX_NEW_TOKENS)
        self._openai_task("/v1/completions", "openai completion", body, check)

    @task(WEIGHTS["openai_completion_stream"])
    def openai_completion_stream(self):
        prompt = self.rng.choice(PROMPTS)
        check = partial(check_completion_stream, max_prompt_tokens=len(prompt.encode()), max_tokens=MAX_NEW_TOKENS)
        body = self._openai_body(True, prompt=prompt, max_tokens=MAX_NEW_TOKENS)
        self._stream_task("/v1/completions", "openai completion stream", body, completion_chunk_is_token, check)

    def _chat_body(self, stream: bool) -> tuple[dict, int]:
        """A chat request of one user message, and the most prompt tokens it can be (its bytes + the template)."""
        text = self.rng.choice(PROMPTS)
        body = self._openai_body(stream, messages=[{"role": "user", "content": text}],
                                 max_completion_tokens=CHAT_MAX_TOKENS)
        return body, len(text.encode()) + CHAT_TEMPLATE_TOKENS

    @task(WEIGHTS["openai_chat"])
    def openai_chat(self):
        body, max_prompt_tokens = self._chat_body(False)
        check = partial(check_chat, max_prompt_tokens=max_prompt_tokens, max_tokens=CHAT_MAX_TOKENS)
        self._openai_task("/v1/chat/completions", "openai chat", body, check)

    @task(WEIGHTS["openai_chat_stream"])
    def openai_chat_stream(self):
        body, max_prompt_tokens = self._chat_body(True)
        check = partial(check_chat_stream, max_prompt_tokens=max_prompt_tokens, max_tokens=CHAT_MAX_TOKENS)
        self._stream_task("/v1/chat/completions", "openai chat stream", body, chat_chunk_is_token, check)

    # --- the Open Inference Protocol (KServe v2), JSON tensors ----------------------------------------------------

    def _oip_task(self, model: str, name: str, body: dict, check) -> None:
        """`check(outputs by name)` raises Unexpected or returns what to count (sentences, tokens, images)."""
        with self.client.post(f"/v2/models/{model}/infer", json=body, name=name, catch_response=True) as response:
            if response.status_code != 200:
                return response.failure(f"HTTP {response.status_code}: {error_text(response)}")
            try:
                payload = response.json()
                expect(payload.get("model_name") == model, "model_name")
                counted = check({o["name"]: o for o in payload["outputs"]})
            except (Unexpected, KeyError, TypeError, AttributeError, ValueError) as error:
                return response.failure(f"unexpected body: {error!r} in {response.text[:EXCERPT]}")
            EXTRA.add(name, counted)

    @task(WEIGHTS["oip_translate"])
    def oip_translate(self):
        body = {"inputs": [{"name": "TEXT", "shape": [1], "datatype": "BYTES", "data": [self.rng.choice(SENTENCES)]}],
                "parameters": {"num_beams": NUM_BEAMS}}

        self._oip_task("translation", "oip translate", body, check_oip_translation)

    @task(WEIGHTS["oip_generate"])
    def oip_generate(self):
        body = {"inputs": [{"name": "PROMPT", "shape": [1], "datatype": "BYTES", "data": [self.rng.choice(PROMPTS)]}],
                "parameters": {"max_new_tokens": MAX_NEW_TOKENS, **SAMPLING, "seed": self.rng.randrange(SEEDS)}}

        self._oip_task(GPT_MODEL, "oip generate", body, check_oip_generation)

    @task(WEIGHTS["oip_classify"])
    def oip_classify(self):
        chosen = self.rng.sample(PNGS, self.rng.randint(1, MAX_IMAGES))
        images = [base64.b64encode(data).decode() for _, data, _ in chosen]  # BYTES in JSON: base64 text
        body = {"inputs": [{"name": "IMAGE", "shape": [len(images)], "datatype": "BYTES", "data": images}]}

        self._oip_task("vit", "oip classify", body, partial(check_oip_classification, images=len(images)))

    # --- the Open Inference Protocol over gRPC (load_grpc.py) ----------------------------------------------------

    @task(WEIGHTS["grpc_generate_stream"])
    def grpc_generate_stream(self):
        options = {**SAMPLING, "seed": self.rng.randrange(SEEDS)}
        if result := self._grpc().generate_stream(self.rng.choice(PROMPTS), options, MAX_NEW_TOKENS):
            tokens, first_ms = result
            EXTRA.add("grpc generate stream", tokens, first_ms)

    @task(WEIGHTS["grpc_classify"])
    def grpc_classify(self):
        chosen = self.rng.sample(PNGS, self.rng.randint(1, MAX_IMAGES))
        if images := self._grpc().classify([data for _, data, _ in chosen]):
            EXTRA.add("grpc classify", images)

    # --- classification ---------------------------------------------------------------------------------------

    @task(WEIGHTS["classify"])
    def classify(self):
        chosen = self.rng.sample(PNGS, self.rng.randint(1, MAX_IMAGES))
        files = [("files", (name, data, "image/png")) for name, data, _ in chosen]
        fields = {"top_k": str(CLASSIFY_TOP_K), **({"timeout_ms": str(TIMEOUT_MS)} if TIMEOUT_MS else {})}
        with self.client.post("/v1/classify", files=files, data=fields, name="classify",
                              catch_response=True) as response:
            if response.status_code != 200:
                return response.failure(f"HTTP {response.status_code}: {error_text(response)}")
            predictions = response.json().get("predictions")
            if not (isinstance(predictions, list) and len(predictions) == len(chosen)
                    and all(len(p) == CLASSIFY_TOP_K for p in predictions)):
                return response.failure(f"unexpected body: {response.text[:EXCERPT]}")
            EXTRA.add("classify", len(chosen))
