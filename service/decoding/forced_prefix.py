"""A forced target prefix (CTranslate2's ``target_prefix``, transformers' ``decoder_input_ids``): tokens a search
emits before it chooses any, one per step on its one row, whatever the logits say.

The forced steps are the decoder's ordinary one-token steps, so a prefix needs nothing of the engine and works
unchanged with the batching scheduler, joins and batch invariance. After the prefix the search goes on as from its
prefill row: greedy and sampling choose the next token, a beam search expands its one row into its beams (every
beam shares the prefix). The prefix is part of the sequence for the processors (n-gram ban, repetition penalty:
`ForcedPrefix.after` appends it to the search's ``prefix``) and not part of what is generated: its log-probabilities
are not in the score, ``max_new_tokens``, ``min_new_tokens`` and the beam length penalty count the tokens after it,
and a hypothesis's tokens are those after it (the caller writes the prefix in front of the text).

Design notes: docs/architecture.md, service/decoding/forced_prefix.py.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from .types import StepResult

__all__ = ["ForcedPrefix"]

_ROW_ZERO = np.zeros(1, dtype=np.int64)  # a forced step continues the search's one row
_ROW_ZERO.flags.writeable = False


class ForcedPrefix:
    """The tokens one search must emit first (int64, (P,); empty: none) and how many it has emitted."""

    def __init__(self, tokens: Sequence[int] = ()):
        self.tokens = np.asarray(list(tokens), dtype=np.int64).reshape(-1)  # (P,)
        if (self.tokens < 0).any():
            raise ValueError("a forced prefix holds token ids >= 0")
        self.emitted = 0

    @property
    def pending(self) -> bool:
        """Whether the next step emits a prefix token instead of choosing one."""
        return self.emitted < self.tokens.size

    def after(self, prefix: Sequence[int]) -> list[int]:
        """The sequence the search's processors see before its first choice: ``prefix`` (e.g. the decoder start
        token), then the forced tokens."""
        return [*prefix, *self.tokens.tolist()]

    def emit(self) -> StepResult:
        """The next forced step: its row (row 0, the search's only one) extended by the next prefix token."""
        token = self.tokens[self.emitted : self.emitted + 1].copy()
        self.emitted += 1
        return StepResult(tokens=token, parents=_ROW_ZERO, done=False)
