"""THE loop, shared by every drafter: prefill, propose, verify, commit, roll back.

A verification step runs the target once over [last committed token, x_1..x_k]. The verdict
(n accepted drafts, the target's own next token) is computed on the device and read with one
sync; the target's cache then rolls back by offset to the committed prefix.

`generate` yields the events of events.py: Prefilled once the prompt is in the cache, a Step and
the Tokens it committed at each verification step, a Text for text the detokenizer releases only
at the end, and finally Done (with the same Stats object, complete).

A generator closed at one of its events (a client gone, a `break`) leaves the cache as it is,
consistent with what was committed, so the next call reuses it.
"""

import contextlib
import copy
import secrets
import time
from dataclasses import dataclass, field
from typing import Any, Callable, Dict, Iterator, List, Optional, Sequence, Tuple

import mlx.core as mx

from .cache import (
    QUANTIZED_SPECULATION,
    KVQuantization,
    Replay,
    batchable,
    check_speculation,
    check_tree,
    common_prefix_length,
    is_quantized,
    is_recurrent,
    make_cache,
    rollback_to,
    verification,
)
from .drafters.base import Draft, Drafter, NoDrafter
from .drafters.combined import Combined
from .drafters.prediction import PredictionDrafter
from .errors import MlxSpecError
from .events import Done, Event, Prefilled, Prefilling, Stats, Step, Text, Token, TokenLogprobs
from .logprobs import LogprobRows, token_logprobs
from .policy import DraftPlan, DraftPolicy, StepOutcome
from .sampling import Sampler, SamplingParams
from .tree import Tree, compact, tree_forward, verify_tree
from .verify import verify_chain

PREFILL_CHUNK = 2048  # mlx-lm's prefill_step_size
PREDICTED_DRAFTS = 16  # the most drafts per step where a request's prediction drafts
UNKNOWN_TOKEN = -1  # a cached position whose token is not known (Engine.resume)


@dataclass
class Session:
    """What the engine keeps of one conversation: the target's cache and the tokens in it, and,
    for drafters that read the target's features, those features at every cached position, so
    that the drafter can be rebuilt over a session put back without another target pass."""

    tokens: List[int] = field(default_factory=list)
    cache: List[Any] = field(default_factory=list)
    taps: Dict[int, List[mx.array]] = field(default_factory=dict)  # layer -> pieces [1, n, H]
    # What the last verification pass left for a roll-back of recurrent layers (cache.Replay).
    replay: Optional[Replay] = field(default=None, repr=False)

    @property
    def nbytes(self) -> int:
        return sum(c.nbytes for c in self.cache) + sum(
            piece.nbytes for pieces in self.taps.values() for piece in pieces
        )

    def copy(self) -> "Session":
        return Session(
            list(self.tokens),
            copy.deepcopy(self.cache),
            {layer: list(pieces) for layer, pieces in self.taps.items()},
        )

    def add(self, tokens: Sequence[int]) -> None:
        """The cache now holds `tokens` too."""
        self.tokens = self.tokens + list(tokens)

    def record(self, taps: Dict[int, mx.array]) -> None:
        """Keep the features [1, n, H] of the positions added last (engine(sessions=True))."""
        for layer, h in taps.items():
            self.taps.setdefault(layer, []).append(h)

    def move_to(self, cache: List[Any]) -> None:
        """The same positions, now held by `cache` (a batch's rows, or a row's own again)."""
        self.cache = cache

    def fill(self, target, tokens: List[int], layers: Sequence[int]) -> Dict[int, mx.array]:
        """One prefill pass: the target over `tokens` after the cached ones, evaluated; the
        outputs of `layers` [1, len(tokens), H]. The caller adds the tokens."""
        self.replay = None  # a replay starts from the state before a verification pass
        _, taps = target.forward(mx.array(tokens)[None], self.cache, layers)
        mx.eval([c.state for c in self.cache], taps)
        return taps

    def begin_pass(self) -> Optional[Replay]:
        """A verification pass starts after the cached tokens: what recurrent layers will need
        to roll back (None where there are none)."""
        self.replay = Replay(len(self.tokens)) if any(is_recurrent(c) for c in self.cache) else None
        return self.replay

    def chain_pass(self, forward: Callable, inputs: mx.array, layers: Sequence[int]):
        """The verification pass over inputs [last token, drafts...] after the cached tokens
        (forward: the target's, or a drafter's verify_forward): (logits, taps), lazy; the cache
        then holds them all until a roll-back."""
        replay = self.begin_pass()
        with verification(self.cache):
            return forward(inputs[None], self.cache, layers, replay=replay)

    def roll_back(self, length: int) -> bool:
        """Keep the first `length` cached positions; False where the cache cannot drop the rest
        exactly (a window that moved past them, a recurrent state outside the last verification
        pass): it must start again empty."""
        if length < len(self.tokens) and not rollback_to(self.cache, length, self.replay):
            return False
        self.tokens = self.tokens[:length]
        self.taps = {layer: _first_positions(pieces, length) for layer, pieces in self.taps.items()}
        return True


