"""How many drafts to verify: one policy for every draft source.

Each step has two decisions, both maximising expected committed tokens per second:
1. Before drafting, how many positions to draft (K, 0 = a plain step that pays nothing for
   drafting), from the recent acceptance rate and the measured costs of drafting and of
   verifying. While drafting does not pay, it still probes now and then (one draft, at growing
   intervals, until probes cost PROBE_BUDGET of the time, back to short ones only once a draft
   is accepted) so that it notices when drafts become good again, e.g. when the output starts
   copying; and early in each prompt while drafting paid on recent prompts. Where only the last
   drafted step's confidence says drafting pays, it resumes with one draft and doubles while
   that holds. A probe pays for the drafting; its draft is verified only where its confidence
   says it may pay, judged optimistically where the calibration has seen little.
2. After drafting, which drafts to verify: each draft comes with the drafter's own probability
   of it (its confidence), which a calibration learned online turns into a probability of
   acceptance; a draft is worth verifying for P(it and its ancestors are accepted). Chains keep
   a prefix, trees the most likely nodes (ancestors first).

Expected tokens of a step: 1 (the target's own token) + the sum over verified drafts of
P(accepted path reaches it). Cost: drafting(K) + verification(1 + verified drafts), both fit
on this machine while it runs (cost.LinearCost)."""

from dataclasses import dataclass
from typing import List, Optional, Sequence

import numpy as np

from .cost import LinearCost

BINS = 20  # calibration buckets over confidence in [0, 1]
PROBE_FIRST, PROBE_MAX = 4, 64
PROBE_BUDGET = 0.004  # probes cost at most this share of the plain steps between them
HOPELESS_PROBE = 256  # steps between probes when even perfect drafts would not pay,
PROBE_SHARE = 0.02  # and more where a probe costs more than this share of the steps between
# A new prompt is probed at once while drafting saved time on enough recent prompts (a decayed
# share): that probe costs a few percent of a short answer and wins much more where drafting
# pays, but a drafter whose drafts never pay (or pay less than they cost) pays it at every prompt.
TEXT_WEIGHT, TEXT_FLOOR = 0.2, 0.05
# Weight of each outcome in alpha. Outcomes arrive only while drafting: a probe's success must
# move alpha enough to resume drafting when the text turns predictable (a prompt copied, an
# answer the drafter knows), not be averaged away with the misses of an earlier prompt.
ALPHA_WEIGHT = 0.05


class Calibration:
    """P(accepted | the drafter's confidence), per confidence bucket, recent outcomes weighing
    more; starts from the confidence itself. Drafts without a confidence share one bucket.

    The buckets learn slowly (a few dozen outcomes each), over the whole session; a drafter's
    reliability changes faster than that from one text to the next (sure and right on
    arithmetic, as sure and mostly wrong on code). A trust factor follows it: the last few
    outcomes against what the buckets predicted for them, which scales every bucket at once."""

    def __init__(
        self,
        decay: float = 0.98,
        prior_weight: float = 2.0,
        trust_decay: float = 0.9,
        trust_prior: float = 1.0,
    ):
        centers = (np.arange(BINS) + 0.5) / BINS
        self.accepted = np.append(centers, 0.5) * prior_weight
        self.tried = np.full(BINS + 1, prior_weight)
        self.decay = decay
        self.observed = self.predicted = 0.0  # recent outcomes, and the buckets' chances of them
        self.trust_decay, self.trust_prior = trust_decay, trust_prior

    @staticmethod
    def bucket(confidence: Optional[float]) -> int:
        return BINS if confidence is None else min(int(confidence * BINS), BINS - 1)

    def bucket_chance(self, confidence: Optional[float], optimistic: bool = False) -> float:
        """optimistic: as if one more draft of that bucket had been accepted, which matters only
        where the bucket has seen few outcomes (what a probe is for)."""
        b = self.bucket(confidence)
        return (self.accepted[b] + optimistic) / (self.tried[b] + optimistic)

    @property
    def trust(self) -> float:
        return (self.observed + self.trust_prior) / (self.predicted + self.trust_prior)

    def __call__(self, confidence: Optional[float], optimistic: bool = False) -> float:
        return min(1.0, self.bucket_chance(confidence, optimistic) * self.trust)

    def new_text(self) -> None:
        """A new prompt: what the last outcomes said of the drafter's reliability was about
        another text."""
        self.observed = self.predicted = 0.0

    def record(self, confidence: Optional[float], accepted: bool) -> None:
        d = self.trust_decay
        self.observed = d * self.observed + accepted
        self.predicted = d * self.predicted + self.bucket_chance(confidence)
        b = self.bucket(confidence)
        self.accepted[b] = self.decay * self.accepted[b] + accepted
        self.tried[b] = self.decay * self.tried[b] + 1


