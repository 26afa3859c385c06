"""Incremental detokenisation: one row's text grows token by token, each token decoded once (O(1) per token).

After TGI's ``decode_token(all_input_ids, prefix_offset, read_offset)`` (and `tokenizers`' ``DecodeStream``, the
same algorithm in Rust): the text of the tokens from ``prefix_offset`` is decoded with and without the newest
tokens, and the difference is the new text, released only once it does not end in U+FFFD (a byte-level token may
end inside a multi-byte character: it is held until the character is complete). Decoding a short window rather
than each token alone keeps what depends on the neighbouring tokens (a leading space, a merged character) right.
``decode`` is any ``ids -> str`` (a `tokenizers.Tokenizer`'s ``decode``, which skips special tokens): decoding
never imports a tokenizer itself. `StopStrings`, the streams and OpenAI's ``text_offset`` read their text here.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence

import numpy as np

__all__ = ["Detokenizer", "text_offsets"]

INCOMPLETE = "\ufffd"  # what a decoder writes for the bytes of a character that is not complete yet


class Detokenizer:
    """One row's tokens -> its text, incrementally.

    ``text`` is the text released so far; ``offsets[i]`` is where token ``i``'s text begins in it (its length when
    the token arrived: a token that completes a held character starts that character, as OpenAI's ``text_offset``
    counts). `add` returns the text that the new tokens released; `rest` the text of tokens still held back (with
    U+FFFD for an incomplete character, as a full decode writes it) once the row is over.
    """

    __slots__ = ("_prefix_text", "decode", "ids", "offsets", "prefix_offset", "read_offset", "text")

    def __init__(self, decode: Callable[[list[int]], str]):
        self.decode = decode
        self.ids: list[int] = []
        self.offsets: list[int] = []
        self.text = ""
        self.prefix_offset = 0  # the window decoded with the new tokens starts here (context for their text)
        self.read_offset = 0  # tokens before this one are released
        self._prefix_text = ""  # decode(ids[prefix_offset:read_offset]), kept between tokens

    def add(self, tokens: Iterable[int] | np.ndarray) -> str:
        """Append ``tokens``; the text they released (possibly empty, possibly text of earlier tokens)."""
        released = []
        for token in np.asarray(tokens, dtype=np.int64).reshape(-1).tolist():
            self.ids.append(token)
            self.offsets.append(len(self.text))
            window = self.decode(self.ids[self.prefix_offset :])
            if len(window) > len(self._prefix_text) and not window.endswith(INCOMPLETE):
                piece = window[len(self._prefix_text) :]
                self.prefix_offset, self.read_offset = self.read_offset, len(self.ids)
                self._prefix_text = self.decode(self.ids[self.prefix_offset : self.read_offset])
                self.text += piece
                released.append(piece)
        return "".join(released)

    def rest(self) -> str:
        """The text of the tokens held back (empty when none is)."""
        if self.read_offset == len(self.ids):
            return ""
        window = self.decode(self.ids[self.prefix_offset :])
        return window[len(self._prefix_text) :] if len(window) > len(self._prefix_text) else ""


def text_offsets(decode: Callable[[list[int]], str], tokens: Sequence[int], start: int = 0) -> list[int]:
    """Where each token's text begins in the decoded text of ``tokens``, counted from ``start`` (OpenAI's
    ``logprobs.text_offset``)."""
    row = Detokenizer(decode)
    row.add(tokens)
    return [start + offset for offset in row.offsets]
