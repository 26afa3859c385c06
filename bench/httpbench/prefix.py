"""Issue 55's prefix-caching case (`--cases prefix`): the GPT alone on two servers, TSERVE_PREFIX_CACHE=true and
false (speculation off on both), `POST /v1/generate` streamed, greedy, lengths pinned (`min_new_tokens ==
max_new_tokens`: random weights never end a request early), every prompt cut from tinyshakespeare at a line start:

- `prefix hit c=1`: one 200-token prefix shared by every request, then 16 tokens of its own (a byte-level GPT: a
  character is a token) -> time to first token, 1 stream, on the cache-on server: 192 of its 216 tokens come from
  the cache (whole blocks of 16; the block that holds the prefix's last 8 tokens and the suffix's first 8 is new);
- `prefix miss c=1`: the same shape with a prefix never seen (its first block begins no other prompt of the run),
  on the cache-on server: the pass over all 216 tokens plus what the cache costs a miss (the lookup, keeping the
  new blocks);
- `prefix off c=1`: the hit case's requests on the cache-off server;
- `no-prefix on c=32` / `no-prefix off c=32`: 128-token prompts that share no block with any other (none of a run's
  prompts repeats within the cache's reach), 64 new tokens, 32 streams -> tokens/s with the cache on and off: what
  keeping blocks that are never found again costs (and, once the budget is full, evicting them).

Ratios, printed under the CPU: `prefix hit/miss 1 stream TTFT p50` (goal <= 0.3), `prefix hit/cache off 1 stream
TTFT p50`, `no shared prefix cache on/off 32 streams tokens/s` (goal >= 0.97), each with the share of prompt tokens
the server found cached in each case (`tserve_prefix_cache_hits_total` / `_queries_total`).
"""

from __future__ import annotations

import json
from pathlib import Path

from service.client.launcher import ServiceProcess
from service.engines.prefix_cache import BLOCK_TOKENS  # the cache's blocks: prompts must share none by chance

from .ab import PREFIX_COUNTERS, ABRatio, CountingCase, cached_share
from .cases import JSON_HEADERS, Case
from .load import Workload
from .servers import model_variant

OPTION = "prefix"
SERVERS = {"gpt-cache-on": {"TSERVE_PREFIX_CACHE": "true", "TSERVE_SPECULATION": "off"},
           "gpt-cache-off": {"TSERVE_PREFIX_CACHE": "false", "TSERVE_SPECULATION": "off"}}
ON, OFF = SERVERS
PREFIX_CHARS = 200  # the shared prefix (tokens: the GPT's tokens are bytes)
SUFFIX_CHARS = 16  # each request's own end
TTFT_NEW_TOKENS = 8  # TTFT is the figure: short requests, more of them
TTFT_PROMPTS = 2048  # distinct suffixes (and fresh prefixes): more than a run sends at 1 stream
NO_PREFIX_CHARS = 128
NO_PREFIX_NEW_TOKENS = 64
NO_PREFIX_PROMPTS = 4096  # more than a run sends at 32 streams; far more than a 256 MB cache holds
NO_PREFIX_STREAMS = 32
HIT, MISS, HIT_OFF = "prefix hit c=1", "prefix miss c=1", "prefix off c=1"
NO_PREFIX_ON, NO_PREFIX_OFF = f"no-prefix on c={NO_PREFIX_STREAMS}", f"no-prefix off c={NO_PREFIX_STREAMS}"


def shakespeare_text(data_dir: Path) -> str:
    """The whole of tinyshakespeare (training then validation text): the prompts of issue 55's cases are cut from it."""
    from models.data import load_shakespeare

    train, val = load_shakespeare(data_dir)
    return train + val


def generate_body(prompt: str, new_tokens: int) -> bytes:
    """A streamed greedy `/v1/generate` request of exactly `new_tokens` tokens."""
    return json.dumps({"prompt": prompt, "max_new_tokens": new_tokens, "min_new_tokens": new_tokens,
                       "temperature": 0, "stream": True}).encode()


def ttft_prompts(text: str, starts: list[int], count: int = TTFT_PROMPTS, prefix_chars: int = PREFIX_CHARS,
                 suffix_chars: int = SUFFIX_CHARS, block: int = BLOCK_TOKENS) -> tuple[list[str], list[str]]:
    """(shared, fresh): `count` prompts of the shared prefix (cut at `starts[0]`) each with its own suffix, and as
    many of the same suffixes after a prefix of their own, of the same length. `starts`: `ab.block_starts`' (no two
    begin alike). The suffixes are cut at the next starts whose first characters up to the end of the block that
    the prefix's last characters begin are new, so that a hit covers the prefix's whole blocks and no more (192 of
    200 tokens: the 13th block, 8 tokens of the prefix and 8 of the suffix, is computed every time); the fresh
    prefixes at the starts after the suffixes'."""
    shared_block = block - prefix_chars % block  # the suffix's characters in the block the prefix's end is in
    prefix = text[starts[0] : starts[0] + prefix_chars]
    suffixes, seen, position = [], set(), 1
    while len(suffixes) < count and position < len(starts):
        start = starts[position]
        position += 1
        if text[start : start + shared_block] not in seen:
            seen.add(text[start : start + shared_block])
            suffixes.append(text[start : start + suffix_chars])
    fresh = [text[s : s + prefix_chars] for s in starts[position : position + count]]
    if len(suffixes) < count or len(fresh) < count:
        raise ValueError(f"{len(starts)} line starts give {len(suffixes)} suffixes and {len(fresh)} fresh prefixes: "
                         f"the prefix case needs {count} of each")
    return [prefix + suffix for suffix in suffixes], [own + suffix for own, suffix in zip(fresh, suffixes)]


