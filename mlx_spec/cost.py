"""How long to draft: a measured cost of verifying w tokens against the expected gain.

With per-token acceptance alpha, k drafts commit E(k) = (1 - alpha^(k+1)) / (1 - alpha) tokens
per step (the target's own token included) for a step of width k + 1. Drafting pays when
E(k) / cost(k + 1) beats plain decoding's 1 / cost(1)."""

from typing import Dict


class StepCost:
    """Relative cost of a target forward over w tokens, cost(1) = 1, learned from timed steps.

    Model: cost(w) = 1 + slope * (w - 1). The prior slope is the CPU figure of DESIGN.md
    (11 tokens ~ 1.6x-2.4x one token); each timed step pulls the estimate toward this machine."""

    def __init__(self, prior_slope: float = 0.1, decay: float = 0.9):
        self.decay = decay
        self.one = None            # running mean of a width-1 step, seconds
        self.slope = prior_slope
        self.seen: Dict[int, int] = {}

    def record(self, width: int, seconds: float) -> None:
        self.seen[width] = self.seen.get(width, 0) + 1
        if self.seen[width] <= 1:
            return  # the first step of each width pays for compilation and warm-up
        if width == 1:
            self.one = seconds if self.one is None else self.decay * self.one + (1 - self.decay) * seconds
        elif self.one is not None:
            observed = max(0.0, (seconds / self.one - 1.0) / (width - 1))
            self.slope = self.decay * self.slope + (1 - self.decay) * observed

    def __call__(self, width: int) -> float:
        return 1.0 + self.slope * (width - 1)


def expected_tokens(alpha: float, k: int) -> float:
    if alpha >= 1.0:
        return k + 1.0
    return (1.0 - alpha ** (k + 1)) / (1.0 - alpha)


def best_draft_length(alpha: float, max_k: int, cost: StepCost, margin: float = 1.02) -> int:
    """The k in 0..max_k with the most tokens per unit of cost; 0 unless drafting beats plain
    decoding by `margin` (a guess that barely pays is not worth its variance)."""
    best_k, best_rate = 0, margin
    for k in range(1, max_k + 1):
        rate = expected_tokens(alpha, k) / cost(k + 1)
        if rate > best_rate:
            best_k, best_rate = k, rate
    return best_k
