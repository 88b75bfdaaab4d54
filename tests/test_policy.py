"""The draft-length policy: drafts nothing when drafts are never accepted, the longest drafts
when they always are, follows the measured costs, and never changes the output."""

import pytest

from mlx_spec.cost import LinearCost
from mlx_spec.drafters.base import Draft
from mlx_spec.engine import Engine
from mlx_spec.policy import PROBE_BUDGET, PROBE_FIRST, PROBE_MAX, TEXT_FLOOR, DraftPolicy, StepOutcome
from tiny import ScriptedDrafter, plain_greedy, run, tiny_target

PROMPT = [1, 5, 7, 9, 11, 13, 2, 5, 7, 9, 11, 13, 2, 5, 7]


def measured_policy(verify_slope, draft_per_position=0.0, one=0.05):
    """A policy whose costs were measured on a machine where a verification of width w takes
    one * (1 + verify_slope * (w - 1)) seconds and drafting k positions k * draft_per_position."""
    policy = DraftPolicy()
    for _ in range(3):
        for w in (1, 2, 4, 8, 12):
            policy.verify_cost.record(w, one * (1 + verify_slope * (w - 1)))
            policy.draft_cost.record(w, one * draft_per_position * w)
    return policy


def teach(policy, accepted: bool, confidence=0.9, n=60):
    for _ in range(n):
        policy.observe(
            StepOutcome([confidence] * 4, [0, 1, 2, 3], range(4), [0, 1, 2, 3] if accepted else [])
        )


def test_linear_cost_recovers_a_line_and_follows_change():
    cost = LinearCost(prior_ratio=0.1)
    for _ in range(5):
        for w in (1, 3, 9):
            cost.record(w, 2.0 + 0.5 * w)
    assert abs(cost(5) - 4.5) < 0.02  # the weak prior on the slope barely moves it
    for _ in range(200):  # the context grew: every width costs twice as much now
        for w in (1, 3, 9):
            cost.record(w, 4.0 + 1.0 * w)
    assert abs(cost(5) - 9.0) < 0.05


def test_a_run_of_one_width_keeps_what_wider_ones_taught():
    """Most steps are plain (width 1): a long run of them must not wash the measured slope back
    to the prior, or the policy underrates a wide verification after each run of plain steps."""
    cost = LinearCost(prior_ratio=0.1)
    for _ in range(40):
        for w in (1, 2, 5):
            cost.record(w, 1.0 + 0.3 * (w - 1))
    for _ in range(300):
        cost.record(1, 1.0)
    assert abs(cost(2) - 1.3) < 0.03 and abs(cost(5) - 2.2) < 0.1  # the weak prior pulls a little


def test_the_plain_width_is_measured_on_its_own():
    """On the CPU the first draft of a step adds more than each later one: a line through
    every width would put it too cheap (here 1.21 instead of 1.25). With plain_width, width 1
    is its own measurement and the line fits the wider ones; before any wider one is measured
    they follow the prior shape through the plain step."""
    cost = LinearCost(prior_ratio=0.1, plain_width=1)
    cost.record(1, 1.0)  # the first of each width is warm-up, skipped
    for _ in range(3):
        cost.record(1, 1.0)
    assert cost(1) == pytest.approx(1.0) and cost(3) == pytest.approx(1.2)
    for _ in range(10):
        for w in (1, 2, 4, 9):
            cost.record(w, 1.0 if w == 1 else 1.25 + 0.15 * (w - 2))
    assert cost(1) == pytest.approx(1.0) and abs(cost(2) - 1.25) < 0.02 and abs(cost(9) - 2.3) < 0.03
    line = LinearCost(prior_ratio=0.1)
    for _ in range(10):
        for w in (1, 2, 4, 9):
            line.record(w, 1.0 if w == 1 else 1.25 + 0.15 * (w - 2))
    assert line(2) < 1.22


def test_linear_cost_with_one_width_uses_the_prior_shape():
    cost = LinearCost(prior_ratio=0.1)
    for _ in range(4):
        cost.record(4, 1.3)
    assert abs(cost(4) - 1.3) < 1e-6 and abs(cost(1) - 1.0) < 1e-6  # 1.3 = 1 + 0.1 * 3


def test_linear_cost_never_falls_to_zero():
    """Noisy timings that fall with the width (a busy machine) do not make wider look cheaper,
    nor any width free: the policy divides by these costs."""
    cost = LinearCost(prior_ratio=0.1, unknown_scale=0.0, skip_first=False)
    for _ in range(20):
        for w, seconds in ((2, 0.05), (8, 0.01), (16, 0.001)):
            cost.record(w, seconds)
    assert cost(1) > 0 and cost(40) >= cost(1) > 0.001