def no_prefix_prompts(text: str, starts: list[int], count: int = NO_PREFIX_PROMPTS,
                      chars: int = NO_PREFIX_CHARS) -> list[str]:
    """`count` prompts of `chars` characters, one at each of the first `count` starts: no two share a block."""
    if len(starts) < count:
        raise ValueError(f"{len(starts)} line starts: the no-prefix workload needs {count}")
    return [text[s : s + chars] for s in starts[:count]]


def workload(prompts: list[str], new_tokens: int, usage_tokens: bool = False) -> Workload:
    """The prompts as streamed greedy requests of `new_tokens` tokens; `usage_tokens`: work counted from each stream's
    usage (`load.Workload`)."""
    return Workload("/v1/generate", [generate_body(p, new_tokens) for p in prompts], JSON_HEADERS, stream=True,
                    unit="tokens/s", usage_tokens=usage_tokens)


def prefix_cases(servers: dict[str, ServiceProcess], model: str, text: str, ttft_starts: list[int],
                 no_prefix_starts: list[int]) -> tuple[list[Case], dict]:
    """The cases on the two servers (`SERVERS`), and what the report keeps of them: each server's prefix cache as
    `/v1/models` reports it (a server whose cache is off for a reason of its own, e.g. `suffix_exact` failing on
    this host, is named), and the workloads' shapes."""
    shared, fresh = ttft_prompts(text, ttft_starts)
    no_prefix = no_prefix_prompts(text, no_prefix_starts)
    on, off = servers[ON], servers[OFF]
    endpoint = "POST /v1/generate (stream, greedy, pinned lengths)"
    cases: list[Case] = [
        CountingCase(HIT, endpoint, on, workload(shared, TTFT_NEW_TOKENS), 1, model, counters=PREFIX_COUNTERS),
        CountingCase(MISS, endpoint, on, workload(fresh, TTFT_NEW_TOKENS), 1, model, counters=PREFIX_COUNTERS),
        CountingCase(HIT_OFF, endpoint, off, workload(shared, TTFT_NEW_TOKENS), 1, model, counters=PREFIX_COUNTERS),
    ]
    no_prefix_workload = workload(no_prefix, NO_PREFIX_NEW_TOKENS)
    cases += [CountingCase(name, endpoint, server, no_prefix_workload, NO_PREFIX_STREAMS, model,
                           counters=PREFIX_COUNTERS)
              for name, server in ((NO_PREFIX_ON, on), (NO_PREFIX_OFF, off))]
    info = {"servers": {name: {"env": SERVERS[name], "variant": model_variant(servers[name].url, model)}
                        for name in SERVERS},
            "ttft": {"prefix_tokens": PREFIX_CHARS, "suffix_tokens": SUFFIX_CHARS, "new_tokens": TTFT_NEW_TOKENS,
                     "prompts": len(shared), "example": shared[0]},
            "no_prefix": {"prompt_tokens": NO_PREFIX_CHARS, "new_tokens": NO_PREFIX_NEW_TOKENS,
                          "prompts": len(no_prefix), "streams": NO_PREFIX_STREAMS}}
    for name, server in info["servers"].items():
        cache = server["variant"].get("prefix_caching") or {}
        print(f"  {name}: prefix cache {server['variant'].get('prefix_cache', 'not reported')}"
              + (f" ({cache['reason']})" if cache.get("reason") else "")
              + (f", budget {int(cache['budget_bytes']) >> 20} MiB" if cache.get("budget_bytes", "0") != "0" else ""),
              flush=True)
    if info["servers"][ON]["variant"].get("prefix_cache") == "off":
        print(f"  warning: {ON}'s prefix cache is off: the prefix ratios measure nothing", flush=True)
    return cases, info


def prefix_ratios() -> list[ABRatio]:
    return [ABRatio("prefix hit/miss 1 stream TTFT p50", "ttft_p50", HIT, MISS, OPTION, ("<=", 0.3)),
            ABRatio("prefix hit/cache off 1 stream TTFT p50", "ttft_p50", HIT, HIT_OFF, OPTION),
            ABRatio(f"no shared prefix cache on/off {NO_PREFIX_STREAMS} streams tokens/s", "throughput", NO_PREFIX_ON,
                    NO_PREFIX_OFF, OPTION, (">=", 0.97))]


def annotate(rows: list[dict], cases: list[dict]) -> list[dict]:
    """Each row's note: the share of prompt tokens found in the cache in each of its cases."""
    by_case = {c["case"]: c for c in cases}
    for row in rows:
        shares = [cached_share(by_case.get(row[side])) for side in ("numerator", "denominator")]
        if row["value"] is not None and any(share is not None for share in shares):
            row["notes"].append("prompt tokens cached " + " vs ".join(
                "n/a" if share is None else f"{share:.0%}" for share in shares))
        row["cached_shares"] = shares
    return rows
