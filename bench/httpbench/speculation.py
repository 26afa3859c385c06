"""Issue 55's speculation case (`--cases speculation`): the GPT alone on two servers, TSERVE_SPECULATION=ngram and
off, `POST /v1/generate` streamed, greedy, exactly `NEW_TOKENS` tokens a request (`min_new_tokens`) -> tokens/s:

- `spec copy on|off c=1`: copy-heavy prompts, whose continuation repeats text of the prompt, 1 stream (goal >= 1.5);
- `spec open on|off c=1`: open continuations of tinyshakespeare, the gpt case's prompts, 1 stream (goal >= 0.95);
- `spec open on|off c=32`: the same at 32 streams (goal >= 0.98; the service stops speculating above
  TSERVE_SPECULATION_MAX_ROWS rows, so this measures what that switch leaves).

Tokens are counted from each stream's final `usage` (a speculative step streams the tokens it keeps as one event);
the time to first token is the first event's.

The weights matter here (what is accepted is what the model predicts): these servers serve the release GPT
(model_repository/gpt, trained on tinyshakespeare) unless --repository names another, never the random weights of
the other cases. The release GPT does not copy text it is shown (a passage given twice or three times is not
continued with a third copy: checked on gpt/4), but its greedy continuations fall into loops of their own
("GRUMIO:\\nI will be so.\\n\\nGRUMIO:\\nI will be so..."). So a copy-heavy prompt is made of one: a candidate prompt
(the gpt case's: `PROMPT` characters of the validation text) and the first `COPY_PREFIX` tokens of its own greedy
continuation, kept when prompt lookup predicts at least `MIN_LOOKUP` of the next `NEW_TOKENS` tokens of that
continuation, and kept again when the server's greedy continuation of the copy prompt itself is as predictable
(`lookup_rate`: at each position, the token after the latest earlier occurrence of the longest 4- to 8-gram that
ends the text so far, the n-gram drafter's rule; a byte-level GPT: a character is a token). Both checks run on the
speculation-off server before anything is timed, and are printed.

Speculation verifies drafts over float KV caches only (`GPTEngine.speculates`): where the variant the host is served
quantises the KV cache (`+kv8`), both servers run the same variant without it (`+gqa`), printed, unless
--speculation-variant names one. A case whose server drafted nothing says so beside its ratio (from
`tserve_spec_decode_num_draft_tokens_total`, with the acceptance rate).
"""

from __future__ import annotations

from collections.abc import Sequence

from service.client.launcher import ServiceProcess

from .ab import SPEC_COUNTERS, ABRatio, CountingCase, acceptance, post_all
from .cases import Case
from .prefix import workload

OPTION = "speculation"
SERVERS = {"gpt-spec-on": {"TSERVE_SPECULATION": "ngram"}, "gpt-spec-off": {"TSERVE_SPECULATION": "off"}}
ON, OFF = SERVERS
CANDIDATES = 128  # candidate prompts (the gpt case's kind), screened for copy-heavy ones
COPY_PREFIX = 96  # tokens of a candidate's own continuation appended to it to make a copy-heavy prompt
NEW_TOKENS = 96  # tokens generated per request in every speculation case
MIN_LOOKUP = 0.8  # share of a continuation's tokens prompt lookup must predict for a copy-heavy prompt
MIN_N, MAX_N = 4, 8  # the n-grams looked up (service.decoding.ngram_draft's defaults)
MANY_STREAMS = 32
ENDPOINT = "POST /v1/generate (stream, greedy, pinned lengths)"


def case_name(kind: str, on: bool, streams: int) -> str:
    return f"spec {kind} {'on' if on else 'off'} c={streams}"


def lookup_rate(context: Sequence, continuation: Sequence, min_n: int = MIN_N, max_n: int = MAX_N) -> float:
    """The share of `continuation`'s tokens that prompt lookup predicts, one at a time: at each position, the
    token after the latest earlier occurrence of the longest n-gram (`min_n` <= n <= `max_n`) that ends the
    sequence so far (`context` and the continuation before it); no prediction when none occurred before."""
    if not continuation:
        return 0.0
    sequence = list(context)
    latest: dict[tuple, int] = {}  # n-gram -> where its latest occurrence ends, for those ending before the last

    def index(end: int) -> None:
        for n in range(min_n, min(max_n, end + 1) + 1):
            latest[tuple(sequence[end - n + 1 : end + 1])] = end

    for end in range(len(sequence) - 1):
        index(end)
    hits = 0
    for token in continuation:
        guess = None
        for n in range(min(max_n, len(sequence) - 1), min_n - 1, -1):
            end = latest.get(tuple(sequence[-n:]))
            if end is not None:
                guess = sequence[end + 1]
                break
        hits += guess == token
        if sequence:
            index(len(sequence) - 1)
        sequence.append(token)
    return hits / len(continuation)


def copy_prompts(prompts: Sequence[str], continuations: Sequence[str | None], prefix: int = COPY_PREFIX,
                 new_tokens: int = NEW_TOKENS, min_rate: float = MIN_LOOKUP) -> list[tuple[str, float]]:
    """(copy-heavy prompt, lookup rate) for each prompt whose continuation (of at least `prefix + new_tokens`
    tokens; None: its request failed) goes on, after its first `prefix` tokens, as prompt lookup predicts at
    `min_rate` or more: the prompt is the candidate and those `prefix` tokens."""
    kept = []
    for prompt, continuation in zip(prompts, continuations):
        if continuation is None or len(continuation) < prefix + new_tokens:
            continue
        copy = prompt + continuation[:prefix]
        rate = lookup_rate(copy, continuation[prefix : prefix + new_tokens])
        if rate >= min_rate:
            kept.append((copy, rate))
    return kept


