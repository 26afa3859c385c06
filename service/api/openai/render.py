"""The OpenAI-compatible API's responses, from the serving layer's completions and stream events: the response
objects and server-sent chunks of `/v1/completions` and `/v1/chat/completions` (`CompletionRender`,
`ChatRender`, one per request, holding what a stream keeps between wake-ups), log-probabilities in OpenAI's two
shapes (the legacy one led by the prompt's tokens with `echo`, as OpenAI's old API and vLLM) and vLLM's
`prompt_logprobs`, token texts and bytes as OpenAI writes them, one chunk entry per choice per wake-up (`merge`),
and the usage. As vLLM's `serving_completion` / `serving_chat` render what its engine returns; the router only
validates, calls the serving layer and hands its results here.

An echoed prompt (`echo_text`) keeps its special tokens, for a text and for token ids alike: `<|endoftext|>` is its
content in the text, in `tokens` and in `text_offset` (as `/detokenize` and vLLM's echo render it), so that
`text[text_offset[i]:][:len(tokens[i])] == tokens[i]` for every token that is whole characters. Generated text
holds none (the end of text ends a choice and is not part of it).
"""

from __future__ import annotations

import time
import uuid
from collections.abc import AsyncIterator, Callable, Sequence
from dataclasses import dataclass, field, replace

from fastapi import Request
from fastapi.responses import StreamingResponse

from service.api.openai.errors import openai_error_type
from service.client.sse import event as sse_event
from service.decoding import text_offsets
from service.http.routing import sse_response
from service.serving.outputs import Completion
from service.serving.streaming import Finished, Piece

# JSON has no -inf: a token the model gives no probability at all is reported at this log-probability, as OpenAI does
FLOOR_LOGPROB = -9999.0
BYTE_VALUES = 256  # a byte's values; GPT-2's map gives the unprintable ones the characters from chr(256) on


def finish_reason(reason: str) -> str:
    """OpenAI's finish reason: "length" at `max_tokens`, "stop" for an end of text or a stop string."""
    return "length" if reason == "length" else "stop"


def usage(completions: Sequence[Completion], prompt_tokens: int, n: int = 1) -> dict:
    """OpenAI's usage: the prompts' tokens (once, whatever n is), every choice's generated tokens, and in
    `prompt_tokens_details.cached_tokens` the prompts' tokens that a prefix cache held (every choice of a prompt
    carries its prompt's: their sum over n)."""
    generated = sum(c.completion_tokens for c in completions)
    cached = sum(c.cached_tokens for c in completions) // max(1, n)
    return {"prompt_tokens": prompt_tokens, "completion_tokens": generated, "total_tokens": prompt_tokens + generated,
            "prompt_tokens_details": {"cached_tokens": cached}}


# --- token texts and log-probabilities ------------------------------------------------------------------------

def _gpt2_byte_map() -> dict[str, int]:
    """GPT-2's reversible byte -> printable character map (what `tokenizers`' ByteLevel uses), inverted."""
    printable = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) + \
        list(range(ord("®"), ord("ÿ") + 1))
    chars, extra = {}, 0
    for byte in range(BYTE_VALUES):
        if byte in printable:
            chars[chr(byte)] = byte
        else:
            chars[chr(BYTE_VALUES + extra)] = byte
            extra += 1
    return chars


_BYTE_OF = _gpt2_byte_map()


def _token_bytes(tokenizer, token: int) -> bytes:
    """A token's bytes: through GPT-2's byte-to-character map for a byte-level vocabulary, else its decoded text."""
    piece = tokenizer.id_to_token(token) or ""
    if type(tokenizer.decoder).__name__ == "ByteLevel" and all(ch in _BYTE_OF for ch in piece):
        return bytes(_BYTE_OF[ch] for ch in piece)
    return tokenizer.decode([token]).encode("utf-8")


class TokenText:
    """A token's text as OpenAI reports it, and its bytes: a token that is part of a UTF-8 character (a byte-level
    token) is `bytes:\\xNN`, as OpenAI writes such tokens. Cached per token, for one request."""

    def __init__(self, tokenizer):
        self.tokenizer = tokenizer
        self.cache: dict[int, tuple[str, list[int]]] = {}

    def __call__(self, token: int) -> tuple[str, list[int]]:
        if token not in self.cache:
            raw = _token_bytes(self.tokenizer, token)
            try:
                text = raw.decode("utf-8")
            except UnicodeDecodeError:
                text = "bytes:" + "".join(f"\\x{b:02x}" for b in raw)
            self.cache[token] = (text, list(raw))
        return self.cache[token]