class Passes:
    """Where the engine's passes over the target run: on this process (this class), or on a
    target split over processes, whose other ranks are ordered to run each operation on their
    shard first (distributed.SplitPasses). Every operation on the target's cache goes through
    one; the engine calls these at the points named and nowhere else."""

    def __init__(self, target):
        self.target = target

    def refusal(self, what: str) -> Optional[str]:
        """Why an engine over these passes cannot do `what` (None: it can): "spawn" (more
        engines over the target: a batch), "sessions" (keep or switch conversations), "resume"
        (a prompt cache file)."""
        return None

    def start(self) -> None:
        """A generation starts."""

    def layers(self, drafter_taps: Sequence[int]) -> Sequence[int]:
        """The layers a prefill pass evaluates (the drafter's taps among them)."""
        return drafter_taps

    def fill(self, session: Session, tokens: List[int], layers: Sequence[int]) -> Dict[int, mx.array]:
        """One prefill pass (Session.fill): the taps of `layers`."""
        return session.fill(self.target, tokens, layers)

    def chain(self, session: Session, forward: Callable, inputs: mx.array, layers: Sequence[int]):
        """A chain's verification pass (Session.chain_pass)."""
        return session.chain_pass(forward, inputs, layers)

    def verifying(self):
        """A context around a whole verification: its pass and its verdict."""
        return contextlib.nullcontext()

    def settled(self, taps: Dict[int, mx.array], positions: int) -> Dict[int, mx.array]:
        """The chain's verdict is known: its pass's taps of `positions` positions, with any that
        other processes computed."""
        return taps

    def roll_back(self, session: Session, length: int) -> bool:
        """Session.roll_back."""
        return session.roll_back(length)

    def reset(self) -> None:
        """The cache is about to start again empty."""

    def quantize(self, session: Session, quantization: KVQuantization) -> None:
        """Quantize what is due in the cache (--kv-bits)."""
        quantization.apply(session.cache)

    def close(self) -> None:
        """The engine is done (Engine.close)."""


@dataclass(frozen=True)
class GenerationOptions:
    """What one generation asks besides its prompt, length and sampling."""

    # mlx-lm's logits processors (make_logits_processors: penalties, logit bias): pure functions
    # of (the tokens before a position, its logits [1, V]); applied at every verified position
    # to the tokens before it, drafts included, exactly as one-token decoding would see them.
    logits_processors: Tuple[Callable, ...] = ()
    logprobs: Optional[int] = None  # report each token's log-probability and this many alternatives
    distribution: bool = False  # and the whole distribution at its position (mlx-lm's logprobs [V])
    prediction: Tuple[int, ...] = ()  # the reply expected (OpenAI's Predicted Outputs): it drafts too


@dataclass
class Verdict:
    """What one verification pass decided; the cache already ends after the accepted drafts."""

    drafts: List[int]  # the drafts verified
    path: List[int]  # indices into drafts of the accepted ones, root to leaf
    next_token: int  # the target's own token after them
    taps: Dict[int, mx.array]  # the target's features at [last token, accepted drafts]
    seconds: float = 0.0  # what the pass cost this sequence (a batch's pass is shared)
    # Per committed token (the accepted drafts, then next_token), where the generation asks.
    logprobs: Optional[List[TokenLogprobs]] = None


@dataclass
class PendingPrefill:
    """The cache must hold `tokens` (it holds a prefix of them, engine.cached_tokens, and at most
    PREFILL_CHUNK fewer): the coroutine (Engine.run) is sent the taps {layer: [1, n, H]} of the
    positions computed."""

    tokens: List[int]