def test_never_accepted_drafts_give_plain_steps_with_rare_probes():
    policy = measured_policy(verify_slope=0.1, draft_per_position=0.1)
    teach(policy, accepted=False)
    lengths = [policy.plan(8).length for _ in range(200)]
    assert lengths[: PROBE_FIRST - 1] == [0] * (PROBE_FIRST - 1)
    assert sum(k > 0 for k in lengths) <= 8 and set(lengths) == {0, 1}  # probes: one draft, growing intervals
    probes = [i for i, k in enumerate(lengths) if k]
    gaps = [b - a for a, b in zip(probes, probes[1:])]
    assert len(probes) >= 3 and gaps == sorted(gaps)
    # After drafting anyway (a probe), nothing is worth verifying but the one probed draft.
    assert policy.select([0.9] * 8, list(range(8)), 8, probing=False) == []


def test_always_accepted_drafts_give_the_longest_length():
    policy = measured_policy(verify_slope=0.1, draft_per_position=0.02)
    teach(policy, accepted=True)
    assert policy.plan(8).length == 8
    assert policy.select([0.9] * 8, list(range(8)), 8) == list(range(8))


def test_the_choice_follows_the_cost_curve():
    lengths = []
    for slope in (0.02, 0.1, 0.5, 2.0):
        policy = measured_policy(verify_slope=slope, draft_per_position=0.05)
        policy.alpha = 0.7
        lengths.append(policy.plan(12).length)
    assert lengths == sorted(lengths, reverse=True) and lengths[0] > lengths[-1]
    assert lengths[-1] == 0  # verification twice a step per extra token: drafting never pays


def test_selection_keeps_ancestors_and_the_likeliest_nodes():
    policy = measured_policy(verify_slope=0.05)
    teach(policy, accepted=True, confidence=0.97)
    # Root children 0 (0.97) and 1 (0.1); 2 extends 0 (0.97), 3 extends 1 (0.97).
    kept = policy.select([0.97, 0.1, 0.97, 0.97], [0, 0, 1, 2], 2)
    assert kept[:2] == [0, 2] and all(
        policy.reach([0.97, 0.1, 0.97, 0.97], [0, 0, 1, 2])[i] > 0 for i in kept
    )
    draft = Draft(tokens=[5, 6, 7, 8], parents=[0, 0, 1, 2], confidence=[0.97, 0.1, 0.97, 0.97])
    sub = draft.subset([0, 2])
    assert sub.tokens == [5, 7] and sub.parents == [0, 1]


class AlwaysWrong(ScriptedDrafter):
    def propose(self, k):
        draft = super().propose(k)
        return Draft(tokens=[(t + 1) % self.vocab for t in draft.tokens], confidence=[0.9] * len(draft))


class CpuLikeCost:
    """Costs as on this project's CPU (a draft of k: 0.1 k of a step, a verification of width w:
    1 + 0.15 (w - 1)), not the tiny test model's, whose wide verification is almost free."""

    known = True

    def __init__(self, base, per_token):
        self.base, self.per_token = base, per_token

    def record(self, x, seconds):
        pass

    def __call__(self, x):
        return self.base + self.per_token * x


def cpu_like_policy():
    policy = DraftPolicy()
    policy.verify_cost, policy.draft_cost = CpuLikeCost(0.85, 0.15), CpuLikeCost(0.0, 0.1)
    return policy


@pytest.mark.parametrize("useful", [False, True], ids=["never-accepted", "always-accepted"])
def test_engine_drafts_what_pays(useful):
    """Through the engine, with CPU-like costs: a drafter never accepted ends up drafting almost
    nothing, one always accepted drafts the longest length; the output is the target's."""
    target = tiny_target("llama", seed=1)
    expected = plain_greedy(target.model, PROMPT, 120)
    drafter = (ScriptedDrafter if useful else AlwaysWrong)(expected, 10**6, 32)
    engine = Engine(target, drafter, num_draft_tokens=6, policy=cpu_like_policy())
    tokens, stats = run(engine, PROMPT, 120)
    assert tokens == expected
    if useful:
        assert stats.tokens_per_step > 4 and engine.policy.plan(6).length == 6
    else:
        # Its confidence (0.9) is a lie: the steps until the calibration has learned that cost
        # some drafting, then plain steps and rare probes.
        assert (
            stats.accepted_drafts == 0
            and stats.plain_steps > 0.85 * stats.steps
            and stats.verified_drafts < 0.2 * stats.steps
        )
        assert engine.policy.calibration(0.9) < 0.2


