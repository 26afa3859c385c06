"""Tokenizers, built with the Hugging Face ``tokenizers`` library only.

The serving side loads the saved ``tokenizer.json`` with ``tokenizers.Tokenizer.from_file`` alone, so everything
(normaliser, pre-tokenizer, model, decoder, special tokens) lives in that file; no custom code is needed to use it.

- Translation: a joint German/English BPE (NFKC, Metaspace). Ids 0-3 are ``<pad> <s> </s> <unk>``. Encoding adds
  no BOS/EOS (there is no post-processor); the model code adds them explicitly.
  ``decode(encode(s).ids) == s`` for NFKC-normal text made of characters the tokenizer knows, with single spaces
  between words and no leading space. Known limits: NFKC rewrites some characters (``\\xa0`` -> space, ``…`` ->
  ``...``); a leading space is dropped; a literal ``▁`` decodes as a space; unknown characters become ``<unk>``,
  which ``decode`` skips by default. Printable ASCII, German umlauts and typographic quotes are always in the vocab.
- GPT: a byte-level tokenizer. Ids 0..255 are the bytes 0..255, id 256 is ``<|endoftext|>``. Lossless for any
  unicode string; ASCII text gives one token per character. A literal ``<|endoftext|>`` in the input is encoded as
  the special token, and ``decode`` drops it unless called with ``skip_special_tokens=False``.
"""

from __future__ import annotations

import os
import string
from collections.abc import Iterable
from pathlib import Path

from tokenizers import Tokenizer, decoders, models, normalizers, pre_tokenizers, trainers

PAD, BOS, EOS, UNK = "<pad>", "<s>", "</s>", "<unk>"
PAD_ID, BOS_ID, EOS_ID, UNK_ID = 0, 1, 2, 3
SPECIAL_TOKENS = (PAD, BOS, EOS, UNK)  # in id order

ENDOFTEXT = "<|endoftext|>"
ENDOFTEXT_ID = 256
BYTE_VOCAB_SIZE = 257

METASPACE = "\u2581"  # "▁"
# Characters always in the translation vocab, so they never become <unk> even if rare in the training text.
_INITIAL_ALPHABET = sorted(
    set(string.ascii_letters + string.digits + string.punctuation)
    | set("äöüÄÖÜßàáâèéêëìíîïòóôùúûñçÀÁÂÈÉÊÇÑ")
    | set("„“”‚‘’«»–—€°§")
    | {METASPACE}
)


def train_translation_tokenizer(
    sentences: Iterable[str], vocab_size: int, *, min_frequency: int = 2
) -> Tokenizer:
    """Train a joint German/English BPE tokenizer on ``sentences``; special tokens get ids 0-3."""
    tok = Tokenizer(models.BPE(unk_token=UNK, fuse_unk=True))
    tok.normalizer = normalizers.NFKC()
    tok.pre_tokenizer = pre_tokenizers.Metaspace(replacement=METASPACE, prepend_scheme="always", split=True)
    tok.decoder = decoders.Metaspace(replacement=METASPACE, prepend_scheme="always", split=True)
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        min_frequency=min_frequency,
        special_tokens=list(SPECIAL_TOKENS),
        initial_alphabet=_INITIAL_ALPHABET,
        show_progress=False,
    )
    tok.train_from_iterator(sentences, trainer=trainer)
    ids = [tok.token_to_id(t) for t in SPECIAL_TOKENS]
    if ids != [PAD_ID, BOS_ID, EOS_ID, UNK_ID]:
        raise RuntimeError(f"special tokens {SPECIAL_TOKENS} got ids {ids}, expected 0-3")
    return tok


def _bytes_to_unicode() -> dict[int, str]:
    """GPT-2's byte -> printable unicode character table (the alphabet of the ByteLevel pre-tokenizer)."""
    printable = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) + list(
        range(ord("®"), ord("ÿ") + 1)
    )
    table, extra = {}, 0
    for b in range(256):
        if b in printable:
            table[b] = chr(b)
        else:
            table[b] = chr(256 + extra)
            extra += 1
    return table


def build_byte_tokenizer() -> Tokenizer:
    """Byte-level tokenizer: ids 0..255 are the bytes, id 256 is ``<|endoftext|>``. No training needed."""
    vocab = {char: byte for byte, char in _bytes_to_unicode().items()}
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    tok.decoder = decoders.ByteLevel()
    tok.add_special_tokens([ENDOFTEXT])
    if tok.token_to_id(ENDOFTEXT) != ENDOFTEXT_ID or tok.get_vocab_size() != BYTE_VOCAB_SIZE:
        raise RuntimeError("byte tokenizer layout changed (tokenizers version?)")
    return tok


def save_tokenizer(tok: Tokenizer, path: str | os.PathLike) -> Path:
    """Write ``tok`` as a single ``tokenizer.json``-style file (parent folders are created)."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tok.save(str(path))
    return path


def load_tokenizer(path: str | os.PathLike) -> Tokenizer:
    """Load a tokenizer saved by :func:`save_tokenizer` (same as ``Tokenizer.from_file``)."""
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"tokenizer file not found: {path} (expected a tokenizer.json written at training)")
    try:
        return Tokenizer.from_file(str(path))
    except Exception as e:  # tokenizers raises a bare Exception for malformed json
        raise ValueError(f"cannot load tokenizer from {path}: {e}") from e


def encode_batch(tok: Tokenizer, texts: Iterable[str]) -> list[list[int]]:
    """Token ids for each text (no BOS/EOS added)."""
    return [enc.ids for enc in tok.encode_batch(list(texts))]