@dataclass
class PendingVerification:
    """A step's drafts, waiting for the target's pass: Engine.generate runs it at once, a
    BatchEngine one pass for every sequence's (batch.py). The coroutine that yielded it
    (Engine.run) is sent the Verdict."""

    context: List[int]  # every committed token; the last one is not in the cache yet
    draft: Draft  # what the policy kept, as verify takes it
    # The policy's P(the accepted path reaches each draft); None: no policy, verify them all.
    # A batch may verify only a chain's first drafts where the wider pass would not pay.
    reach: Optional[List[float]] = None


@dataclass
class StepResult:
    """One verification step, as the stats and the output read it."""

    proposed: int  # draft tokens the drafter proposed
    drafts: List[int]  # those verified
    path: List[int]  # indices into drafts of the accepted ones
    next_token: int
    logprobs: Optional[List[TokenLogprobs]] = None  # the verdict's

    @property
    def accepted(self) -> List[int]:
        return [self.drafts[i] for i in self.path]


class Engine:
    """One target, one drafter, one KV cache kept across calls (a chat session)."""

    def __init__(
        self,
        target,
        drafter: Optional[Drafter] = None,
        num_draft_tokens: int = 8,
        sampling: SamplingParams = SamplingParams(),
        seed: Optional[int] = None,
        residual: bool = False,
        adaptive: bool = True,
        policy: Optional[DraftPolicy] = None,
        stop_early: bool = False,
        sessions: bool = False,
        kv_quantization: Optional[KVQuantization] = None,
        max_kv_size: Optional[int] = None,
        passes: Optional[Passes] = None,
    ):
        """num_draft_tokens: the most drafts per step; adaptive: the policy decides how many
        (policy.py), else always that many. seed None: a fresh one (reported in the stats, so
        that the output can be repeated). residual: the classic acceptance rule (sampling.py).
        stop_early (adaptive only): drafters that draft one position at a time stop once the
        next draft would not pay, at the price of a sync per draft. sessions: keep what
        `detach`/`attach` need to switch between conversations (the drafter's taps).
        kv_quantization: mlx-lm's --kv-bits family (cache.KVQuantization); max_kv_size: its
        --max-kv-size (cache.BoundedKVCache). passes: where the target's passes run (Passes: on
        this process)."""
        self.passes = passes or Passes(target)
        if sessions:
            self._refuse("sessions")
        self.settings = dict(
            num_draft_tokens=num_draft_tokens,
            sampling=sampling,
            seed=seed,
            residual=residual,
            adaptive=adaptive,
            policy=policy,
            stop_early=stop_early,
            sessions=sessions,
            kv_quantization=kv_quantization,
            max_kv_size=max_kv_size,
        )
        self.kv_quantization, self.max_kv_size = kv_quantization, max_kv_size
        self.target = target
        self.drafter = drafter or NoDrafter()
        self.speculative = not isinstance(self.drafter, NoDrafter)
        self.num_draft_tokens = num_draft_tokens
        self.sampling = sampling.check(target.vocab_size)  # for calls that give none
        self.seed = seed  # None: a fresh one now, and per call where the caller wants (api.py)
        self.sampler = Sampler(self.sampling, secrets.randbits(32) if seed is None else seed, residual)
        self.policy = (policy or DraftPolicy()) if adaptive and self.speculative else None
        self.options = GenerationOptions()  # the current generation's (run)
        self.plan = DraftPlan(num_draft_tokens)  # this step's, which --stop-early consults
        self.keep_taps = sessions and bool(self.drafter.taps)
        self.drafter_stale = False  # True: the drafter's state is of another conversation
        self._attach(Session(cache=make_cache(target.model, max_kv_size)))
        # What the drafter shares with the engine, handed over once: the sampler (it draws with
        # the same noise), the target's cache as it is now, the policy's stopping rule.
        self.drafter.bind(
            self.sampler,
            lambda: self.cache,
            (
                (
                    lambda confidence: self.policy.worth_extending(
                        confidence, len(confidence), self.plan.probing
                    )
                )
                if stop_early and self.policy
                else None
            ),
        )
        if kv_quantization:
            kv_quantization.check(self.cache, target.model_type, self.speculative)
        if self.speculative:
            check_speculation(self.cache, target.model_type)
        if self.drafter.tree:
            check_tree(self.cache, target.model_type)

    def _refuse(self, what: str) -> None:
        reason = self.passes.refusal(what)
        if reason:
            raise MlxSpecError(reason)

    def spawn(self) -> "Engine":
        """An engine over the same target and drafter weights, with the same settings and a
        state of its own (its policy starts from what this one has learned)."""
        self._refuse("spawn")
        settings = dict(self.settings, policy=copy.deepcopy(self.policy))
        return type(self)(self.target, self.drafter.spawn(), **settings)

    def with_chain_drafts(self) -> Optional["Engine"]:
        """An engine with the same settings whose drafter drafts this source's chains (a batch
        verifies chains); None where the source drafts trees only."""
        drafter = None if self.passes.refusal("spawn") else self.drafter.chains()
        return None if drafter is None else type(self)(self.target, drafter, **self.settings)

    def unbatchable(self) -> Optional[str]:
        """Why this engine's generations cannot share a target pass with others (None: they can)."""
        refused = self.passes.refusal("spawn")
        if refused:
            return refused
        if self.drafter.tree:
            return "tree drafts are verified one sequence at a time"
        if self.drafter.verify_forward is not None:
            return "this drafter runs the target's own layers on one sequence's cache"
        if self.kv_quantization:
            return "a quantized KV cache (--kv-bits) is decoded one sequence at a time"
        return batchable(self.cache, self.target.model_type)

    @property
    def cache(self) -> List[Any]:
        return self.session.cache

    @property
    def cached_tokens(self) -> List[int]:
        """The tokens whose K/V are in the cache, in order."""
        return self.session.tokens

    def _attach(self, session: Session) -> None:
        self.session = session

    def reset(self) -> None:
        self.passes.reset()
        self._attach(Session(cache=make_cache(self.target.model, self.max_kv_size)))

    def close(self) -> None:
        """Done with the engine: let go of what it holds beyond memory (nothing, on one machine;
        a split target's other ranks). Called on the thread that runs it."""
        self.passes.close()

    def detach(self) -> Session:
        """Hand over the current conversation; the engine starts empty."""
        self._refuse("sessions")
        session = self.session
        self.reset()
        return session

    def attach(self, session: Session) -> None:
        """Continue a conversation handed over by `detach` (engine(sessions=True), where the
        drafter reads the target's features); the drafter starts over on it."""
        self._refuse("sessions")
        if self.drafter.taps and not self.keep_taps:
            raise MlxSpecError("this engine keeps no sessions: build it with sessions=True")
        self._attach(session)
        self.drafter_stale = True

    def resume(self, cache: List[Any]) -> int:
        """Continue from a prompt cache whose tokens are not known (a file of mlx_lm.cache_prompt,
        cache.read_prompt_cache): its n positions count as UNKNOWN_TOKEN, and a generate call's
        prompt is then [UNKNOWN_TOKEN] * n + what follows them. Returns n. Drafters that read the
        cached context (its features, or its tokens through a model) cannot continue it."""
        self._refuse("resume")
        if self.drafter.reads_cached_context:
            raise MlxSpecError(
                "a prompt cache file holds no tokens, which this draft source reads for the "
                "cached prompt: use --draft lookup, suffix or none"
            )
        if self.speculative and is_quantized(cache):
            raise MlxSpecError(
                f"the prompt cache file is quantized (--kv-bits): {QUANTIZED_SPECULATION}: use --draft none"
            )
        n = max(c.offset for c in cache if hasattr(c, "offset"))
        self._attach(Session([UNKNOWN_TOKEN] * n, list(cache)))
        return n

    def copy_session(self) -> Session:
        self._refuse("sessions")
        return self.session.copy()

    def _roll_back(self, length: int) -> None:
        """Keep the first `length` cached positions; a cache that cannot drop the rest exactly
        starts again empty."""
        if not self.passes.roll_back(self.session, length):
            self.reset()

    def _fill(self, tokens: List[int]):
        """Run the target over the tokens not yet cached (in chunks), so that the cache holds
        `tokens`; the taps of the positions it ran."""
        pieces = {}
        layers = self.passes.layers(self.drafter.taps)
        for i in range(len(self.cached_tokens), len(tokens), PREFILL_CHUNK):
            chunk = tokens[i : min(i + PREFILL_CHUNK, len(tokens))]
            self.filled(chunk, self.passes.fill(self.session, chunk, layers), pieces)
            self._quantize_if_due()
        return {layer: mx.concatenate(hs, axis=1) for layer, hs in pieces.items()}

    def _quantize_if_due(self) -> None:
        if self.kv_quantization:
            self.passes.quantize(self.session, self.kv_quantization)

    def filled(self, chunk: List[int], taps: Dict[int, mx.array], pieces: Dict[int, list]) -> None:
        """The cache now holds `chunk` too (a prefill pass, here or a batch's); its taps
        [1, len(chunk), H] join `pieces`."""
        for layer, h in taps.items():
            pieces.setdefault(layer, []).append(h)
        self.session.add(chunk)
        if self.keep_taps:
            self.session.record(taps)

    def _select(self, proposal: Draft, tic: float) -> List[int]:
        """Indices of the proposed drafts that the policy finds worth verifying. Evaluating
        them here (one sync) measures the drafter's cost and reads its confidences."""
        if self.policy is None or not len(proposal):
            return list(range(len(proposal)))
        mx.eval(proposal.tokens, proposal.confidence)
        self.policy.record_drafting(proposal.positions, time.perf_counter() - tic, self.plan.probing)
        return self.policy.select(
            proposal.confidences, proposal.parent_nodes, proposal.positions, self.plan.probing
        )

    def _verify(self, context: List[int], draft: Draft) -> Verdict:
        """One target pass over [last token] + drafts and the verdict, with one sync; the cache
        ends after the accepted drafts."""
        # Drafts arrive as ints (lookup) or as a lazy array (model drafters), which is then
        # evaluated together with the verification.
        drafts = draft.tokens if isinstance(draft.tokens, mx.array) else mx.array(draft.tokens, mx.int32)
        inputs = mx.concatenate([mx.array(context[-1:], mx.int32), drafts])
        if draft.parents is None:
            logits, taps = self.chain_pass(inputs)
            logits = self.processed(logits[0], context, drafts)
            decision = verify_chain(logits, drafts, draft.q, self.sampler, len(context))
            logprobs = self.chain_logprobs(logits, drafts, decision)
            mx.eval(decision, drafts)
            return self.settle_chain(context, drafts.tolist(), *decision.tolist(), taps, logprobs)
        start, replay = len(context) - 1, self.session.begin_pass()
        tree = Tree(draft.parents)
        logits, taps = tree_forward(self.target, inputs, tree, self.cache, self.drafter.taps, replay)
        logits = self.processed(logits[0], context, drafts, tree)
        mx.eval(logits, drafts)
        drafts = drafts.tolist()
        nodes, next_token = verify_tree(logits, drafts, tree, self.sampler, draft.q, len(context))
        compact(self.cache, start, nodes, len(tree), replay)
        path = [node - 1 for node in nodes[1:]]
        self.session.add(context[-1:] + [drafts[i] for i in path])
        verdict = self._kept(context, drafts, path, next_token, taps, mx.array(nodes))
        if self.options.logprobs is not None:
            tokens = mx.array([drafts[i] for i in path] + [next_token])
            verdict.logprobs = token_logprobs(self.logprob_rows(logits[mx.array(nodes)], tokens), len(nodes))
        return verdict

    def logprob_rows(self, logits: mx.array, tokens: mx.array) -> LogprobRows:
        """The logits [n, V] and the token each row commits, with what this generation asks
        (how many alternatives, the whole distribution), lazy."""
        return LogprobRows(logits, tokens.astype(mx.int32), self.options.logprobs, self.options.distribution)

    def processed(self, logits: mx.array, context: List[int], drafts: mx.array, tree: Optional[Tree] = None):
        """The logits [n, V] of a pass over [last token, drafts] with this generation's logits
        processors applied: row i to the tokens before the position it predicts (the context,
        then the drafts on the way to row i: drafts[:i] in a chain, the path to node i in a tree).
        Lazy, as the logits are."""
        processors = self.options.logits_processors
        if not processors:
            return logits
        before, rows = mx.array(context, mx.int32), []
        for i in range(logits.shape[0]):
            path = list(range(i)) if tree is None else [node - 1 for node in tree.path_to(i)[1:]]
            on_path = drafts[mx.array(path, mx.int32)] if path else drafts[:0]
            tokens, row = mx.concatenate([before, on_path]), logits[i : i + 1]
            for processor in processors:
                row = processor(tokens, row)
            rows.append(row)
        return mx.concatenate(rows, axis=0)

    def chain_logprobs(self, logits: mx.array, drafts: mx.array, decision: mx.array):
        """Where the generation asks for logprobs: a chain's (processed) logits and the token
        each row would commit (the draft before the verdict's n, the target's token at n), lazy;
        token_logprobs reads the first n + 1 rows once the verdict is known."""
        if self.options.logprobs is None:  # nothing built where nothing is asked
            return None
        rows = mx.arange(drafts.shape[0] + 1)
        tokens = mx.where(rows == decision[0], decision[1], mx.concatenate([drafts, decision[1:2]]))
        return self.logprob_rows(logits, tokens)

    def chain_pass(self, inputs: mx.array):
        """The target's pass over inputs [last token, drafts...] after the cached tokens:
        (logits, taps), lazy."""
        forward = self.drafter.verify_forward or self.target.forward
        return self.passes.chain(self.session, forward, inputs, self.drafter.taps)

    def settle_chain(
        self,
        context: List[int],
        drafts: List[int],
        n_accepted: int,
        next_token: int,
        taps: Dict[int, mx.array],
        logprobs=None,
    ) -> Verdict:
        """After a pass over [context[-1]] + drafts (and whatever padding followed them, in a
        batch): keep the accepted drafts in the cache, drop the rest. taps: [1, width, H];
        logprobs: chain_logprobs' rows (None: not asked)."""
        taps = self.passes.settled(taps, 1 + len(drafts))
        self.session.add(context[-1:] + drafts)
        path = list(range(n_accepted))
        self._roll_back(len(context) + n_accepted)
        verdict = self._kept(context, drafts, path, next_token, taps, slice(0, n_accepted + 1))
        verdict.logprobs = token_logprobs(logprobs, n_accepted + 1)
        return verdict

    def _kept(self, context, drafts, path, next_token, taps, rows) -> Verdict:
        kept = {layer: h[:, rows] for layer, h in taps.items()}
        if len(self.cached_tokens) < len(context) + len(path):
            # The cache had to start again: fill it with the committed tokens (exact, slow).
            self._fill(context + [drafts[i] for i in path])
        elif self.keep_taps:
            self.session.record(kept)
        return Verdict(drafts, path, next_token, kept)

    def _step(self, context: List[int]):
        """Draft up to self.plan.length, have what the policy keeps verified, commit: a
        coroutine that yields the PendingVerification and returns the StepResult."""
        tic = time.perf_counter()
        proposal = self.drafter.propose(self.plan.length)
        kept = self._select(proposal, tic)
        reach = None
        if self.policy is not None:
            reach = self.policy.reach(proposal.confidences, proposal.parent_nodes, self.plan.probing)
            reach = [reach[i] for i in kept]
        verdict = yield PendingVerification(context, proposal.subset(kept).as_chain(), reach)
        kept = kept[: len(verdict.drafts)]  # what was verified (a batch may cut a chain)
        path = [kept[i] for i in verdict.path]  # in the proposal's indices
        if self.policy:
            self.policy.record_verification(1 + len(verdict.drafts), verdict.seconds)
            self.policy.observe(StepOutcome(proposal.confidences, proposal.parent_nodes, kept, path))
        self.drafter.commit([verdict.drafts[i] for i in verdict.path], verdict.next_token, verdict.taps)
        return StepResult(len(proposal), verdict.drafts, verdict.path, verdict.next_token, verdict.logprobs)

    def _prefill(self, context: List[int]):
        """Bring the cache to context[:-1], reusing the longest prefix already there: a
        coroutine that yields the PendingPrefill and returns how many tokens were reused."""
        start = min(common_prefix_length(self.cached_tokens, context), len(context) - 1)
        if self.drafter.taps and start > 0:
            # Recompute at least one position: feature drafters pair the last prompt token with
            # the target's features of the position before it.
            start -= 1
        self._roll_back(start)
        start = len(self.cached_tokens)  # 0 when the cache could not roll back
        # A chunk per pass: a batch's other rows go on between them, a caller sees the progress
        # (and may stop there).
        pieces, prompt = {}, list(context[:-1])
        while True:
            end = min(len(self.cached_tokens) + PREFILL_CHUNK, len(prompt))
            for layer, h in (yield PendingPrefill(prompt[:end])).items():
                pieces.setdefault(layer, []).append(h)
            if end == len(prompt):
                break
            yield Prefilling(end - start, len(prompt) - start)
        taps = {layer: mx.concatenate(hs, axis=1) for layer, hs in pieces.items()}
        reused = start
        if self.drafter_stale:
            # The drafter starts over on this conversation, from the features the session kept.
            start, self.drafter_stale = 0, False
            if self.keep_taps:
                taps = {layer: mx.concatenate(pieces, axis=1) for layer, pieces in self.session.taps.items()}
        self.drafter.prefill(list(context), taps, start)
        return reused

    def generate(
        self,
        prompt: Sequence[int],
        max_tokens: int = 256,
        stop_strings: Sequence[str] = (),
        sampling: Optional[SamplingParams] = None,
        seed: Optional[int] = None,
        options: GenerationOptions = GenerationOptions(),
    ) -> Iterator[Event]:
        """sampling: this call's settings (default: the engine's); seed: this call's and the
        next calls' (default: the last one); options: logits processors, logprobs, a prediction."""
        run = self.run(prompt, max_tokens, stop_strings, sampling, seed, options)
        try:
            event = next(run)
            while True:
                if isinstance(event, (PendingPrefill, PendingVerification)):
                    try:
                        reply = self._pass(event)
                    except BaseException as e:
                        event = run.throw(e)  # it starts over, and raises e
                        continue
                    event = run.send(reply)
                else:
                    yield event
                    event = next(run)
        except StopIteration:
            return
        finally:
            run.close()

    def _pass(self, pending):
        """The target's pass a PendingPrefill (-> taps) or PendingVerification (-> Verdict) waits for."""
        if isinstance(pending, PendingPrefill):
            return self._fill(pending.tokens)
        tic = time.perf_counter()
        with self.passes.verifying():
            verdict = self._verify(pending.context, pending.draft)
        self._quantize_if_due()
        verdict.seconds = time.perf_counter() - tic
        return verdict

    def run(
        self,
        prompt: Sequence[int],
        max_tokens: int = 256,
        stop_strings: Sequence[str] = (),
        sampling: Optional[SamplingParams] = None,
        seed: Optional[int] = None,
        options: GenerationOptions = GenerationOptions(),
    ):
        """generate as a coroutine that leaves the target's passes to its caller: it yields
        generate's events, a PendingPrefill (to be sent the taps) and, at each step, a
        PendingVerification (to be sent the Verdict)."""
        self.passes.start()
        prompt = list(prompt)
        self._check(prompt, max_tokens)
        self.sampler.params = (sampling or self.sampling).check(self.target.vocab_size)
        if seed is not None:
            self.sampler.reseed(seed)
        source, self.options = self.drafter, options
        if options.prediction:
            self.drafter = self._predicted(options.prediction)
        try:
            return (yield from self._generation(prompt, max_tokens, stop_strings))
        finally:
            self.drafter, self.options = source, GenerationOptions()

    def _predicted(self, prediction: Sequence[int]) -> Drafter:
        """The engine's drafter with a request's prediction before it (drafters/prediction.py);
        drafting adapts as for any source (a policy of its own where the engine drafts nothing)."""
        if self.drafter.verify_forward is not None:
            raise MlxSpecError(
                "a prediction drafts beside the engine's source, and this one runs the target's "
                "own layers: use another --draft"
            )
        check_speculation(self.cache, self.target.model_type)
        if self.policy is None and self.settings["adaptive"]:
            self.policy = DraftPolicy()
        drafter = Combined(PredictionDrafter(prediction), self.drafter, self.num_draft_tokens)
        drafter.bind(self.sampler, lambda: self.cache)
        return drafter

    def _generation(self, prompt: List[int], max_tokens: int, stop_strings: Sequence[str]):
        stats = Stats(prompt_tokens=len(prompt), seed=self.sampler.seed)
        if self.policy:
            self.policy.new_text()
        tic = time.perf_counter()
        stats.prompt_cached = yield from self._prefill(prompt)
        stats.prompt_seconds = time.perf_counter() - tic
        yield Prefilled(stats)

        output = _Output(self.target, stop_strings, max_tokens, stats)
        context = list(prompt)  # every committed token; context[-1] is not in the cache yet
        tic = time.perf_counter()
        try:
            while not stats.finish_reason:
                # Never draft past max_tokens: a step commits at most k + 1 tokens.
                most = max(self.num_draft_tokens, PREDICTED_DRAFTS if self.options.prediction else 0)
                k = min(most, max_tokens - stats.generated_tokens - 1)
                self.plan = self.policy.plan(k) if self.policy else DraftPlan(k)
                step = yield from self._step(context)
                accepted = step.accepted
                stats.steps += 1
                stats.plain_steps += not step.drafts
                stats.drafted_tokens += step.proposed
                stats.verified_drafts += len(step.drafts)
                stats.accepted_drafts += len(accepted)
                stats.committed_tokens += len(accepted) + 1
                yield Step(len(step.drafts), len(accepted))

                for i, token in enumerate(accepted + [step.next_token]):  # EOS, a stop string or the
                    context.append(token)  # limit may end the output
                    logprobs = step.logprobs[i] if step.logprobs else None  # inside the drafts
                    yield from output.add(token, i < len(accepted), logprobs)
                    if stats.finish_reason:
                        break
            yield from output.flush()
        except GeneratorExit:  # closed at an event: the cache holds what it says it holds
            stats.finish_reason = stats.finish_reason or "interrupted"
            stats.generate_seconds = time.perf_counter() - tic
            raise
        except BaseException:
            self.reset()  # an interrupted step leaves cache and drafter out of step
            raise
        stats.generate_seconds = time.perf_counter() - tic
        # Drafts committed past EOS/stop/limit are dropped: the cache keeps only what is kept.
        self._roll_back(len(context) - 1)
        self.drafter.finish(context[len(prompt) :])
        yield Done(stats)

    def _check(self, prompt: List[int], max_tokens: int) -> None:
        if not prompt:
            raise MlxSpecError("the prompt is empty")
        if max_tokens < 1:
            raise MlxSpecError(f"max tokens must be >= 1, got {max_tokens}")
        limit = self.target.context_length
        if limit is not None and len(prompt) + max_tokens > limit:
            raise MlxSpecError(
                f"prompt ({len(prompt)} tokens) + max tokens ({max_tokens}) exceed the model's "
                f"context of {limit} tokens"
            )


