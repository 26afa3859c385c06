"""Generate with the PyTorch GPT and the project's decoding strategies (the reference the ONNX engine must match).

Prompts are left-padded into one batch with explicit positions and a slot mask, run once (prefill), then one token
per step over the model's KV cache, whose rows follow the searches' `parents`.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch

from models.gpt import GPT
from service.decoding import Search, run_search


@torch.no_grad()
def generate_ids(model: GPT, prompts: Sequence[Sequence[int]], make_search: Callable[[int], Search]) -> list[Search]:
    B, longest = len(prompts), max(len(p) for p in prompts)
    ids = torch.zeros(B, longest, dtype=torch.long)
    mask = torch.zeros(B, longest, dtype=torch.bool)
    positions = torch.zeros(B, longest, dtype=torch.long)
    for row, prompt in enumerate(prompts):
        n = len(prompt)
        ids[row, longest - n :] = torch.tensor(list(prompt))
        mask[row, longest - n :] = True
        positions[row, longest - n :] = torch.arange(n)
    logits, past = model(ids, positions, mask)
    next_position = torch.tensor([len(p) for p in prompts])
    searches = [make_search(i) for i in range(B)]

    def step(tokens, parents):
        nonlocal past, mask, next_position
        rows = torch.from_numpy(parents)
        past = [(k[rows], v[rows]) for k, v in past]
        mask = torch.cat([mask[rows], torch.ones(len(rows), 1, dtype=torch.bool)], dim=1)
        next_position = next_position[rows]
        out, past = model(torch.from_numpy(tokens).view(-1, 1), next_position.view(-1, 1), mask, past)
        next_position = next_position + 1
        return out[:, -1].float().numpy()

    run_search(searches, list(logits[:, -1].float().numpy()), step)
    return searches
