"""Does a text version's tokenizer belong to its graphs? Checked when its engine is built, before calibration or
warm-up runs a token through it, so that a version assembled from another's files (a translation folder holding
the GPT's tokenizer.json, or the other way round) fails its load naming the mismatch instead of serving garbage.

What a kind's engine checks (`check_vocabulary`), each against the logits' last dimension of every decoder graph
it runs (the vocabulary the graphs score, the size of their tied embedding):
- the graphs' width equals config.json `architecture.vocab_size` (what the engine binds its buffers with);
- the tokenizer has no more ids than that width (it may have fewer: a tokenizer trained to a smaller vocabulary
  than the model's embedding, as `models.runs` allows; never more: an id past the embedding has no row);
- every special id the kind decodes with (config.json `special_tokens`: the translator's pad, bos and eos ids, the
  GPT's eos id) is one of the tokenizer's special tokens: a byte or a word at that id means the tokenizer was
  trained for another model, even when its size fits.
The image kind's vocabulary is its labels, checked against its outputs at warm-up (`service.models.warmup`).
"""

from __future__ import annotations

from collections.abc import Mapping

from service.engines import onnx_schema as schema


class VocabularyMismatch(ValueError):
    """A version whose tokenizer, config and graphs disagree on the vocabulary (the mismatch in the message)."""


def logits_width(session) -> int | None:
    """The last dimension of a graph's logits output: its vocabulary; None when the graph leaves it symbolic."""
    logits = next((o for o in session.get_outputs() if o.name == schema.LOGITS), None)
    width = logits.shape[-1] if logits is not None and logits.shape else None
    return width if isinstance(width, int) else None


def graphs_of(files: Mapping[str, str], decoder, in_place) -> dict[str, object]:
    """A text engine's decoder graphs by file name: its decoder session (None: it has none) and its in-place step
    graph's (`service.engines.iobinding.InPlaceStep`; None: it has none)."""
    graphs = {files.get("decoder"): decoder, files.get("decoder_step"): getattr(in_place, "session", None)}
    return {name: session for name, session in graphs.items() if session is not None}


def check_vocabulary(tokenizer, vocab_size: int, graphs: Mapping[str, object], special_ids: Mapping[str, int]
                     ) -> None:
    """Raise `VocabularyMismatch` unless the tokenizer, config.json's `architecture.vocab_size` and every graph in
    `graphs` (file name -> session) agree, and each of `special_ids` (config name -> id) is a special token of the
    tokenizer (the module docstring says why each)."""
    for name, session in graphs.items():
        width = logits_width(session)
        if width is not None and width != vocab_size:
            raise VocabularyMismatch(f"{name} scores {width} tokens (its logits' last dimension) but config.json "
                                     f"architecture.vocab_size is {vocab_size}")
    ids = tokenizer.get_vocab_size()
    if ids > vocab_size:
        raise VocabularyMismatch(f"tokenizer.json has {ids} ids but the model's graphs score {vocab_size} tokens: "
                                 f"ids from {vocab_size} on have no embedding; the tokenizer belongs to another model")
    specials = {i: token.content for i, token in tokenizer.get_added_tokens_decoder().items() if token.special}
    for field, token_id in special_ids.items():
        if token_id not in specials:
            found = ("does not exist" if not 0 <= token_id < ids
                     else f"is {tokenizer.id_to_token(token_id)!r}, not a special token")
            listed = ", ".join(f"{content} = {i}" for i, content in sorted(specials.items())) or "none"
            raise VocabularyMismatch(f"config.json special_tokens.{field} is {token_id}, but in tokenizer.json ({ids} "
                                     f"ids; special tokens: {listed}) that id {found}: the tokenizer belongs to "
                                     "another model")
