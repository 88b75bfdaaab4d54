"""OpenAI's Predicted Outputs as a draft source: the text a reply is expected to be (a file an
agent is about to rewrite with a few edits) drafts its own continuation.

The reply starts where the prediction starts; after that, the continuation in the prediction of
the longest n-gram that ends the context (its latest occurrence at or after where the last
match ended, else the nearest before it), so that after an edit the reply finds its place in the
prediction again a few tokens later. Deterministic drafts: verification keeps exactly what the
target says (Engine combines this drafter with the engine's own source, drafters/combined.py)."""

import bisect
from typing import Dict, List, Sequence, Tuple

from .base import Draft, Drafter

NGRAM_MAX = 8


class PredictionDrafter(Drafter):
    reads_cached_context = False

    def __init__(self, prediction: Sequence[int], ngram_max: int = NGRAM_MAX):
        self.prediction, self.ngram_max = list(prediction), ngram_max
        # n-gram -> the positions where it ends in the prediction, ascending
        self.ends: Dict[Tuple[int, ...], List[int]] = {}
        for end in range(len(self.prediction)):
            for n in range(1, min(ngram_max, end + 1) + 1):
                self.ends.setdefault(tuple(self.prediction[end + 1 - n : end + 1]), []).append(end)
        self.tail: List[int] = []  # the context's last tokens
        self.written = 0  # tokens of the reply so far
        self.cursor = 0  # where in the prediction the reply is thought to be

    def prefill(self, context, taps, start):
        self.tail, self.written, self.cursor = list(context[-self.ngram_max :]), 0, 0

    def _match(self) -> Tuple[int, int]:
        """(n, the position in the prediction after the matched n-gram), or (0, -1)."""
        if self.written == 0:  # the reply begins: so does the prediction
            return self.ngram_max, 0
        for n in range(min(self.ngram_max, len(self.tail), self.written), 0, -1):
            ends = self.ends.get(tuple(self.tail[-n:]))
            if ends:
                i = bisect.bisect_left(ends, self.cursor - 1)
                end = ends[i] if i < len(ends) else ends[-1]
                return n, end + 1
        return 0, -1

    def propose(self, k: int) -> Draft:
        n, start = self._match()
        if n == 0 or start >= len(self.prediction):
            return Draft()
        self.cursor = start
        tokens = self.prediction[start : start + k]
        return Draft(tokens=tokens, confidence=[n / (n + 1)] * len(tokens))

    def commit(self, accepted, next_token, taps):
        committed = list(accepted) + [next_token]
        self.tail = (self.tail + committed)[-self.ngram_max :]
        self.written += len(committed)
        self.cursor += len(committed)
