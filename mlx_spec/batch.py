"""Batched speculative decoding: several generations share each target pass.

Each sequence is a row with an Engine of its own (its drafter's state, sampler, policy, cached
tokens), all over one target. Engine.run leaves the target's passes to its caller; here one
pass per step runs over every row's [last token, its drafts], padded to the widest row, on a
RaggedKVCache (cache.py) in which each row keeps its own length. Each row's verdict comes from
its own logits by the rule it would meet alone (verify.py), with its own sampler, so a row's
output is what it would be alone: the same tokens greedy, the same tokens for a seed sampled.

New rows are prefilled together (their whole prompts, between two steps of the others, in
passes over all of them on a ragged cache of their own) and then join the batch; a finished or
removed row leaves it with its cache as a KVCache again (a server keeps it as the
conversation's). How wide the pass is gets decided for the batch (the expected tokens of each
row's drafts against the measured cost of rows x width tokens), and each row's policy is
charged its share of the pass (`shares`): the plain pass split evenly, the widening by drafts,
so that a row drafting alone in a wide batch pays for every row's padding."""

import time
from dataclasses import dataclass, field
from typing import Dict, Generator, Iterator, List, Optional, Sequence, Tuple

import mlx.core as mx

from .cache import RaggedKVCache, RaggedRow
from .cost import LinearCost
from .drafters.base import Draft
from .engine import PREFILL_CHUNK, Engine, GenerationOptions, PendingPrefill, PendingVerification, Verdict
from .errors import MlxSpecError
from .events import Event, Failed, Prefilled
from .logprobs import committed_logprobs
from .sampling import SamplingParams
from .verify import verify_chain


def _check(engine: Engine) -> None:
    reason = engine.unbatchable()
    if reason is not None:
        raise MlxSpecError(f"requests cannot share a pass: {reason}")


@dataclass(eq=False)  # a row is itself, whatever it holds
class Row:
    engine: Engine
    run: Generator  # engine.run(...)
    index: int = -1  # its row in the batch's cache; -1 until it joins
    started: bool = False
    verdict: Optional[Verdict] = None  # the last pass's, sent at the next step
    pending: Optional[PendingVerification] = field(default=None, repr=False)
    prefill: Optional[PendingPrefill] = field(default=None, repr=False)  # its prompt's next chunk


