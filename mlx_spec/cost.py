"""Measured costs on this machine, while it runs: seconds as a linear function of a width.

`LinearCost` fits seconds(x) ~ a + b x by exponentially weighted least squares, so old steps
fade and the fit follows the context as a chat grows (a verification of k tokens at 8k context
does not cost what it cost at 200). Each width fades only as that width is measured again:
widths do not come evenly (most verifications are plain steps, most drafting is a one-draft
probe), and a run of plain steps must not wash out what the last wide steps taught about the
slope. When the widths seen so far do not spread enough to tell intercept from slope, a weak
prior shape decides: y ~ (1 - r) + r x through the mean point (verification: r = 0.1,
DESIGN.md's CPU figure of 11 tokens ~ 1.6x-2.4x one token; drafting: r = 1, cost proportional
to the positions drafted)."""


class LinearCost:
    def __init__(self, prior_ratio: float, decay: float = 0.95, prior_weight: float = 0.5,
                 unknown_scale: float = 1.0, skip_first: bool = True):
        """unknown_scale: before anything is measured, seconds(x) = unknown_scale * (1 - r + r x),
        in the units of the other costs' guesses (0: free until measured). skip_first: the
        first step of each width pays for warm-up (allocations, graph building): not typical."""
        self.r, self.decay, self.prior_weight = prior_ratio, decay, prior_weight
        self.unknown_scale, self.skip_first = unknown_scale, skip_first
        self.weight, self.seconds = {}, {}   # per width: decayed count and sum of seconds
        self.seen = set()

    def record(self, x: float, seconds: float) -> None:
        if self.skip_first and x not in self.seen:
            self.seen.add(x)
            return
        self.weight[x] = self.decay * self.weight.get(x, 0.0) + 1
        self.seconds[x] = self.decay * self.seconds.get(x, 0.0) + seconds
        self._fit()

    @property
    def known(self) -> bool:
        return bool(self.weight)

    def _fit(self) -> None:
        widths = self.weight
        s0, t0 = sum(widths.values()), sum(self.seconds.values())
        s1, s2 = sum(v * n for v, n in widths.items()), sum(v * v * n for v, n in widths.items())
        t1 = sum(v * y for v, y in self.seconds.items())
        mean_x, mean_y = s1 / s0, t0 / s0
        b0 = mean_y * self.r / ((1 - self.r) + self.r * mean_x)
        lam = self.prior_weight * s0
        # Minimize sum w (y - a - b x)^2 + lam (b - b0)^2: a 2x2 linear system.
        det = s0 * (s2 + lam) - s1 * s1
        # Wider never costs less (a negative slope is noise), and no width costs nothing: an
        # extrapolated fit must not reach zero, where the policy's rates would be infinite.
        self.b = max(0.0, (s0 * (t1 + lam * b0) - s1 * t0) / det)
        self.a = (t0 - self.b * s1) / s0
        self.floor = 0.1 * mean_y

    def __call__(self, x: float) -> float:
        if not self.known:
            return self.unknown_scale * ((1 - self.r) + self.r * x)
        return max(self.floor, self.a + self.b * x)
