"""What the serving layer returns, API-neutral: a `Completion` per choice (text, tokens, finish reason, score,
log-probabilities, the prompt's log-probabilities when they were asked for, token counts). Each API maps it to its
own response shape."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

from service.decoding import Hypothesis, truncate_at_stop
from service.scheduling.jobs import PromptLogprobs


@dataclass
class Completion:
    text: str
    token_ids: list[int]  # every generated token (EOS excluded; a stop string's tokens included)
    finish_reason: str  # "eos" | "length" | "stop"
    score: float  # the search's score: sum of log-probabilities (length-normalised for beam search)
    prompt_tokens: int
    logprobs: list | None = None  # TokenLogprob per token of `token_ids`, when asked for
    prompt_logprobs: PromptLogprobs | None = None  # of the prompt's tokens after the first, when asked for
    cached_tokens: int = 0  # of its prompt's tokens, those a prefix cache held (`TextJob.cached_tokens`)

    @property
    def completion_tokens(self) -> int:
        return len(self.token_ids)

    @property
    def mean_logprob(self) -> float:
        """Log-probability per token: how OpenAI's `best_of` ranks samples."""
        return self.score / max(1, len(self.token_ids))


def completion_from(hypothesis: Hypothesis, decode: Callable[[list[int]], str], stops: Sequence[str],
                    prompt_tokens: int, prompt_logprobs: PromptLogprobs | None = None, cached_tokens: int = 0
                    ) -> Completion:
    """A finished hypothesis as a completion: its text cut before the first stop string (finish_reason "stop").
    The tokens (and log-probabilities) are every token generated, the stop string's included: what was computed
    and is counted as usage."""
    text, hit = truncate_at_stop(decode(hypothesis.tokens), stops)
    return Completion(text, list(hypothesis.tokens), "stop" if hit else hypothesis.finish_reason, hypothesis.score,
                      prompt_tokens, hypothesis.logprobs, prompt_logprobs, cached_tokens)