@dataclass(frozen=True)
class DraftPlan:
    """Decision 1 for one step: how many positions to draft, and whether only to learn (a probe)."""

    length: int
    probing: bool = False


@dataclass(frozen=True)
class StepOutcome:
    """What one step drafted, verified and had accepted: what the policy learns from. Indices
    are the proposal's; parents as in Draft (0 = the root)."""

    confidence: Sequence[Optional[float]]  # of every proposed draft
    parents: Sequence[int]  # of every proposed draft
    verified: Sequence[int]  # the drafts the policy kept and the target verified
    path: Sequence[int]  # the accepted ones, root to leaf


class DraftPolicy:
    """The order of calls, per step: plan(max_k) -> DraftPlan (decision 1, which keeps the probe
    schedule); after drafting, record_drafting(positions, seconds, probing) and select(...)
    (decision 2, a pure query: `worth_extending` asks it too); after verification,
    record_verification(width, seconds) and observe(StepOutcome), where what the drafts' fate
    teaches is learned. The record_* calls measure costs; new_text() comes at each prompt."""

    def __init__(self, margin: float = 1.02, alpha_weight: float = ALPHA_WEIGHT):
        # Seconds of a verification of width w, and of drafting K positions. Until measured, a
        # one-token step is the unit and drafting is free (so that it gets measured).
        self.verify_cost = LinearCost(prior_ratio=0.1, plain_width=1)
        self.draft_cost = LinearCost(prior_ratio=1.0, unknown_scale=0.0, skip_first=False)
        self.calibration = Calibration()
        self.alpha = 0.5  # recent P(accepted | parent accepted), for decision 1
        self.alpha_weight = alpha_weight  # of each new outcome in alpha
        # The calibrated chance of the last drafted step's first draft: what the drafter thinks
        # of the text right now. Decision 1 drafts on it too, so that one confident probe (an
        # answer the drafter knows) resumes drafting at once instead of after many probes.
        self.first_chance = 0.0
        self.margin = margin  # drafting must beat plain decoding by this factor
        self.skipped = 0  # plain steps in a row since the last draft
        self.streak = 0  # steps in a row that drafted
        # Plain steps between probes: doubles at each probe, back to the first only when a
        # draft is accepted (drafting that fails must not restart the schedule)
        self.probe_interval = PROBE_FIRST
        self.probe_seconds = 0.0  # what the last probe's drafting cost (a drafter may catch up then)
        self.texts_pay = 1.0  # recent prompts' share (decayed) on which drafting saved time
        self.text_saved = None  # seconds drafting saved on this prompt (None: it never drafted)

    def new_text(self) -> None:
        """Called at each new prompt (a generation, a chat turn): trust the calibration's long-run
        estimates again and probe soon, since drafts that did not pay on the last text may pay
        on this one (an answer after a chat, arithmetic after prose). One early probe, not the
        whole schedule again: a useless drafter would pay the first probes at every prompt, and
        none where drafting has not paid on recent prompts."""
        self.calibration.new_text()
        if self.text_saved is not None:
            self.texts_pay += TEXT_WEIGHT * ((self.text_saved > 0) - self.texts_pay)
            self.text_saved = None
        if self.texts_pay >= TEXT_FLOOR:
            self.skipped = max(self.skipped, self.probe_interval - PROBE_FIRST)

    # --- decision 1 ---------------------------------------------------------------------
    def plan(self, max_k: int) -> DraftPlan:
        if max_k <= 0:
            return DraftPlan(0)
        plain = self.margin / max(self.verify_cost(1), 1e-9)
        best_k = self._best_length(max_k, max(self.alpha, self.first_chance), plain)
        if best_k and self.first_chance > self.alpha and not self._best_length(max_k, self.alpha, plain):
            # Only the last drafted step's confidence says drafting pays now, and the next
            # step's drafts may be as unsure as most were: start small and double while it
            # holds (one confident probe on code is often followed by junk).
            best_k = min(best_k, 2**self.streak)
        if best_k:
            self.skipped, self.streak = 0, self.streak + 1
            return DraftPlan(best_k)
        self.skipped, self.streak = self.skipped + 1, 0
        # Probe, cheaply: has drafting become worth it? (Rarely where even perfect drafts cannot
        # pay; that check runs only when a probe would otherwise be due.)
        due = self.skipped >= self.probe_interval and not self._hopeless(max_k, plain)
        probe_steps = self._probe_cost() / self.verify_cost(1)  # a probe's cost in plain steps
        if due or self.skipped >= max(HOPELESS_PROBE, probe_steps / PROBE_SHARE):
            longest = max(PROBE_MAX, probe_steps / PROBE_BUDGET)
            self.skipped, self.probe_interval = 0, min(2 * self.probe_interval, int(longest))
            return DraftPlan(1, probing=True)
        return DraftPlan(0)

    def _best_length(self, max_k: int, alpha: float, plain: float) -> int:
        """The draft length with the most expected tokens per second at acceptance rate alpha
        (0: a plain step, at `plain` tokens per second, is best)."""
        best_k, best_rate = 0, plain
        expected, reach = 1.0, 1.0
        for k in range(1, max_k + 1):
            reach *= alpha
            expected += reach
            rate = expected / (self.draft_cost(k) + self.verify_cost(k + 1))
            if rate > best_rate:
                best_k, best_rate = k, rate
        return best_k

    def _saved(self, seconds: float) -> None:
        self.text_saved = (self.text_saved or 0.0) + seconds

    def record_drafting(self, drafted: int, seconds: float, probing: bool = False) -> None:
        self._saved(-seconds)
        self.draft_cost.record(drafted, seconds)
        if probing:
            self.probe_seconds = seconds

    def record_verification(self, width: int, seconds: float) -> None:
        if width > 1:
            self._saved(self.verify_cost(1) - seconds)  # what the wider pass cost over a plain step
        self.verify_cost.record(width, seconds)

    def _probe_cost(self) -> float:
        """Seconds a probe adds to a plain step: its drafting, and the wider pass where its
        draft is verified."""
        return self.probe_seconds + max(0.0, self.verify_cost(2) - self.verify_cost(1))

    def _hopeless(self, max_k: int, plain: float) -> bool:
        """Whether even drafts that are always accepted would not pay (a drafter as slow as the
        target): then probing can only lose, and looks again rarely, in case costs changed."""
        return not self._best_length(max_k, 1.0, plain)

    # --- decision 2 ---------------------------------------------------------------------
    def reach(
        self, confidence: Sequence[Optional[float]], parents: Sequence[int], optimistic: bool = False
    ) -> List[float]:
        """P(the accepted path reaches draft i), drafts in breadth-first order; parents[i] = 0
        for the root, j + 1 for draft j."""
        reach = []
        for conf, parent in zip(confidence, parents):
            reach.append(self.calibration(conf, optimistic) * (reach[parent - 1] if parent else 1.0))
        return reach

    def select(
        self,
        confidence: Sequence[Optional[float]],
        parents: Sequence[int],
        drafted: int,
        probing: bool = False,
    ) -> List[int]:
        """Indices of the drafts to verify (ancestors before descendants, in order); it learns
        nothing. A probe's draft is judged as if its confidence bucket had one more success: a
        bucket that has seen few outcomes gets verified (and learns), one that knows its drafts
        fail does not (verifying a draft the drafter itself gives 1% costs a wider pass for
        nothing)."""
        reach = self.reach(confidence, parents, optimistic=probing)
        order = sorted(range(len(reach)), key=lambda i: (-reach[i], i))
        drafting = self.draft_cost(drafted)  # already spent, whatever is verified
        best_n, best_rate, expected = 0, 1.0 / (drafting + self.verify_cost(1)), 1.0
        for n, i in enumerate(order, start=1):
            expected += reach[i]
            rate = expected / (drafting + self.verify_cost(n + 1))
            if rate > best_rate:
                best_n, best_rate = n, rate
        return sorted(order[:best_n])

    def worth_extending(self, confidence: Sequence[float], drafted: int, probing: bool = False) -> bool:
        """For a chain drafted one position at a time: whether every draft so far pays its
        verification (with `drafted` positions spent); if not, a further draft, reached less
        often, cannot either."""
        return len(self.select(confidence, range(len(confidence)), drafted, probing)) == len(confidence)

    # --- what happened --------------------------------------------------------------------
    def _learn(self, outcome: float) -> None:
        self.alpha += self.alpha_weight * (outcome - self.alpha)

    def observe(self, outcome: StepOutcome) -> None:
        """Learn from one step: what the drafter thought of its first drafts, and the outcome
        of each verified draft whose parent was accepted (or is the root)."""
        confidence, parents = outcome.confidence, outcome.parents
        if len(confidence):
            # What the drafter thinks of the text right now: its best first draft's chance.
            reach = self.reach(confidence, parents)
            self.first_chance = max(reach[i] for i in range(len(reach)) if parents[i] == 0)
            if not outcome.verified:
                # Nothing was worth verifying: the step's drafting was wasted, and no outcome
                # follows. Decision 1 must still learn it, or it keeps drafting what decision 2
                # keeps dropping: the best first draft's calibrated chance stands in for one.
                self._learn(self.first_chance)
        path = outcome.path
        if path:
            self._saved(len(path) * self.verify_cost(1))  # a plain step per accepted draft
        accepted = set(path)
        for i in outcome.verified:
            parent = parents[i] - 1
            if parent < 0 or parent in accepted:
                ok = i in accepted
                self.calibration.record(confidence[i], ok)
                self._learn(ok)
                if ok:
                    self.probe_interval = PROBE_FIRST
