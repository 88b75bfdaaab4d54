"""Measured costs on this machine, while it runs: seconds as a linear function of a width.

`LinearCost` fits seconds(x) ~ a + b x by exponentially weighted least squares, so old steps
fade and the fit follows the context as a chat grows (a verification of k tokens at 8k context
does not cost what it cost at 200). Each width fades only as that width is measured again:
widths do not come evenly (most verifications are plain steps, most drafting is a one-draft
probe), and a run of plain steps must not wash out what the last wide steps taught about the
slope. When the widths seen so far do not spread enough to tell intercept from slope, a weak
prior shape decides: y ~ (1 - r) + r x through the mean point (verification: r = 0.1,
DESIGN.md's CPU figure of 11 tokens ~ 1.6x-2.4x one token; drafting: r = 1, cost proportional
to the positions drafted).

`plain_width` (verification: 1) is measured on its own and left out of the line: on the CPU the
first draft of a step adds more than each later one (at 450 tokens of context 49 ms for a plain
step, 58-62 ms with one draft, then +7-9 ms per draft; benchmarks/verify_widths.py), and a line
through every width put that first draft at +6 ms, so the policy verified single drafts at
acceptance rates where they lose."""


class LinearCost:
    def __init__(
        self,
        prior_ratio: float,
        decay: float = 0.95,
        prior_weight: float = 0.5,
        unknown_scale: float = 1.0,
        skip_first: bool = True,
        plain_width=None,
    ):
        """unknown_scale: before anything is measured, seconds(x) = unknown_scale * (1 - r + r x),
        in the units of the other costs' guesses (0: free until measured). skip_first: the
        first step of each width pays for warm-up (allocations, graph building): not typical."""
        self.r, self.decay, self.prior_weight = prior_ratio, decay, prior_weight
        self.unknown_scale, self.skip_first = unknown_scale, skip_first
        self.weight, self.seconds = {}, {}  # per width: decayed count and sum of seconds
        self.seen = set()
        self.plain_width = plain_width
        self.line = False  # a line is fitted (some width other than plain_width is measured)

    def record(self, x: float, seconds: float) -> None:
        if self.skip_first and x not in self.seen:
            self.seen.add(x)
            return
        self.weight[x] = self.decay * self.weight.get(x, 0.0) + 1
        self.seconds[x] = self.decay * self.seconds.get(x, 0.0) + seconds
        self._fit()

    def _mean(self, x: float) -> float:
        return self.seconds[x] / self.weight[x]

    def _fit(self) -> None:
        widths = {x: n for x, n in self.weight.items() if x != self.plain_width}
        self.line = bool(widths)
        if not widths:
            return
        s0, t0 = sum(widths.values()), sum(self.seconds[x] for x in widths)
        s1, s2 = sum(v * n for v, n in widths.items()), sum(v * v * n for v, n in widths.items())
        t1 = sum(v * self.seconds[v] for v in widths)
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
        plain = self._mean(self.plain_width) if self.plain_width in self.weight else None
        if x == self.plain_width and plain is not None:
            return plain
        if not self.line:
            # Nothing (or only the plain width) measured: the prior shape, through what is.
            scale = (
                self.unknown_scale if plain is None else plain / ((1 - self.r) + self.r * self.plain_width)
            )
            return scale * ((1 - self.r) + self.r * x)
        # A wider verification never costs less than a plain one (noise, or a context that grew).
        return max(self.floor, self.a + self.b * x, plain or 0.0)