def test_a_drafter_as_slow_as_the_target_is_left_alone():
    """Drafting one position costs a whole step: even perfect drafts cannot pay, so the
    policy neither drafts nor probes (but once in a long while)."""
    policy = measured_policy(verify_slope=0.1, draft_per_position=1.0)
    teach(policy, accepted=True)
    lengths = [policy.plan(3).length for _ in range(200)]
    assert lengths == [0] * 200


def test_costly_probes_come_rarely():
    """A hopeless drafter whose probe costs 20 steps (a draft model catching up on everything
    since the last probe) is probed so rarely that probes cost at most 2% of the time."""
    policy = measured_policy(verify_slope=0.1, draft_per_position=1.0)
    teach(policy, accepted=True)
    probes = []
    for step in range(5000):
        plan = policy.plan(3)
        if plan.length:
            probes.append(step)
            policy.record_drafting(plan.length, 20 * 0.05, plan.probing)  # 20 steps of 0.05 s
    gaps = [b - a for a, b in zip(probes, probes[1:])]
    assert probes and min(gaps) >= 20 / 0.02 - 1


def test_drafts_never_worth_verifying_stop_being_drafted():
    """A drafter whose confident-looking drafts the calibration knows to fail: the selection
    drops them, even a probe's (the calibration has nothing left to learn there), and the draft
    length follows (it used to keep drafting what was dropped)."""
    policy = cpu_like_policy()
    for _ in range(100):
        policy.calibration.record(0.05, False)
    lengths = []
    for _ in range(200):
        plan = policy.plan(4)
        k = plan.length
        lengths.append(k)
        if k:
            assert policy.select([0.05] * k, list(range(k)), k, plan.probing) == []
            policy.observe(StepOutcome([0.05] * k, list(range(k)), [], []))
    assert sum(lengths[-100:]) <= 3  # plain steps, but for rare probes


def test_a_probe_verifies_where_the_calibration_knows_little():
    """A probe's draft of a confidence never seen verified is verified (so the calibration
    learns it), though the same draft outside a probe is not worth it; once its bucket has
    seen enough failures, probes stop verifying it too."""
    policy = cpu_like_policy()
    assert policy.select([0.02], [0], 1, probing=False) == []
    assert policy.select([0.02], [0], 1, probing=True) == [0]
    for _ in range(12):
        policy.observe(StepOutcome([0.02], [0], [0], []))
    assert policy.select([0.02], [0], 1, probing=True) == []


def test_a_confident_draft_resumes_drafting_at_once():
    """After a run of rejected low-confidence drafts, one draft the drafter is sure of (and
    whose confidence the calibration trusts) is enough to draft again at the next step, instead
    of waiting for alpha to climb back probe by probe: one draft first, twice as many at each
    step while the drafts stay sure."""
    policy = cpu_like_policy()
    teach(policy, accepted=True, confidence=0.95, n=30)  # confident drafts are right
    teach(policy, accepted=False, confidence=0.05, n=60)  # unsure ones are not, for a while
    policy.first_chance = 0.0
    assert policy.plan(6).length == 0
    policy.observe(StepOutcome([0.05], [0], [], []))  # another unsure draft, not worth verifying
    assert policy.plan(6).length == 0
    lengths = []
    for _ in range(3):
        policy.observe(StepOutcome([0.95], [0], [0], [0]))  # a sure one, and right
        lengths.append(policy.plan(6).length)
    assert lengths == [1, 2, 4]


def test_drafting_that_fails_does_not_restart_the_probe_schedule():
    """Probes grow apart; a confident probe that resumes drafting, followed by drafts that fail,
    leaves them as far apart as before. Only an accepted draft brings the next probe close."""
    policy = cpu_like_policy()
    teach(policy, accepted=False, confidence=0.05, n=60)
    policy.first_chance = 0.0
    for _ in range(40):
        policy.plan(6)
    interval = policy.probe_interval
    assert interval > PROBE_FIRST
    policy.observe(StepOutcome([0.95], [0], [0], []))  # sure, but fails
    assert policy.probe_interval == interval
    assert policy.plan(6).length == 1  # sure: drafting resumes
    policy.observe(StepOutcome([0.05], [0], [0], [0]))  # an accepted draft
    assert policy.probe_interval == PROBE_FIRST


def test_the_calibration_follows_a_change_of_text_within_a_few_drafts():
    """Sure and right for a long while (arithmetic), then as sure and mostly wrong (code): the
    buckets alone would go on trusting the confidence for dozens of drafts; the trust factor
    brings the chance down within ten, and back up when the drafts are right again."""
    policy = DraftPolicy()
    teach(policy, accepted=True, confidence=0.9, n=25)  # 100 outcomes
    assert policy.calibration(0.9) > 0.85
    for _ in range(10):
        policy.observe(StepOutcome([0.9], [0], [0], []))
    assert policy.calibration.bucket_chance(0.9) > 0.65  # the bucket still trusts it
    assert policy.calibration(0.9) < 0.4
    for _ in range(10):
        policy.observe(StepOutcome([0.9], [0], [0], [0]))
    assert policy.calibration(0.9) > 0.7