def echo_text(tokenizer, prompt: str | Sequence[int], ids: Sequence[int]) -> str:
    """The text an echoed prompt is: a text as it was sent; token ids decoded with their special tokens kept."""
    return prompt if isinstance(prompt, str) else tokenizer.decode(list(ids), skip_special_tokens=False)


def completion_logprobs(logprobs: Sequence, tokens: Sequence[int], start: int, token_text: TokenText,
                        keep_special: bool = False) -> dict:
    """OpenAI's legacy `logprobs` object for the given tokens, whose text begins at character `start` (their text
    with special tokens kept when `keep_special`: an echoed prompt's)."""
    tokenizer = token_text.tokenizer
    decode = (lambda ids: tokenizer.decode(ids, skip_special_tokens=False)) if keep_special else tokenizer.decode
    return {"tokens": [token_text(t)[0] for t in tokens],
            "token_logprobs": [max(lp.logprob, FLOOR_LOGPROB) for lp in logprobs],
            "top_logprobs": [{token_text(t)[0]: max(value, FLOOR_LOGPROB) for t, value in lp.top} for lp in logprobs],
            "text_offset": text_offsets(decode, tokens, start)}


def echo_logprobs(prompt: Sequence[int], scores, top: int, token_text: TokenText) -> dict:
    """The legacy `logprobs` entries of an echoed prompt (`scores`: its `PromptLogprobs`, top alternatives cut to
    the request's `top`): every prompt token, the first with a null log-probability and null alternatives (nothing
    comes before it), as OpenAI and vLLM return them; text offsets from 0, where the echoed text (`echo_text`,
    special tokens kept) starts."""
    cut = [replace(lp, top=lp.top[:top]) for lp in scores.tokens]  # the prompt pass kept the most asked for
    entries = completion_logprobs(cut, prompt, 0, token_text, keep_special=True)
    entries["token_logprobs"].insert(0, None)
    entries["top_logprobs"].insert(0, None)
    return entries


def prompt_logprobs(scores, top: int, token_text: TokenText) -> list[dict | None]:
    """vLLM's `prompt_logprobs`: per prompt token, null for the first, then {token id: {logprob, rank,
    decoded_token}} for the token itself and the `top` most likely tokens at its position (ranks from 1)."""
    def entry(value: float, rank: int, token: int) -> dict:
        return {"logprob": max(value, FLOOR_LOGPROB), "rank": rank, "decoded_token": token_text(token)[0]}

    out: list[dict | None] = [None]
    for lp, rank in zip(scores.tokens, scores.ranks):
        tokens = {str(lp.token_id): entry(lp.logprob, rank, lp.token_id)}
        for i, (token, value) in enumerate(lp.top[:top]):
            tokens.setdefault(str(token), entry(value, i + 1, token))
        out.append(tokens)
    return out


def chat_logprobs(logprobs: Sequence, token_text: TokenText) -> dict:
    """OpenAI's chat `logprobs` object: per token its text, log-probability, bytes and top alternatives."""
    def entry(token: int, value: float) -> dict:
        text, raw = token_text(token)
        return {"token": text, "logprob": max(value, FLOOR_LOGPROB), "bytes": raw}

    return {"content": [{**entry(lp.token_id, lp.logprob), "top_logprobs": [entry(t, v) for t, v in lp.top]}
                        for lp in logprobs]}


# --- streams --------------------------------------------------------------------------------------------------

@dataclass
class ChoiceDelta:
    """What one choice gained in one wake-up: its pieces merged (OpenAI sends one entry per choice per chunk)."""

    choice: int
    text: str = ""
    token_ids: list[int] = field(default_factory=list)
    logprobs: list = field(default_factory=list)
    completion: Completion | None = None  # set when the choice finished