def _first_positions(pieces: List[mx.array], length: int) -> List[mx.array]:
    """The pieces [1, n_i, H] cut to their first `length` positions in all."""
    kept, n = [], 0
    for piece in pieces:
        if n >= length:
            break
        take = min(piece.shape[1], length - n)
        kept.append(piece if take == piece.shape[1] else piece[:, :take])
        n += take
    return kept


class _Output:
    """Turns committed tokens into output events; decides when the output ends (EOS, a stop
    string, max tokens) and records why in stats.finish_reason. Text that may be the start of
    a stop string is held back until it is known not to be one: nothing printed is taken back."""

    def __init__(self, target, stop_strings, max_tokens, stats):
        self.eos = set(target.eos_token_ids)
        self.detokenizer = target.tokenizer.detokenizer if target.tokenizer is not None else None
        if self.detokenizer is not None:
            self.detokenizer.reset()
        self.stop_strings, self.max_tokens, self.stats = stop_strings, max_tokens, stats
        self.text, self.printed = "", 0

    def _release(self) -> str:
        """The text that can be printed now."""
        end = len(self.text)
        hits = [(self.text.find(s, max(0, self.printed - len(s))), s) for s in self.stop_strings]
        hits = [(h, s) for h, s in hits if h >= 0]
        if hits:
            end, self.stats.stop_string = min(hits)
            self.stats.finish_reason = "stop"
        else:  # hold back a suffix that a stop string starts with
            for s in self.stop_strings:
                for n in range(min(len(s) - 1, end - self.printed), 0, -1):
                    if s.startswith(self.text[len(self.text) - n :]):
                        end = min(end, len(self.text) - n)
                        break
        segment, self.printed = self.text[self.printed : end], max(self.printed, end)
        return segment

    def add(self, token: int, from_draft: bool, logprobs: Optional[TokenLogprobs] = None):
        stats = self.stats
        if token in self.eos:
            stats.finish_reason = "eos"
            return
        stats.generated_tokens += 1
        if self.detokenizer is not None:
            self.detokenizer.add_token(token)
            self.text += self.detokenizer.last_segment
        yield Token(token, self._release(), from_draft, logprobs)
        if not stats.finish_reason and stats.generated_tokens >= self.max_tokens:
            stats.finish_reason = "length"

    def flush(self):
        if self.detokenizer is not None and self.stats.finish_reason != "stop":
            self.detokenizer.finalize()
            self.text += self.detokenizer.last_segment
            # Nothing more will come: what was held back for a stop string is text after all.
            if self.text[self.printed :]:
                yield Text(self.text[self.printed :])
