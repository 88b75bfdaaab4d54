"""Prompt lookup: draft the continuation of the most recent earlier occurrence of the context's
last n-gram (longest n first). Blind drafting loses on CPU (DESIGN.md), so the draft length
comes from the acceptance observed for matches of that length and the measured cost of
a wider verification (`cost.py`)."""

from typing import Dict, List, Tuple

from ..cost import StepCost, best_draft_length
from .base import Draft, Drafter


MAX_MATCH = 12


class LookupDrafter(Drafter):
    def __init__(self, ngram_max: int = 3, ngram_min: int = 1, cost: StepCost = None,
                 adaptive: bool = True):
        if not 1 <= ngram_min <= ngram_max:
            from ..errors import MlxSpecError

            raise MlxSpecError(f"need 1 <= --ngram-min <= --ngram-max, got {ngram_min}, {ngram_max}")
        self.ngram_max, self.ngram_min = ngram_max, ngram_min
        self.cost = cost or StepCost()
        self.adaptive = adaptive
        # Geometric acceptance per match length (the n-gram extended backwards while the two
        # occurrences agree, capped): [accepted, rejected]. Prior alpha = m / (m + 1): a longer
        # match is more likely copied text.
        self.outcomes = {m: [float(m), 1.0] for m in range(1, MAX_MATCH + 1)}
        self.tokens: List[int] = []
        self.index: Dict[Tuple[int, ...], int] = {}   # n-gram -> end position of latest occurrence
        self.pending: Tuple[int, List[int]] = (0, [])  # (match length, drafts) of the last step

    # The index holds every n-gram that ends at or before position len(tokens) - 2, so a match
    # of the context's suffix is always an EARLIER occurrence with at least one token after it.
    def _append(self, token: int) -> None:
        end = len(self.tokens) - 1
        for n in range(self.ngram_min, self.ngram_max + 1):
            if end + 1 >= n:
                self.index[tuple(self.tokens[end + 1 - n:end + 1])] = end
        self.tokens.append(token)

    def prefill(self, context, taps, start):
        self.tokens, self.index = [], {}
        for t in context:
            self._append(t)

    def _match(self) -> Tuple[int, int]:
        """(match length, end position of the latest earlier occurrence of the longest
        n-gram), or (0, -1). The length counts how far back the two occurrences agree."""
        tokens = self.tokens
        for n in range(min(self.ngram_max, len(tokens)), self.ngram_min - 1, -1):
            end = self.index.get(tuple(tokens[-n:]))
            if end is not None:
                m = n
                while m < MAX_MATCH and end - m >= 0 and tokens[end - m] == tokens[-1 - m]:
                    m += 1
                return m, end
        return 0, -1

    def alpha(self, m: int) -> float:
        accepted, rejected = self.outcomes[m]
        return accepted / (accepted + rejected)

    def propose(self, k: int) -> Draft:
        m, end = self._match()
        continuation = self.tokens[end + 1:end + 1 + k] if m else []
        if self.adaptive and continuation:
            continuation = continuation[:best_draft_length(self.alpha(m), len(continuation), self.cost)]
        self.pending = (m, continuation)
        return Draft(tokens=continuation)

    def commit(self, n_accepted, next_token, taps):
        m, drafted = self.pending
        if drafted:
            # Recent steps weigh more: old evidence decays so the estimate tracks the text.
            stats = self.outcomes[m]
            stats[0] = 0.95 * stats[0] + n_accepted
            stats[1] = 0.95 * stats[1] + (n_accepted < len(drafted))
        for t in drafted[:n_accepted] + [next_token]:
            self._append(t)
