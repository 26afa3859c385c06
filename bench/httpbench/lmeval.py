"""Issue 55's lm-eval case (`--cases lm-eval`): the requests lm-evaluation-harness sends for a multiple-choice task,
replayed over HTTP on the prefix case's two servers (TSERVE_PREFIX_CACHE=true and false) -> wall time cache on /
off (goal <= 0.67).

Replayed rather than run: an `lm_eval` process costs seconds of start-up, task loading and `/tokenize` calls that
the cache cannot change, the same on both servers, which would hide the scoring's ratio; the replay sends exactly
the scoring requests, in lm-eval's order (0.4.13, `local-completions` with `tokenizer_backend=remote`,
`batch_size=1`, one request at a time, as tests/api/test_lm_eval.py runs it):

- each choice is one loglikelihood request `(context, " " + choice)` (the task's `target_delimiter`), encoded as
  `TemplateAPI._encode_pair` does: `whole = encode(context + continuation)`, the context's ids, the continuation
  `whole[len(context ids):]`; the prompt sent is the context's ids and the continuation's (`whole`), cut to
  `max_length` from the left (never, here);
- the requests are sorted as its `Collator` sorts them, by (-length, the ids): here a task's documents longest
  first, each document's choices one after the other (a choice is the same words in another order: the same length);
- each is `POST /v1/completions` with `LocalCompletionsAPI._create_payload`'s body for a loglikelihood request:
  `{"model", "prompt": [ids], "temperature": 0, "max_tokens": 1, "logprobs": 1, "seed": 1234, "echo": true}`
  (tests/bench/test_bench_http_issue55.py checks both against the installed lm-eval).

The task is the shape of the project's fixture `shakespeare_word_order` (tests/fixtures/lm_eval), larger: the first
half of a line of tinyshakespeare after 150-200 characters of the text before it as the context (tokens: the GPT
reads bytes), the second half's words in their own order among three other orders as the four choices. Its
documents come in tasks of `DOCS_PER_TASK`, one lm-eval run each (sorted as one), one task after the other; no two
documents' contexts start alike, so the first choice of each is a miss and the three others may hit (16-token
blocks: the context's whole blocks).

Wall time on / off is the time per request, which is the ratio of the times of the same requests: both servers get
the same requests in the same order (each case from the first on), each its own rounds.
"""

from __future__ import annotations

import json
import random
from collections.abc import Callable, Sequence
from pathlib import Path

from service.client.launcher import ServiceProcess

from .ab import PREFIX_COUNTERS, ABRatio, CountingCase
from .cases import JSON_HEADERS, Case
from .load import Workload
from .prefix import OFF, ON

OPTION = "lm-eval"
ON_CASE, OFF_CASE = "lm-eval on c=1", "lm-eval off c=1"
CONTEXT_CHARS = (150, 200)  # a context's length, in characters (= tokens)
CHOICES = 4
MIN_WORDS = 3  # distinct words in a line's second half: at least 6 orders to choose 3 wrong ones from
MAX_PROMPT_TOKENS = 240  # context and choice together, within the GPT's 256 (one generated token after)
DOCS_PER_TASK = 50  # one lm-eval run sorts this many documents' requests
TASKS = 40  # 2,000 documents, 8,000 requests: more than a run sends
SEED = 55
TARGET_DELIMITER = " "  # lm-eval's default between a multiple-choice context and a choice
LM_EVAL_SEED = 1234  # the `seed` lm-eval's API models put in every request
ENDPOINT = "POST /v1/completions (lm-eval loglikelihood, echo)"


def word_order_docs(text: str, starts: Sequence[int], count: int, context_chars: tuple[int, int] = CONTEXT_CHARS,
                    seed: int = SEED) -> list[dict]:
    """Up to `count` documents {"context", "choices", "label"}, like the fixture's: each from one of `starts` (in
    order, past the end of the previous document: no two overlap), the text from there to the first half of the
    first line that makes a context of `context_chars` characters, whose second half has at least `MIN_WORDS`
    distinct words; the choices: those words in their order and in three other orders (drawn by
    `random.Random(seed)`), placed at random."""
    rng = random.Random(seed)
    low, high = context_chars
    docs: list[dict] = []
    taken = 0  # the text before this is some document's
    for start in starts:
        if len(docs) == count:
            break
        if start < taken:
            continue
        line = text.find("\n", start) + 1
        while 0 < line < len(text):
            end = text.find("\n", line)
            end = len(text) if end < 0 else end
            words = text[line:end].split()
            half = len(words) // 2
            context = text[start:line] + " ".join(words[:half])
            if len(context) > high:
                break
            ordered = words[half:]
            if (half and len(context) >= low and len(set(ordered)) >= MIN_WORDS
                    and len(context) + len(TARGET_DELIMITER) + len(" ".join(ordered)) <= MAX_PROMPT_TOKENS):
                orders = {tuple(ordered)}
                while len(orders) < CHOICES:
                    shuffled = ordered[:]
                    rng.shuffle(shuffled)
                    orders.add(tuple(shuffled))
                wrong = sorted(orders - {tuple(ordered)})
                choices = [" ".join(ordered)] + [" ".join(order) for order in rng.sample(wrong, CHOICES - 1)]
                rng.shuffle(choices)
                docs.append({"context": context, "choices": choices, "label": choices.index(" ".join(ordered))})
                taken = end
                break
            line = end + 1
    return docs