class BatchEngine:
    def __init__(self, engines: Sequence[Engine]):
        """engines: one per row that may run at once, over one target (each with its own draft
        source and settings: a batch may mix them)."""
        if not engines:
            raise MlxSpecError("a batch needs at least one engine")
        for engine in engines:
            _check(engine)
            if engine.target is not engines[0].target:
                raise MlxSpecError("a batch's engines must share one target")
        self.target = engines[0].target
        self.taps = sorted(set().union(*(e.drafter.taps for e in engines)))
        self.engines = list(engines)
        self.idle = list(self.engines)
        self.rows: List[Row] = []
        self.cache = [RaggedKVCache() for _ in engines[0].cache]
        # Seconds of a pass by the tokens it runs (rows x width): mostly reading the weights
        # while few, then growing with each token (prior: 11 tokens ~ 2x one, as cost.py's).
        self.pass_cost = LinearCost(prior_ratio=0.1)

    @classmethod
    def spawned(cls, engine: Engine, max_batch: int) -> "BatchEngine":
        """engine and max_batch - 1 engines spawned from it (the same drafter weights)."""
        if max_batch < 1:
            raise MlxSpecError(f"--max-batch must be >= 1, got {max_batch}")
        _check(engine)  # before spawning copies of what cannot batch
        return cls([engine] + [engine.spawn() for _ in range(max_batch - 1)])

    def add(
        self,
        prompt: Sequence[int],
        max_tokens: int = 256,
        stop_strings: Sequence[str] = (),
        sampling: Optional[SamplingParams] = None,
        seed: Optional[int] = None,
        options: GenerationOptions = GenerationOptions(),
        engine: Optional[Engine] = None,
    ) -> Row:
        """A new generation (Engine.generate's arguments), started at the next step. engine: the
        idle one to run it (a server picks the one holding the conversation); default any."""
        if not self.idle:
            raise MlxSpecError(f"the batch is full ({len(self.engines)} rows)")
        engine = engine or self.idle[-1]
        self.idle.remove(engine)
        row = Row(engine, engine.run(prompt, max_tokens, stop_strings, sampling, seed, options))
        self.rows.append(row)
        return row

    def generate_all(self, requests: Sequence[dict]) -> Iterator[Tuple[int, Event]]:
        """Every request (add's keyword arguments), in order, as many at once as engines are
        idle (continuous batching); (the request's index, each of its events), each request's
        in order. A request that fails yields Failed and the others go on."""
        todo, index = list(enumerate(requests)), {}
        while todo or self.rows:
            while todo and self.idle:
                i, request = todo.pop(0)
                index[id(self.add(**request))] = i
            for row, event in self.step():
                yield index[id(row)], event

    def remove(self, row: Row) -> None:
        """Stop a generation now (a client gone). Its conversation is dropped: the step it was
        in never committed."""
        row.run.close()
        if row in self.rows:  # not already gone (a step that failed)
            self._leave(row)
        row.engine.reset()

    def step(self) -> List[Tuple[Row, Event]]:
        """One step of every row: rows still prefilling run their prompt's next chunk (in passes
        they share) and join once it is in, each row drafts, one target pass verifies every
        joined row's drafts, each row commits. Returns the rows'
        events (Engine.generate's, and Failed for a row that failed and left), each row's in
        order."""
        events = []
        for row in list(self.rows):
            if row.prefill is None:  # else it waits for its prompt's next chunk
                self._advance(row, row.verdict, events)
        prefills = [(row, row.prefill) for row in self.rows if row.prefill is not None]
        if prefills:
            try:
                filled = self._prefill(prefills)
            except Exception as e:  # the new rows fail; the others go on
                for row, _ in prefills:
                    self._fail(row, e, events)
                filled = []
            for row, taps in filled:
                row.prefill = None
                self._advance(row, taps, events)
        if any(row.pending is not None for row in self.rows):
            self._verify()
        return events

    def _advance(self, row: Row, value, events: list) -> None:
        """Run a row's coroutine (sent `value`) to its next pass, collecting its events; the
        pass it waits for is kept as row.pending (a verification) or row.prefill."""
        try:
            event = row.run.send(value) if row.started else next(row.run)
            row.started, row.verdict = True, None
            while not isinstance(event, (PendingPrefill, PendingVerification)):
                events.append((row, event))
                if isinstance(event, Prefilled):
                    self._join(row)
                event = next(row.run)
        except StopIteration:
            self._leave(row)
            return
        except Exception as e:  # this row's alone (a prompt too long): the others go on
            self._fail(row, e, events)
            return
        if isinstance(event, PendingVerification):
            row.pending = event
        else:
            row.prefill = event

    def _fail(self, row: Row, error: Exception, events: list) -> None:
        events.append((row, Failed(error)))
        row.run.close()
        self._leave(row)
        row.engine.reset()

    def _prefill(self, prefills: List[Tuple[Row, PendingPrefill]]) -> List[Tuple[Row, Dict[int, mx.array]]]:
        """Bring each new row's own cache to its prompt, in passes over all the rows still
        filling, on a ragged cache of their own: each pass feeds every such row as many tokens
        as the shortest still needs, so no pass computes padding and there are no more passes
        than rows (a prefill of a few dozen tokens is far from filling the CPU: several cost
        little more than one). Each row's taps."""
        todo = [p.tokens[len(row.engine.cached_tokens) :] for row, p in prefills]
        rows = [row for (row, _), tokens in zip(prefills, todo) if tokens]
        todo = [tokens for tokens in todo if tokens]
        pieces = {id(row): {} for row, _ in prefills}
        cache = [RaggedKVCache() for _ in self.cache]
        for row in rows:
            for batch, own in zip(cache, row.engine.cache):
                batch.add(own)
        done, active = [0] * len(rows), list(range(len(rows)))  # active[i]: the row in cache row i
        while active:
            width = min(PREFILL_CHUNK, *(len(todo[b]) - done[b] for b in active))
            chunks = [todo[b][done[b] : done[b] + width] for b in active]
            _, taps = self.target.forward(mx.array(chunks, mx.int32), cache, self.taps)
            mx.eval([c.state for c in cache], taps)
            for i, (b, chunk) in enumerate(zip(active, chunks)):
                own = {
                    layer: mx.take(taps[layer], mx.array([i]), axis=0)
                    for layer in rows[b].engine.drafter.taps
                }
                rows[b].engine.filled(chunk, own, pieces[id(rows[b])])
                done[b] += width
            for i in reversed(range(len(active))):  # a row whose prompt is in leaves with its cache
                if done[active[i]] == len(todo[active[i]]):
                    rows[active[i]].engine.session.move_to([batch.take(i) for batch in cache])
                    del active[i]
        return [
            (row, {layer: mx.concatenate(hs, axis=1) for layer, hs in pieces[id(row)].items()})
            for row, _ in prefills
        ]

    def _width(self, pending: List[PendingVerification]) -> int:
        """The pass's width (1 + drafts per row): the one with the most expected tokens per
        second over the whole batch, from each row's policy's P(reach) of its drafts and the
        measured cost of a pass over rows x width tokens. Rows without a policy (a fixed number
        of drafts) are never cut, nor a row alone (its own policy weighed its drafts against
        the pass, which is its own)."""
        if len(pending) == 1:
            return 1 + len(pending[0].draft)
        fixed = [1 + len(p.draft) for p in pending if p.reach is None]
        reach = [p.reach for p in pending if p.reach is not None]
        widest = max([1 + len(r) for r in reach] + fixed)
        best, best_rate = widest, 0.0
        for width in range(max(fixed, default=1), widest + 1):
            expected = sum(fixed) + sum(1 + sum(r[: width - 1]) for r in reach)
            rate = expected / self.pass_cost(len(pending) * width)
            if rate > best_rate:
                best, best_rate = width, rate
        return best

    def shares(self, widths: List[int], width: int) -> List[float]:
        """Each row's share of a pass of `width` over rows of `widths` (1 + its drafts), as its
        policy counts its verification: the plain pass split evenly, the widening charged to
        the rows that drafted, by their drafts. A row that widens the pass alone pays for the
        padding of every other row, which is what its drafts cost the batch; split evenly, it
        would see a widening B times cheaper than it is and draft where it does not pay."""
        extra = sum(w - 1 for w in widths)
        if not extra:
            return [1 / len(widths)] * len(widths)
        plain = min(1.0, self.pass_cost(len(widths)) / self.pass_cost(len(widths) * width))
        return [plain / len(widths) + (1 - plain) * (w - 1) / extra for w in widths]

    def _join(self, row: Row) -> None:
        """Move the prefilled row's cache into the batch's."""
        engine = row.engine
        row.index = len([r for r in self.rows if r.index >= 0])
        for batch, own in zip(self.cache, engine.cache):
            batch.add(own)
        engine.session.move_to([RaggedRow(batch, row) for batch in self.cache])

    def _leave(self, row: Row) -> None:
        if row.index >= 0:
            row.engine.session.move_to([batch.take(row.index) for batch in self.cache])
            for other in self.rows:
                if other.index > row.index:
                    other.index -= 1
        self.rows.remove(row)
        self.idle.append(row.engine)

    def _verify(self) -> None:
        """One target pass over every row's [last token, drafts]; each row's verdict."""
        tic = time.perf_counter()
        rows = sorted((row for row in self.rows if row.pending is not None), key=lambda r: r.index)
        width = self._width([row.pending for row in rows])
        inputs = []
        for row in rows:
            context, draft = row.pending.context, row.pending.draft
            drafts = draft.tokens if isinstance(draft.tokens, mx.array) else mx.array(draft.tokens, mx.int32)
            if row.pending.reach is not None and len(draft) >= width:  # cut to the pass's width
                drafts = drafts[: width - 1]
                row.pending.draft = Draft(tokens=drafts, q=None if draft.q is None else draft.q[: width - 1])
            inputs.append((context, drafts, mx.concatenate([mx.array(context[-1:], mx.int32), drafts])))
        widths = [x.shape[0] for _, _, x in inputs]
        padded = mx.stack([mx.pad(x, [(0, width - x.shape[0])]) for _, _, x in inputs])
        logits, taps = self.target.forward(padded, self.cache, self.taps)
        logits = [
            row.engine.processed(logits[b, : widths[b]], context, drafts)
            for b, (row, (context, drafts, _)) in enumerate(zip(rows, inputs))
        ]
        decisions = [
            verify_chain(logits[b], drafts, row.pending.draft.q, row.engine.sampler, len(context))
            for b, (row, (context, drafts, _)) in enumerate(zip(rows, inputs))
        ]
        logprobs = [
            row.engine.chain_logprobs(logits[b], drafts, decisions[b])
            for b, (row, (_, drafts, _)) in enumerate(zip(rows, inputs))
        ]
        mx.eval(decisions, [drafts for _, drafts, _ in inputs])
        decisions = [decision.tolist() for decision in decisions]
        committed_logprobs(
            [(lp, n_accepted + 1) for lp, (n_accepted, _) in zip(logprobs, decisions) if lp is not None]
        )
        for batch in self.cache:  # padding past each row's drafts is not the row's
            batch.lengths = [n - (width - w) for n, w in zip(batch.lengths, widths)]
        seconds = time.perf_counter() - tic
        self.pass_cost.record(len(rows) * width, seconds)
        shares = self.shares(widths, width)
        for b, (row, (context, drafts, _)) in enumerate(zip(rows, inputs)):
            n_accepted, next_token = decisions[b]
            # Gathered: a session keeps them, and a slice would keep every row's alive.
            own = {layer: mx.take(taps[layer], mx.array([b]), axis=0) for layer in row.engine.drafter.taps}
            row.verdict = row.engine.settle_chain(
                context, drafts.tolist(), n_accepted, next_token, own, logprobs[b]
            )
            row.verdict.seconds = seconds * shares[b]
            row.pending = None
