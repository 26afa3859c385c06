"""Batch invariance over HTTP: a target request's output alone, and among `OTHERS` concurrent requests of other
lengths, modes and budgets (so that rows join and leave its batch), through an in-process server's client.
Shared by tests/unit/engines/test_batch_invariance.py and test_constrained_batch_invariance.py."""

from __future__ import annotations

import threading
from concurrent.futures import ThreadPoolExecutor

OTHERS = 15
GPT_PROMPTS = ["A", "First Citizen:\nBefore we proceed any further, hear me speak.", "KING", "O", "To be, or not",
               "MENENIUS:\nWhy, masters, my good friends, mine honest neighbours,\nWill you undo yourselves?"]
GERMAN = ["Zwei Hunde spielen im Schnee.", "Eine Frau mit einem roten Hut sitzt auf einer Bank vor einem Haus.",
          "Kinder.", "Ein Mann in einem blauen Hemd steht auf einer Leiter und putzt ein Fenster."]


def other_body(kind: str, i: int, version: int) -> dict:
    """Request i of the 15 beside the target: other lengths, modes and budgets, so rows join and leave."""
    if kind == "gpt":
        body = {"prompt": GPT_PROMPTS[i % len(GPT_PROMPTS)], "max_new_tokens": 8 + 5 * i}
        body.update([{"temperature": 0}, {"temperature": 0.8, "seed": i}, {"num_beams": 2}][i % 3])
    else:
        body = {"text": GERMAN[i % len(GERMAN)], "num_beams": 1 + i % 4, "max_new_tokens": 10 + 3 * i}
    return {**body, "version": version} if version else body


def output_of(kind: str, response) -> object:
    assert response.status_code == 200, response.text
    body = response.json()
    if "choices" in body:  # OpenAI completions: the text and every token's log-probability, to the last bit
        choice = body["choices"][0]
        return choice["text"], choice["logprobs"]["token_logprobs"], choice["logprobs"]["top_logprobs"]
    return (body["text"], body["finish_reason"], body["usage"]) if kind == "gpt" else body["translations"]


def alone_and_among_others(client, kind: str, target: dict) -> tuple[object, list[object]]:
    """The target's output alone, then among OTHERS concurrent requests: sent first, sent after them (so that it
    joins their running batch), and in the middle."""
    path = "/v1/completions" if "logprobs" in target else "/v1/generate" if kind == "gpt" else "/v1/translate"
    alone = output_of(kind, client.post(path, json=target))
    together = []
    for position in (0, OTHERS, OTHERS // 2):
        bodies = [other_body(kind, i, target.get("version")) for i in range(OTHERS)]
        bodies.insert(position, target)
        started = threading.Barrier(len(bodies))

        def post(body):
            started.wait()  # every request is in flight at once
            return client.post(path if body is target else "/v1/generate", json=body)

        with ThreadPoolExecutor(len(bodies)) as pool:
            responses = list(pool.map(post, bodies))
        together.append(output_of(kind, responses[position]))
    return alone, together