def loglikelihood_prompts(docs: list[dict], encode: Callable[[str], list[int]], max_length: int) -> list[list[int]]:
    """The prompts (ids) lm-eval sends for `docs` as one multiple-choice run, in its order (see the module)."""
    requests = []
    for doc in docs:
        for choice in doc["choices"]:
            context, continuation = doc["context"], TARGET_DELIMITER + choice
            spaces = len(context) - len(context.rstrip())  # `_encode_pair`: the context's trailing spaces move
            if spaces:
                context, continuation = context[:-spaces], context[-spaces:] + continuation
            whole, context_ids = encode(context + continuation), encode(context)
            requests.append((context_ids + whole[len(context_ids):])[-max_length:])
    return sorted(requests, key=lambda ids: (-len(ids), tuple(ids)))


def payload(model: str, prompt: list[int]) -> dict:
    """`LocalCompletionsAPI._create_payload(messages=[prompt], generate=False)` for one request (batch size 1)."""
    return {"model": model, "prompt": [prompt], "temperature": 0, "max_tokens": 1, "logprobs": 1,
            "seed": LM_EVAL_SEED, "echo": True}


def scored(response: dict) -> float:
    """One choice scored: the echoed prompt's log-probabilities are there (what lm-eval's `parse_logprobs` reads)."""
    (choice,) = response["choices"]
    if not choice["logprobs"]["token_logprobs"]:
        raise ValueError("no prompt log-probabilities in the response")
    return 1.0


def lm_eval_workload(model: str, tasks: list[list[dict]], encode: Callable[[str], list[int]],
                     max_length: int) -> Workload:
    bodies = [json.dumps(payload(model, prompt)).encode()
              for docs in tasks for prompt in loglikelihood_prompts(docs, encode, max_length)]
    return Workload("/v1/completions", bodies, JSON_HEADERS, unit="choices/s", work=scored)


def local_encoder(tokenizer_file: Path) -> Callable[[str], list[int]]:
    """The served GPT's own tokenizer file, read here (tokenizing thousands of texts over `/tokenize` would take
    longer than the case): `lm_eval_cases` checks it against the server's `/tokenize`."""
    from tokenizers import Tokenizer

    tokenizer = Tokenizer.from_file(str(tokenizer_file))
    return lambda text: tokenizer.encode(text, add_special_tokens=False).ids


def lm_eval_cases(servers: dict[str, ServiceProcess], model: str, text: str, starts: list[int],
                  tokenizer_file: Path, max_length: int) -> tuple[list[Case], dict]:
    """The cases on the prefix case's servers (`prefix.SERVERS`); RuntimeError when the local tokenizer does not
    give the server's ids (lm-eval's `/tokenize` request: `add_special_tokens` false) or too few documents."""
    import httpx

    docs = word_order_docs(text, starts, DOCS_PER_TASK * TASKS)
    if len(docs) < DOCS_PER_TASK:
        raise RuntimeError(f"only {len(docs)} documents could be cut from the text")
    encode = local_encoder(tokenizer_file)
    for sample in (docs[0]["context"], docs[0]["context"] + TARGET_DELIMITER + docs[0]["choices"][0]):
        try:
            response = httpx.post(f"{servers[ON].url}/tokenize", json={"prompt": sample, "add_special_tokens": False},
                                  timeout=30)
            response.raise_for_status()
        except httpx.HTTPError as error:
            raise RuntimeError(f"the server's /tokenize failed: {error}") from None
        if response.json()["tokens"] != encode(sample):
            raise RuntimeError("the served tokenizer's /tokenize ids differ from its tokenizer file's")
    tasks = [docs[i : i + DOCS_PER_TASK] for i in range(0, len(docs) - DOCS_PER_TASK + 1, DOCS_PER_TASK)]
    workload = lm_eval_workload(model, tasks, encode, max_length)
    lengths = [len(encode(d["context"])) for d in docs]
    info = {"documents": sum(len(t) for t in tasks), "tasks": len(tasks), "documents_per_task": DOCS_PER_TASK,
            "requests": len(workload.bodies), "context_tokens": {"min": min(lengths), "max": max(lengths),
                                                                 "mean": sum(lengths) / len(lengths)},
            "example": docs[0]}
    print(f"  lm-eval replay: {info['documents']} documents in {info['tasks']} tasks of {DOCS_PER_TASK}, "
          f"{info['requests']} requests; contexts of {info['context_tokens']['min']}-{info['context_tokens']['max']} "
          f"tokens (e.g. {docs[0]['context'][-40:]!r} + {docs[0]['choices'][0]!r})", flush=True)
    cases: list[Case] = [CountingCase(name, ENDPOINT, servers[server], workload, 1, model, counters=PREFIX_COUNTERS)
                         for name, server in ((ON_CASE, ON), (OFF_CASE, OFF))]
    return cases, info


def lm_eval_ratios() -> list[ABRatio]:
    return [ABRatio("lm-eval multiple choice cache on/off wall time", "time_per_request", ON_CASE, OFF_CASE, OPTION,
                    ("<=", 0.67))]