def speculation_variant(pins: str | None, model: str, override: str | None) -> tuple[str | None, str]:
    """The TSERVE_VARIANT both speculation servers get (None: --server-env's, as the other servers) and why:
    `override` for `model` when given; else the variant pinned for it with `+kv8` dropped when it has one
    (speculation verifies float KV caches only); else as pinned."""
    from service.engines.weights import VARIANT_SEPARATOR, quantizes_kv_cache, split_variant
    from service.models.variants import AUTO, STORED, parse_pins, pin_for

    if override:
        return f"{model}={override}", f"{override} (--speculation-variant)"
    pin = pin_for(parse_pins(pins or ""), model)
    if pin not in (AUTO, STORED) and quantizes_kv_cache(pin):
        weights, attention = split_variant(pin)
        plain = f"{weights}{VARIANT_SEPARATOR}{attention.split(VARIANT_SEPARATOR)[0]}"
        return f"{model}={plain}", (f"{plain} (the host is served {pin}, whose int8 KV cache speculation does not "
                                    "verify: both servers run it without +kv8)")
    return None, f"{pin} (as the other servers)"


def _texts(answers: list[dict | None]) -> list[str | None]:
    return [None if a is None else a.get("text") for a in answers]


def _generate(prompt: str, new_tokens: int) -> dict:
    return {"prompt": prompt, "max_new_tokens": new_tokens, "min_new_tokens": new_tokens, "temperature": 0}


def screen(server: ServiceProcess, candidates: list[str]) -> tuple[list[str], dict]:
    """The copy-heavy prompts (see the module), made and checked on `server` (speculation off), and what the report
    keeps: how many, their lookup rates, and the open continuations' for comparison. RuntimeError when none."""
    first = _texts(post_all(server, "/v1/generate",
                            [_generate(p, COPY_PREFIX + NEW_TOKENS) for p in candidates]))
    chosen = copy_prompts(candidates, first)
    open_rates = [lookup_rate(p, text[:NEW_TOKENS]) for p, text in zip(candidates, first) if text]
    again = _texts(post_all(server, "/v1/generate", [_generate(copy, NEW_TOKENS) for copy, _ in chosen]))
    checked = [(copy, lookup_rate(copy, text)) for (copy, _), text in zip(chosen, again)
               if text is not None and len(text) >= NEW_TOKENS]
    kept = [(copy, rate) for copy, rate in checked if rate >= MIN_LOOKUP]
    info = {"candidates": len(candidates), "made": len(chosen), "kept": len(kept),
            "copy_lookup_rate": sum(r for _, r in kept) / len(kept) if kept else None,
            "open_lookup_rate": sum(open_rates) / len(open_rates) if open_rates else None,
            "example": kept[0][0] if kept else None}
    print(f"  copy-heavy prompts: {len(kept)} of {len(candidates)} candidates (each with {COPY_PREFIX} tokens of its "
          f"own greedy continuation, kept where prompt lookup predicts >= {MIN_LOOKUP:.0%} of the next "
          f"{NEW_TOKENS}; {len(chosen)} made, {len(kept)} still so when continued by the server)", flush=True)
    if kept:
        print(f"    prompt lookup predicts {info['copy_lookup_rate']:.0%} of their continuations' tokens, "
              f"{info['open_lookup_rate']:.0%} of the open continuations'; e.g. ...{kept[0][0][-60:]!r}", flush=True)
    else:
        raise RuntimeError("no copy-heavy prompt found (no candidate's continuation repeats its text)")
    return [copy for copy, _ in kept], info


def speculation_cases(servers: dict[str, ServiceProcess], model: str, copy: list[str], candidates: list[str]
                      ) -> list[Case]:
    cases: list[Case] = []
    for kind, prompts, streams in (("copy", copy, 1), ("open", candidates, 1), ("open", candidates, MANY_STREAMS)):
        load = workload(prompts, NEW_TOKENS, usage_tokens=True)  # a speculative step streams its tokens in one event
        for on in (True, False):
            cases.append(CountingCase(case_name(kind, on, streams), ENDPOINT, servers[ON if on else OFF], load,
                                      streams, model, counters=SPEC_COUNTERS))
    return cases


def speculation_ratios() -> list[ABRatio]:
    return [ABRatio("speculation on/off copy-heavy 1 stream tokens/s", "throughput", case_name("copy", True, 1),
                    case_name("copy", False, 1), OPTION, (">=", 1.5)),
            ABRatio("speculation on/off open 1 stream tokens/s", "throughput", case_name("open", True, 1),
                    case_name("open", False, 1), OPTION, (">=", 0.95)),
            ABRatio(f"speculation on/off open {MANY_STREAMS} streams tokens/s", "throughput",
                    case_name("open", True, MANY_STREAMS), case_name("open", False, MANY_STREAMS), OPTION,
                    (">=", 0.98))]


def annotate(rows: list[dict], cases: list[dict]) -> list[dict]:
    """Each row's note: the on server's draft tokens and acceptance rate in its case (and the off server's drafts,
    which must be none)."""
    by_case = {c["case"]: c for c in cases}
    for row in rows:
        drafted, rate = acceptance(by_case.get(row["numerator"]))
        off_drafted, _ = acceptance(by_case.get(row["denominator"]))
        row["draft_tokens"], row["acceptance"] = drafted, rate
        if row["value"] is None:
            continue
        row["notes"].append(f"{drafted:,.0f} draft tokens, {rate:.0%} accepted" if rate is not None else
                            "the on server drafted nothing")
        if off_drafted:
            row["notes"].append(f"the off server drafted {off_drafted:,.0f} tokens")
    return rows

