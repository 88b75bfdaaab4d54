"""Measured costs on this machine, while it runs: seconds as a linear function of a width.

`LinearCost` fits seconds(x) ~ a + b x by exponentially weighted least squares, so old steps
fade and the fit follows the context as a chat grows (a verification of k tokens at 8k context
does not cost what it cost at 200). When the widths seen so far do not spread enough to tell
intercept from slope, a weak prior shape decides: y ~ (1 - r) + r x through the mean point
(verification: r = 0.1, DESIGN.md's CPU figure of 11 tokens ~ 1.6x-2.4x one token; drafting:
r = 1, cost proportional to the positions drafted)."""


class LinearCost:
    def __init__(self, prior_ratio: float, decay: float = 0.95, prior_weight: float = 0.5,
                 unknown_scale: float = 1.0, skip_first: bool = True):
        """unknown_scale: before anything is measured, seconds(x) = unknown_scale * (1 - r + r x),
        in the units of the other costs' guesses (0: free until measured). skip_first: the
        first step of each width pays for warm-up (allocations, graph building): not typical."""
        self.r, self.decay, self.prior_weight = prior_ratio, decay, prior_weight
        self.unknown_scale, self.skip_first = unknown_scale, skip_first
        self.s0 = self.s1 = self.s2 = self.t0 = self.t1 = 0.0
        self.seen = set()

    def record(self, x: float, seconds: float) -> None:
        if self.skip_first and x not in self.seen:
            self.seen.add(x)
            return
        d = self.decay
        self.s0, self.s1, self.s2 = d * self.s0 + 1, d * self.s1 + x, d * self.s2 + x * x
        self.t0, self.t1 = d * self.t0 + seconds, d * self.t1 + x * seconds

    @property
    def known(self) -> bool:
        return self.s0 > 0

    def __call__(self, x: float) -> float:
        if not self.known:
            return self.unknown_scale * ((1 - self.r) + self.r * x)
        mx, my = self.s1 / self.s0, self.t0 / self.s0
        b0 = my * self.r / ((1 - self.r) + self.r * mx)
        lam = self.prior_weight * self.s0
        # Minimize sum w (y - a - b x)^2 + lam (b - b0)^2: a 2x2 linear system.
        det = self.s0 * (self.s2 + lam) - self.s1 * self.s1
        # Wider never costs less (a negative slope is noise), and no width costs nothing: an
        # extrapolated fit must not reach zero, where the policy's rates would be infinite.
        b = max(0.0, (self.s0 * (self.t1 + lam * b0) - self.s1 * self.t0) / det)
        a = (self.t0 - b * self.s1) / self.s0
        return max(0.1 * my, a + b * x)
