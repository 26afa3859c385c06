"""The GPT's prompt pass with a prefix cache (`service.engines.prefix_cache`): each prompt starts from its longest
cached prefix, rows that hit as many blocks run one pass over their suffixes after those blocks' K/V, and the
rows' K/V are laid out as one pass over the whole prompts would leave them (right-padded, slot t = position t).

Rows are grouped by hit length so that every row of a pass has the same past: a row is then computed exactly as
alone (the same property that makes a right-padded prompt pass batch-invariant). `suffix_exact` checks at load
that a suffix pass gives this host's whole-prompt numbers bit for bit; the engine keeps no cache if it does not.
"""

from __future__ import annotations

from collections.abc import Callable, Collection, Sequence
from dataclasses import dataclass

import numpy as np

from service.engines.prefix_cache import BLOCK_TOKENS, MIN_SUFFIX_TOKENS, Block, PrefixCache, logits_of, past_of

# One pass of the prompt graph: (prompts, past K/V of as many slots for every row, or None) -> (logits (rows,
# longest, V), presents (flat, (rows, heads, past + longest, head_dim)))
PromptPass = Callable[[Sequence[Sequence[int]], "list[np.ndarray] | None"], "tuple[np.ndarray, list[np.ndarray]]"]

CHECK_SEED = 20261206
# the prompt lengths of the load-time check, in blocks and tokens after them: a two-token suffix (the shortest a
# hit leaves) and a longer one, after one and two blocks, in one batch with a row of another length
CHECK_SPLITS = ((1, MIN_SUFFIX_TOKENS), (2, 7))


@dataclass
class Prefilled:
    """Every prompt's next-token logits (rows, V), the presents of all rows laid out as one whole pass (flat), the
    slot mask (rows, slots), the rows' lengths, the logits at every position of the rows asked for, and how many
    of each prompt's tokens came from the cache."""

    last: np.ndarray
    presents: list[np.ndarray]
    mask: np.ndarray
    lengths: np.ndarray
    every: dict[int, np.ndarray]
    cached_tokens: list[int]


def prefill_with_cache(prompts: Sequence[Sequence[int]], rows: Collection[int], run: PromptPass,
                       cache: PrefixCache | None) -> Prefilled:
    """The prompt pass of `prompts` over `cache`: one `run` per distinct hit length; every computed whole block
    goes into the cache. Without a cache: one `run` over every prompt (its presents may be a device's OrtValues)."""
    # pinned: no block is evicted while this pass reads it
    chains = [cache.match(prompt) for prompt in prompts] if cache is not None else [[] for _ in prompts]
    try:
        last, every, parts = _passes(prompts, rows, run, cache, chains)
    finally:
        if cache is not None:
            cache.release(chains)
    lengths = np.array([len(p) for p in prompts], np.int64)
    slots = int(lengths.max())  # every pass's presents (past and new) end at its longest prompt
    if len(parts) == 1:
        presents = parts[0][1]  # one pass (over every row, in order): its presents as they are
    else:
        presents = _laid_out(parts, len(prompts), slots)
    mask = (np.arange(slots) < lengths[:, None]).astype(np.int64)
    return Prefilled(last, presents, mask, lengths, every, [len(c) * BLOCK_TOKENS for c in chains])


def _passes(prompts: Sequence[Sequence[int]], rows: Collection[int], run: PromptPass, cache: PrefixCache | None,
            chains: list[list[Block]]) -> tuple[np.ndarray, dict[int, np.ndarray], list]:
    """One `run` per distinct hit length, misses first -> the next-token logits, the logits at every position of
    `rows`, and each pass's (rows, presents); every whole block computed goes into `cache`, if any."""
    groups: dict[int, list[int]] = {}
    for row, chain in enumerate(chains):
        groups.setdefault(len(chain), []).append(row)
    last = None
    every: dict[int, np.ndarray] = {}
    parts = []
    for blocks, members in sorted(groups.items()):
        start = blocks * BLOCK_TOKENS
        past = past_of([chains[r] for r in members]) if blocks else None
        logits, presents = run([prompts[r][start:] for r in members], past)
        if last is None:
            last = np.empty((len(prompts), logits.shape[2]), logits.dtype)
        for index, row in enumerate(members):
            computed = logits[index, : len(prompts[row]) - start]
            last[row] = computed[-1]
            if row in rows:
                every[row] = np.concatenate([logits_of(chains[row]), computed]) if blocks else computed.copy()
            if cache is not None:
                cache.insert(prompts[row], presents, computed, index, start_block=blocks, known=chains[row])
        parts.append((members, presents))
    return last, every, parts


def _laid_out(parts: list[tuple[list[int], list[np.ndarray]]], rows: int, slots: int) -> list[np.ndarray]:
    """The passes' presents as one array per layer and kind: each pass's rows at their prompt's index, slots from
    0, zero after each row's (masked: a masked slot's content is never read)."""
    reference = parts[0][1]
    out = []
    for index in range(len(reference)):
        heads, head_dim = reference[index].shape[1], reference[index].shape[3]
        array = np.zeros((rows, heads, slots, head_dim), reference[index].dtype)
        for members, presents in parts:
            width = min(slots, presents[index].shape[2])
            array[members, :, :width] = presents[index][:, :, :width]
        out.append(array)
    return out


def suffix_exact(run: PromptPass, vocab_size: int, context_length: int) -> str | None:
    """None when a pass over suffixes after a cached prefix gives this host's whole-prompt pass's logits and K/V
    bit for bit (rows of two lengths in one batch; the suffix lengths a hit leaves); otherwise why not."""
    rng = np.random.default_rng(CHECK_SEED)
    for blocks, suffix in CHECK_SPLITS:
        start = blocks * BLOCK_TOKENS
        if start + suffix + 1 > context_length:
            continue
        prompts = [rng.integers(1, vocab_size, start + suffix).tolist(),
                   rng.integers(1, vocab_size, start + suffix + 1).tolist()]
        whole_logits, whole = run(prompts, None)
        _, prefix = run([p[:start] for p in prompts], None)
        logits, presents = run([p[start:] for p in prompts], [p[:, :, :start] for p in prefix])
        gap = 0.0
        for row, prompt in enumerate(prompts):
            length = len(prompt)
            gap = max(gap, float(np.abs(whole_logits[row, start:length] - logits[row, : length - start]).max()),
                      *(float(np.abs(w[row, :, :length] - p[row, :, :length]).max()) for w, p in zip(whole, presents)))
        if gap != 0:
            return (f"a prompt pass over a {suffix}-token suffix after {start} cached tokens differs from the whole "
                    f"prompt's on this host (max |difference| {gap:.3g}): cached prefixes would change outputs")
    return None