def merge(batch: Sequence[Piece | Finished]) -> tuple[list[ChoiceDelta], list[Finished]]:
    """The batch's events per choice, in order of first appearance; and the choices that failed. A choice whose
    events carry nothing to send (tokens held back as a possible stop string, no log-probabilities asked for)
    has no delta: an empty `content` chunk would only cost the client a parse."""
    deltas: dict[int, ChoiceDelta] = {}
    failed = []
    for event in batch:
        if isinstance(event, Finished) and event.error is not None:
            failed.append(event)
            deltas.pop(event.choice, None)
            continue
        delta = deltas.setdefault(event.choice, ChoiceDelta(event.choice))
        if isinstance(event, Piece):
            delta.text += event.text
            delta.token_ids += event.token_ids
            delta.logprobs += event.logprobs or []
        else:
            delta.text += event.rest
            delta.completion = event.completion
    moved = [d for d in deltas.values() if d.text or d.logprobs or d.completion is not None]
    return moved, failed


def event_stream(request: Request, events: AsyncIterator[list[Piece | Finished]],
                 chunk: Callable[[list[dict]], dict], choice_delta: Callable[[ChoiceDelta], dict],
                 usage_of: Callable[[], dict] | None, first: list[dict] | None = None) -> StreamingResponse:
    """OpenAI's server-sent chunks: `first` choices (chat: the role), then one chunk per wake-up with one entry
    per choice that moved, then (with `stream_options.include_usage`) a usage chunk without choices, then [DONE].
    A choice that fails after the status was sent ends the stream with an error event, as vLLM's, of the type the
    same error has unstreamed (`openai_error_type`: a deadline is a timeout_error either way)."""

    async def chunks() -> AsyncIterator[bytes]:
        if first:
            yield sse_event(chunk(first))
        async for batch in events:
            deltas, failed = merge(batch)
            if deltas:
                yield sse_event(chunk([choice_delta(delta) for delta in deltas]))
            for event in failed:  # the middleware counts this reason
                request.state.failure_reason = event.error.reason
                yield sse_event({"error": {"message": event.error.message,
                                           "type": openai_error_type(event.error.status), "param": None,
                                           "code": event.error.type}})
        if usage_of is not None:
            yield sse_event({**chunk([]), "usage": usage_of()})

    return sse_response(request, chunks(), events)


# --- one request's responses ----------------------------------------------------------------------------------

class _Render:
    """What a completions and a chat response share: the id, creation time and model of the object and of every
    chunk, the usage, and a stream's state (the choices that finished, for the usage chunk)."""

    ID_PREFIX = OBJECT = CHUNK_OBJECT = ""

    def __init__(self, model: str, tokenizer, n: int, prompt_tokens: int, include_usage: bool):
        self.id, self.created = f"{self.ID_PREFIX}-{uuid.uuid4().hex}", int(time.time())
        self.model, self.n, self.prompt_tokens, self.include_usage = model, n, prompt_tokens, include_usage
        self.token_text = TokenText(tokenizer)
        self.finished: list[Completion] = []

    def _object(self, kind: str, choices: list[dict]) -> dict:
        return {"id": self.id, "object": kind, "created": self.created, "model": self.model, "choices": choices}

    def _response(self, choices: list[dict], completions: Sequence[Completion]) -> dict:
        return {**self._object(self.OBJECT, choices), "usage": usage(completions, self.prompt_tokens, self.n)}

    def _chunk(self, choices: list[dict]) -> dict:
        out = self._object(self.CHUNK_OBJECT, choices)
        return {**out, "usage": None} if self.include_usage else out

    def _delta(self, delta: ChoiceDelta) -> dict:
        raise NotImplementedError

    def _first(self) -> list[dict] | None:
        return None

    def stream(self, request: Request, events: AsyncIterator[list[Piece | Finished]]) -> StreamingResponse:
        """The request's server-sent chunks, from the serving layer's stream of its choices."""
        def delta(d: ChoiceDelta) -> dict:
            if d.completion is not None:
                self.finished.append(d.completion)
            return self._delta(d)

        usage_of = (lambda: usage(self.finished, self.prompt_tokens, self.n)) if self.include_usage else None
        return event_stream(request, events, self._chunk, delta, usage_of, self._first())


