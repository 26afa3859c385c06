"""Translate with the PyTorch model and the project's decoding strategies (for evaluation and as a reference).

The encoder runs once per batch of sentences; each sentence's cross-attention keys/values are computed once and
rows (beams) point at their sentence by index. The decoder runs one token per step over a KV cache whose rows
are re-selected by the searches' `parents` (beam reordering and dropping finished rows are the same operation).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from tokenizers import Tokenizer
from tqdm import tqdm

from models.transformer import EncoderDecoderTransformer
from models.tasks.translation import pad
from service.decoding import BeamSearch, GreedySearch, Search, run_search


def default_max_new_tokens(source_length: int, max_positions: int) -> int:
    """Room for a translation: twice the source plus 10 tokens, within the positional table."""
    return min(2 * source_length + 10, max_positions - 1)


def make_search(num_beams: int, max_new_tokens: int, eos_id: int, **beam_options) -> Search:
    if num_beams == 1 and not beam_options.get("num_return_sequences", 1) > 1:
        return GreedySearch(max_new_tokens=max_new_tokens, eos_token_id=eos_id)
    return BeamSearch(num_beams=num_beams, max_new_tokens=max_new_tokens, eos_token_id=eos_id, **beam_options)


@torch.no_grad()
def translate_ids(model: EncoderDecoderTransformer, sources: Sequence[list[int]], num_beams: int = 1,
                  searches: Sequence[Search] | None = None, **beam_options) -> list[Search]:
    """Decode a batch of source id lists (EOS included); returns the finished searches (n-best in `results()`):
    `searches`, one per source, or made from `num_beams` and `beam_options` with the default room."""
    config = model.config
    src, src_mask = pad(sources, config.pad_id)  # (B, S)
    cross = model.cross_attention_kv(model.encode(src, src_mask))  # per layer (B, H, S, Dh)
    B = len(sources)
    if searches is None:
        searches = [make_search(num_beams, default_max_new_tokens(len(s), config.max_positions), config.eos_id,
                                **beam_options) for s in sources]
    searches = list(searches)

    start = torch.full((B, 1), config.bos_id, dtype=torch.long)
    logits, past = model.decode_step(start, torch.zeros_like(start), torch.ones(B, 1, dtype=torch.bool), cross,
                                     src_mask)
    sentence_of_row = torch.arange(B)  # which source sentence each cache row decodes
    length = 1  # target tokens in the cache, the same for every row

    def step(tokens, parents):
        nonlocal past, sentence_of_row, length
        parents_t = torch.from_numpy(parents)
        past = [(k[parents_t], v[parents_t]) for k, v in past]
        sentence_of_row = sentence_of_row[parents_t]
        rows_cross = [(k[sentence_of_row], v[sentence_of_row]) for k, v in cross]
        R = len(parents)
        new = torch.from_numpy(tokens).view(R, 1)
        positions = torch.full((R, 1), length, dtype=torch.long)
        out, past = model.decode_step(new, positions, torch.ones(R, length + 1, dtype=torch.bool), rows_cross,
                                      src_mask[sentence_of_row], past)
        length += 1
        return out[:, -1].float().numpy()

    run_search(searches, [row for row in logits[:, -1].float().numpy()], step)
    return searches


def translate(model: EncoderDecoderTransformer, tokenizer: Tokenizer, sentences: Sequence[str], num_beams: int = 1,
              batch_size: int = 64, progress: bool = False, **beam_options) -> list[str]:
    """German sentences -> best English translation of each."""
    config = model.config
    limit = config.max_positions - 1
    sources = [enc.ids[:limit] + [config.eos_id] for enc in tokenizer.encode_batch(list(sentences))]
    order = sorted(range(len(sources)), key=lambda i: len(sources[i]))  # similar lengths share a batch
    outputs: list[str] = [""] * len(sources)
    for begin in tqdm(range(0, len(order), batch_size), disable=not progress, desc=f"translate beam={num_beams}",
                      leave=False):
        chunk = order[begin : begin + batch_size]
        for i, search in zip(chunk, translate_ids(model, [sources[i] for i in chunk], num_beams, **beam_options)):
            outputs[i] = tokenizer.decode(search.results()[0].tokens)
    return outputs