def test_a_new_prompt_trusts_the_calibration_again_and_probes_soon():
    """Drafts failed on the last text (low trust, probes far apart): a new prompt may be one where
    they pay, so the trust factor and the probe interval start over."""
    policy = cpu_like_policy()
    teach(policy, accepted=True, confidence=0.9, n=25)
    for _ in range(10):
        policy.observe(StepOutcome([0.9], [0], [0], []))
    policy.first_chance, policy.alpha = 0.0, 0.0
    lengths = [policy.plan(4).length for _ in range(300)]
    assert sum(lengths) <= 8 and policy.calibration(0.9) < 0.4
    policy.new_text()
    assert policy.calibration(0.9) == pytest.approx(policy.calibration.bucket_chance(0.9))
    assert any(policy.plan(4).length for _ in range(PROBE_FIRST))


def plain_or_probe_step(policy, max_k, accepted=False, probe_seconds=0.0):
    """One engine step against the policy: the length, then the costs and the outcome; a probe's
    one draft is verified and accepted or not. Returns the length."""
    plan = policy.plan(max_k)
    k = plan.length
    if k:
        policy.record_drafting(k, probe_seconds, plan.probing)
        policy.record_verification(2, policy.verify_cost(2))
        policy.observe(StepOutcome([0.5], [0], [0], [0] if accepted else []))
    else:
        policy.record_verification(1, policy.verify_cost(1))
        policy.observe(StepOutcome([], [], [], []))
    return k


def test_probes_grow_apart_until_they_cost_a_small_share():
    """A drafter whose drafts never pay and whose probe costs 40% of a step: probes grow apart
    past PROBE_MAX, until they cost about PROBE_BUDGET of the time."""
    policy = measured_policy(verify_slope=0.1, draft_per_position=0.4)
    teach(policy, accepted=False)
    probes = [step for step in range(3000) if plain_or_probe_step(policy, 4, probe_seconds=0.4 * 0.05)]
    gaps = [b - a for a, b in zip(probes, probes[1:])]
    cost_share = (0.4 * 0.05 + policy.verify_cost(2) - policy.verify_cost(1)) / (
        gaps[-1] * policy.verify_cost(1)
    )
    assert gaps == sorted(gaps) and gaps[-1] > PROBE_MAX
    assert PROBE_BUDGET / 2 < cost_share <= PROBE_BUDGET * 1.05


def test_new_prompts_are_probed_at_once_while_drafting_saves_time_on_them():
    """Each prompt is probed within its first steps while drafting saved time on recent prompts;
    after many prompts where it did not (drafts rejected, or accepted but costing more than the
    plain steps they save), no longer (the probe schedule goes on); one prompt where drafting
    saves time brings it back."""
    policy = cpu_like_policy()
    teach(policy, accepted=False, confidence=0.5)
    plain = policy.verify_cost(1)

    def prompt(accepted=False, steps=PROBE_FIRST + 2, probe_seconds=0.0):
        policy.new_text()
        return any([plain_or_probe_step(policy, 4, accepted, probe_seconds) for _ in range(steps)])

    early = [prompt() for _ in range(40)]
    assert all(early[:5]) and sum(early[-20:]) <= 2  # 120 steps: the schedule's probes only
    for _ in range(3):
        prompt(accepted=True, steps=40, probe_seconds=3 * plain)  # accepted, but dear
    policy.new_text()
    assert policy.texts_pay < TEXT_FLOOR
    assert prompt(accepted=True, steps=300)  # the schedule's probe finds drafts that pay
    assert prompt()


def test_a_stopping_query_learns_nothing():
    """--stop-early asks the policy after each draft whether the next one pays: a question, not
    an outcome. The step's drafts are learned from once, when the step is observed (a wasted
    first draft used to be learned twice)."""
    policy = cpu_like_policy()
    for _ in range(100):
        policy.calibration.record(0.05, False)
    alpha, first_chance = policy.alpha, policy.first_chance
    assert not policy.worth_extending([0.05], 1)
    assert (policy.alpha, policy.first_chance) == (alpha, first_chance)
    policy.observe(StepOutcome([0.05], [0], [], []))  # the step: drafted, nothing worth verifying
    assert policy.alpha == pytest.approx(alpha + policy.alpha_weight * (policy.first_chance - alpha))  # once
