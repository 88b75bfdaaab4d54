"""Prompt lookup: draft the continuation of the most recent earlier occurrence of the context's
last n-gram (longest n first). Blind drafting loses on CPU (DESIGN.md): each draft's confidence
is m / (m + 1) for a match that agrees over m tokens (a longer match is more likely copied
text), which the engine's policy calibrates against what is accepted and weighs against the
measured cost of a wider verification."""

from typing import Dict, List, Tuple

from .base import Draft, Drafter

MAX_MATCH = 12


class LookupDrafter(Drafter):
    reads_cached_context = False

    def __init__(self, ngram_max: int = 3, ngram_min: int = 1):
        if not 1 <= ngram_min <= ngram_max:
            from ..errors import MlxSpecError

            raise MlxSpecError(f"need 1 <= --ngram-min <= --ngram-max, got {ngram_min}, {ngram_max}")
        self.ngram_max, self.ngram_min = ngram_max, ngram_min
        self.tokens: List[int] = []
        self.index: Dict[Tuple[int, ...], int] = {}  # n-gram -> end position of latest occurrence
        self.pending: List[int] = []  # the drafts of the last step

    # The index holds every n-gram that ends at or before position len(tokens) - 2, so a match
    # of the context's suffix is always an EARLIER occurrence with at least one token after it.
    def _append(self, token: int) -> None:
        end = len(self.tokens) - 1
        for n in range(self.ngram_min, self.ngram_max + 1):
            if end + 1 >= n:
                self.index[tuple(self.tokens[end + 1 - n : end + 1])] = end
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

    def propose(self, k: int) -> Draft:
        m, end = self._match()
        self.pending = self.tokens[end + 1 : end + 1 + k] if m else []
        return Draft(tokens=self.pending, confidence=[m / (m + 1)] * len(self.pending))

    def commit(self, accepted, next_token, taps):
        for t in accepted + [next_token]:
            self._append(t)