class CompletionRender(_Render):
    """One `/v1/completions` request's response: choice `p * n + i` is prompt p's i-th, after the prompt's
    `echoed` text; log-probabilities in the legacy shape when `logprobs` were asked for (led by the prompt's
    tokens, `prompt_ids[p]`, with echo: `echo_logprobs`), vLLM's `prompt_logprobs` (that many alternatives) when
    asked for. Streams carry neither of the prompt's (the request is refused before)."""

    ID_PREFIX, OBJECT, CHUNK_OBJECT = "cmpl", "text_completion", "text_completion"

    def __init__(self, model: str, tokenizer, n: int, prompt_tokens: int, include_usage: bool,
                 echoed: Sequence[str], logprobs: int | None, prompt_ids: Sequence[Sequence[int]] = (),
                 echo_logprobs: bool = False, prompt_logprobs: int | None = None):
        super().__init__(model, tokenizer, n, prompt_tokens, include_usage)
        self.echoed, self.logprobs = echoed, logprobs
        self.prompt_ids, self.echo_logprobs, self.prompt_logprobs = prompt_ids, echo_logprobs, prompt_logprobs
        self.sent = [0] * (len(echoed) * n)  # characters sent per choice (text offsets of streamed log-probs)

    def _logprobs(self, logprobs, tokens: Sequence[int], start: int) -> dict | None:
        if self.logprobs is None:
            return None
        return completion_logprobs(logprobs or [], tokens, start, self.token_text)

    def _choice(self, index: int, p: int, c: Completion) -> dict:
        logprobs = self._logprobs(c.logprobs, c.token_ids, len(self.echoed[p]))
        if self.echo_logprobs:  # the prompt's entries first, then the completion's
            prompt = echo_logprobs(self.prompt_ids[p], c.prompt_logprobs, self.logprobs, self.token_text)
            logprobs = {key: prompt[key] + logprobs[key] for key in prompt}
        choice = {"index": index, "text": self.echoed[p] + c.text, "logprobs": logprobs,
                  "finish_reason": finish_reason(c.finish_reason)}
        if self.prompt_logprobs is not None:
            choice["prompt_logprobs"] = prompt_logprobs(c.prompt_logprobs, self.prompt_logprobs, self.token_text)
        return choice

    def response(self, results: Sequence[Sequence[Completion]]) -> dict:
        """The response object of the completions per prompt."""
        choices, everything = [], []
        for p, group in enumerate(results):
            for i, c in enumerate(group):
                everything.append(c)
                choices.append(self._choice(p * self.n + i, p, c))
        return self._response(choices, everything)

    def _delta(self, d: ChoiceDelta) -> dict:
        prefix = self.echoed[d.choice // self.n] if self.sent[d.choice] == 0 else ""
        choice = {"index": d.choice, "text": prefix + d.text,
                  "logprobs": self._logprobs(d.logprobs, d.token_ids, self.sent[d.choice] + len(prefix)),
                  "finish_reason": None if d.completion is None else finish_reason(d.completion.finish_reason)}
        self.sent[d.choice] += len(prefix) + len(d.text)
        return choice


class ChatRender(_Render):
    """One `/v1/chat/completions` request's response: the assistant's messages, a stream's first chunk giving
    each choice its role; log-probabilities in the chat shape when `logprobs` were asked for."""

    ID_PREFIX, OBJECT, CHUNK_OBJECT = "chatcmpl", "chat.completion", "chat.completion.chunk"

    def __init__(self, model: str, tokenizer, n: int, prompt_tokens: int, include_usage: bool, logprobs: bool):
        super().__init__(model, tokenizer, n, prompt_tokens, include_usage)
        self.logprobs = logprobs

    def _logprobs(self, logprobs) -> dict | None:
        return chat_logprobs(logprobs or [], self.token_text) if self.logprobs else None

    def response(self, results: Sequence[Completion]) -> dict:
        """The response object of the prompt's completions."""
        choices = [{"index": i, "message": {"role": "assistant", "content": c.text},
                    "logprobs": self._logprobs(c.logprobs), "finish_reason": finish_reason(c.finish_reason)}
                   for i, c in enumerate(results)]
        return self._response(choices, results)

    def _first(self) -> list[dict]:
        return [{"index": i, "delta": {"role": "assistant", "content": ""}, "logprobs": None, "finish_reason": None}
                for i in range(self.n)]

    def _delta(self, d: ChoiceDelta) -> dict:
        if d.completion is None:
            return {"index": d.choice, "delta": {"content": d.text}, "logprobs": self._logprobs(d.logprobs),
                    "finish_reason": None}
        return {"index": d.choice, "delta": {"content": d.text} if d.text else {},
                "logprobs": self._logprobs(d.logprobs), "finish_reason": finish_reason(d.completion.finish_reason)}
