"""The target split across processes: MLX's distributed layer (`mlx.launch`, any backend) and
mlx-lm's own sharding (`model.shard`: tensor parallel; `model.model.pipeline`: pipeline stages).

Rank 0 owns everything but the target's other shards: the tokenizer, the prompt, the drafter,
the sampler and the output. Each operation that touches the target's cache is sent to the
other ranks first (an order: an op code and ints, passed down the chain of ranks, so that rank
0 never waits for it to arrive), then run by every rank alike: a prefill, a verification pass, a roll-back, a reset, a
--kv-bits quantization. A rank runs the same passes over the same tokens, so every collective
inside the model meets its partner; the verdict is rank 0's alone, and a roll-back carries its
result. Between passes only orders cross, and under pipeline stages the outputs of the layers
rank 0's drafter reads, which their rank sends after each pass.
"""

import os
import sys
import threading
import time
from typing import Callable, Dict, List, Optional, Sequence, Tuple

import mlx.core as mx

from .cache import make_cache
from .engine import Engine, Passes, Session
from .errors import MlxSpecError, RanksLost

SHARDINGS = ("tensor", "pipeline", "auto")
RANK_TIMEOUT = 120.0  # seconds a pass (a prefill chunk) may wait for another rank before the run ends

ONE_CONVERSATION = (
    "a split target keeps one conversation (the other ranks mirror one cache): engine sessions "
    "do not run over --sharding"
)

# What rank 0 asks of the others.
STOP, FILL, VERIFY, ROLLBACK, RESET, QUANTIZE, TAPS, PLAIN = range(8)  # PLAIN: Follower.follow's `plain`


def init_group(sharding: str):
    """The group of processes mlx.launch started (one line where there is none to split over)."""
    if sharding not in SHARDINGS:
        raise MlxSpecError(f"unknown sharding {sharding!r}: choose {', '.join(SHARDINGS)}")
    group = mx.distributed.init()
    if group.size() < 2:
        raise MlxSpecError(
            f"--sharding {sharding} splits the target over the processes that mlx.launch starts, "
            "and this one is alone: run `mlx.launch --hosts ... mlx-spec ...` (README)"
        )
    return group


def _divisible(config: dict, size: int) -> Optional[str]:
    cfg = config.get("text_config", config)
    for key in ("num_attention_heads", "num_key_value_heads", "intermediate_size"):
        value = cfg.get(key)
        if isinstance(value, int) and value % size:
            return f"its {key} ({value}) is not a multiple of the {size} ranks"
    return None


def choose_sharding(model, config: dict, size: int) -> Tuple[str, str]:
    """--sharding auto: (tensor or pipeline, why, in a few words). Tensor parallelism where the
    model's heads split evenly over the ranks (every rank computes a share of every layer),
    else pipeline stages (a rank computes its layers while the others wait); one line where
    mlx-lm can do neither."""
    model_type = config.get("model_type", "this")
    why_not_tensor = (
        f"mlx-lm cannot tensor-shard a {model_type} model"
        if not hasattr(model, "shard")
        else _divisible(config, size)
    )
    if why_not_tensor is None:
        return "tensor", f"its attention heads split evenly over {size} ranks"
    if hasattr(getattr(model, "model", None), "pipeline"):
        return "pipeline", why_not_tensor
    raise MlxSpecError(
        f"cannot split this {model_type} model: {why_not_tensor}, and mlx-lm has no pipeline stages for it"
    )


def shard_model(model, config: dict, sharding: str, group) -> str:
    """Split the (lazily loaded) model over the group as mlx-lm's sharded_load does (auto:
    choose_sharding's); one line where mlx-lm cannot split this model so. The sharding used."""
    model_type = config.get("model_type", "this")
    if sharding == "auto":
        sharding, why = choose_sharding(model, config, group.size())
        if group.rank() == 0:
            print(f"mlx-spec: --sharding auto: {sharding} ({why})", file=sys.stderr, flush=True)
    if sharding == "tensor":
        if not hasattr(model, "shard"):
            raise MlxSpecError(
                f"mlx-lm cannot tensor-shard a {model_type} model"
                + (": try --sharding pipeline" if hasattr(getattr(model, "model", None), "pipeline") else "")
            )
        why = _divisible(config, group.size())
        if why:
            raise MlxSpecError(
                f"cannot tensor-shard this {model_type} model over {group.size()} ranks: {why}"
            )
        model.shard(group)
    else:
        inner = getattr(model, "model", None)
        if not hasattr(inner, "pipeline"):
            raise MlxSpecError(
                f"mlx-lm has no pipeline stages for a {model_type} model"
                + (": try --sharding tensor" if hasattr(model, "shard") else "")
            )
        if len(inner.layers) < group.size():
            raise MlxSpecError(
                f"the model's {len(inner.layers)} layers cannot make {group.size()} pipeline stages"
            )
        inner.pipeline(group)
    return sharding


def held_layers(target) -> range:
    """The decoder layers whose outputs this rank computes (all of them under tensor sharding)."""
    inner = getattr(target.model, "model", None)
    start = getattr(inner, "start_idx", 0) or 0
    end = getattr(inner, "end_idx", None)
    return range(start, target.num_layers if end is None else end)


class Watchdog:
    """Ends the process with one line when rank 0 waits on the other ranks longer than
    `seconds` (a rank that hangs; one that dies breaks the connection, which raises at once).
    MLX releases the GIL while it waits, so this thread runs."""

    def __init__(self, seconds: float):
        self.seconds, self.deadline, self.what = seconds, None, ""
        threading.Thread(target=self._watch, daemon=True).start()

    def arm(self, what: str) -> None:
        self.deadline, self.what = time.monotonic() + self.seconds, what

    def _watch(self):
        while True:
            time.sleep(min(1.0, self.seconds / 4))
            deadline = self.deadline
            if deadline is not None and time.monotonic() > deadline:
                print(
                    f"Error: the other ranks did not answer within {self.seconds:g} s ({self.what}): a rank "
                    "hangs or cannot be reached",
                    file=sys.stderr,
                    flush=True,
                )
                os._exit(1)


class Channel:
    """Rank 0's orders to the other ranks: [op, n, ints...] passed down the chain of ranks (a
    second message for ints past the first FRAME), on the CPU stream as mlx-lm's collectives
    outside the model;
    and the outputs of layers other ranks hold, sent to rank 0 after a pass. `stages`: the
    layers each rank holds (Channel.connect)."""

    FRAME = 64

    def __init__(self, group, stages: Sequence[range], watchdog: Optional[Watchdog] = None):
        self.group, self.stages, self.watchdog = group, list(stages), watchdog
        self.broken = False  # a collective failed: a rank is gone

    @classmethod
    def connect(cls, group, target, watchdog: Optional[Watchdog] = None) -> "Channel":
        """Every rank calls this once the target is split: they learn each other's layers."""
        held = held_layers(target)
        try:
            stages = mx.distributed.all_gather(
                mx.array([[held.start, held.stop]], mx.int32), group=group, stream=mx.cpu
            )
            mx.eval(stages)
        except RuntimeError as e:  # a rank that died while loading
            raise RanksLost(f"cannot reach the other ranks: {str(e).splitlines()[0]}") from None
        return cls(group, [range(a, b) for a, b in stages.tolist()], watchdog)

    @property
    def leader(self) -> bool:
        return self.group.rank() == 0

    def holder(self, layer: int) -> int:
        """The rank computing `layer`'s output (-1, the embedding's: the rank holding layer 0)."""
        return next(rank for rank, held in enumerate(self.stages) if max(layer, 0) in held)

    def _all_sum(self, values: List[int]) -> List[int]:
        out = mx.distributed.all_sum(mx.array(values, mx.int32), group=self.group, stream=mx.cpu)
        mx.eval(out)
        return out.tolist()

    def _pass_on(self, values: Optional[List[int]], n: int) -> List[int]:
        """Rank 0's `values` (n int32) on every rank, down the chain 0 -> 1 -> ... -> size-1 (a
        ring's ranks send only to their neighbours): rank 0 does not wait for it to arrive, and
        rank r has it after r one-way latencies (an all_sum would cost rank 0 a round trip)."""
        rank, size = self.group.rank(), self.group.size()
        if rank == 0:
            mx.eval(mx.distributed.send(mx.array(values, mx.int32), 1, group=self.group, stream=mx.cpu))
            return values
        received = mx.distributed.recv((n,), mx.int32, rank - 1, group=self.group, stream=mx.cpu)
        if rank + 1 < size:
            received = mx.distributed.send(received, rank + 1, group=self.group, stream=mx.cpu)
        mx.eval(received)
        return received.tolist()

    def _exchange(self, op: int, ints: Sequence[int]) -> Tuple[int, List[int]]:
        """An order [op, n, ints...] from rank 0, in a frame of FRAME ints (and a second message
        for the ints past it)."""
        ints = list(ints)
        frame = [op, len(ints)] + ints[: self.FRAME] + [0] * (self.FRAME - len(ints[: self.FRAME]))
        op, n, *payload = self._pass_on(frame if self.leader else None, len(frame))
        if n > self.FRAME:
            payload += self._pass_on(ints[self.FRAME :] if self.leader else None, n - self.FRAME)
        return op, payload[:n]

    def send(self, op: int, ints: Sequence[int] = ()) -> None:
        """Rank 0: order every other rank to run `op` (nothing once a rank is gone)."""
        if self.broken:
            return
        with self.watching("an order to the other ranks"):
            self._exchange(op, ints)

    def receive(self) -> Tuple[int, List[int]]:
        """The other ranks: wait (without limit: rank 0 may be waiting for its user) for an order."""
        return self._exchange(STOP, ())

    def send_taps(self, taps: Dict[int, mx.array], layers: Sequence[int], dtype) -> None:
        """Another rank: the outputs of `layers` in the pass just run, to rank 0, in one array."""
        if layers:
            joined = mx.concatenate([taps[layer].astype(dtype) for layer in layers], axis=-1)
            mx.eval(mx.distributed.send(joined, 0, group=self.group, stream=mx.cpu))

    def receive_taps(
        self, remote: Dict[int, List[int]], positions: int, hidden: int, dtype
    ) -> Dict[int, mx.array]:
        """Rank 0: what send_taps sent, {layer: [1, positions, hidden]}."""
        taps = {}
        with self.watching("layer outputs from the other ranks"):
            for rank, layers in sorted(remote.items()):
                joined = mx.distributed.recv(
                    (1, positions, hidden * len(layers)), dtype, rank, group=self.group, stream=mx.cpu
                )
                mx.eval(joined)
                taps.update(
                    {layer: joined[..., i * hidden : (i + 1) * hidden] for i, layer in enumerate(layers)}
                )
        return taps

    def watching(self, what: str):
        return _Watching(self, what)

    def rearm(self, what: str) -> None:
        """A long wait goes on (the next chunk of a prefill): the timeout starts again."""
        if self.watchdog and self.watchdog.deadline is not None:
            self.watchdog.arm(what)


class _Watching:
    """Arms the watchdog for one wait on the other ranks (inside another: for its length, then
    the outer one's again); turns a broken connection into one line."""

    def __init__(self, channel: Channel, what: str):
        self.channel, self.what = channel, what

    def __enter__(self):
        dog = self.channel.watchdog
        if dog:
            self.outer = (dog.deadline, dog.what)
            dog.arm(self.what)

    def __exit__(self, kind, error, traceback):
        dog = self.channel.watchdog
        if dog:
            dog.deadline, dog.what = self.outer
        if isinstance(error, RuntimeError):  # MLX's collectives raise it when a peer is gone
            self.channel.broken = True
            raise RanksLost(
                f"the split target failed ({self.what}): {str(error).splitlines()[0]}; "
                "a rank stopped or cannot be reached"
            ) from None
        return False


REFUSED = {
    "spawn": "a split target (--sharding) runs one generation at a time",
    "sessions": ONE_CONVERSATION,
    "resume": "a prompt cache file holds the whole model's cache, not a rank's shard: "
    "--prompt-cache-file does not run with --sharding",
}


class SplitPasses(Passes):
    """Rank 0's passes over a split target: every operation on the target's cache is ordered on
    the other ranks first (the same Session operations then run there, Follower). Orders carry
    how many tokens rank 0's cache holds, which each follower checks (out of step: it stops,
    and the run ends in one line). drafter_taps: the layers rank 0's drafter reads; those that
    other ranks hold (pipeline stages) are sent by them after each pass."""

    in_pass = False  # an order of a pass was sent, and the pass is not over on this rank

    def __init__(self, target, channel: Channel, drafter_taps: Sequence[int]):
        super().__init__(target)
        self.channel, self.closed = channel, False
        self.remote: Dict[int, List[int]] = {}
        for layer in sorted(drafter_taps):
            rank = channel.holder(layer)
            if rank != 0:
                self.remote.setdefault(rank, []).append(layer)
        size = channel.group.size()
        far = [rank for rank in self.remote if rank not in (1, size - 1)]
        if far:  # MLX's ring backend sends only between neighbours
            raise MlxSpecError(
                f"the drafter reads layers {self.remote[far[0]]}, which pipeline rank {far[0]} of {size} "
                "holds, and a rank sends only to its neighbours: use --sharding tensor, at most 3 "
                "pipeline ranks, or a source that reads the last layers (mtp) or none"
            )
        self.channel.send(RESET)  # the other ranks start this engine's cache as it starts here
        self.channel.send(
            TAPS, [v for rank, layers in self.remote.items() for layer in layers for v in (rank, layer)]
        )

    def refusal(self, what):
        return REFUSED[what]

    def start(self):
        if self.channel.broken:
            raise RanksLost("the split target lost a rank earlier: the run cannot go on")

    def layers(self, drafter_taps):
        return split_prefill_taps(drafter_taps, self.target)

    def fill(self, session, tokens, layers):
        self.channel.send(FILL, [len(session.tokens)] + list(tokens))
        self.in_pass = True
        with self.channel.watching("a prefill pass"):
            taps = self._with_remote(super().fill(session, tokens, layers), len(tokens))
        self.in_pass = False
        return taps

    def chain(self, session, forward, inputs, layers):
        self.channel.send(VERIFY, [len(session.tokens)] + inputs.tolist())  # evaluates lazy drafts
        self.in_pass = True
        return super().chain(session, forward, inputs, layers)

    def verifying(self):
        return self.channel.watching("a verification pass")

    def settled(self, taps, positions):
        taps = self._with_remote(taps, positions)
        self.in_pass = False
        return taps

    def _with_remote(self, taps: Dict[int, mx.array], positions: int) -> Dict[int, mx.array]:
        if not self.remote:
            return taps
        return {
            **taps,
            **self.channel.receive_taps(
                self.remote, positions, self.target.hidden_size, tap_dtype(self.target)
            ),
        }

    def roll_back(self, session, length):
        if length < len(session.tokens):  # else nothing to drop (a step that kept every draft)
            self.channel.send(ROLLBACK, [len(session.tokens), length])
        return super().roll_back(session, length)

    def reset(self):
        # An error or Ctrl-C inside a pass leaves the others in it; a lost rank said so already.
        if self.in_pass and not self.channel.broken:
            self.channel.broken = True
            raise RanksLost(
                "a pass of the split target was interrupted, which leaves the ranks out of step: the run ends"
            )
        self.channel.send(RESET)

    def quantize(self, session, quantization):
        super().quantize(session, quantization)
        self.channel.send(QUANTIZE)

    def close(self):
        """Let the other ranks go (their `follow` returns); once, whoever calls it first (the
        thread running the engine, else the exit of the process)."""
        if not self.closed:
            self.closed = True
            self.channel.send(STOP)


def split_engine(target, drafter, channel: Channel, **settings) -> Engine:
    """Rank 0's engine over a split target (Engine settings): one generation at a time; a tree
    source verifies its chains."""
    if settings.get("sessions"):
        raise MlxSpecError(ONE_CONVERSATION)
    if drafter is not None and drafter.tree:
        drafter = drafter.chains()
        if drafter is None:
            raise MlxSpecError(
                "this draft source drafts trees only, which a split target does not verify: "
                "use its chains (--tree-budget 0) or another source"
            )
    if drafter is not None and drafter.verify_forward is not None:
        raise MlxSpecError(
            "this draft source runs the target's own layers on one process: with --sharding "
            "use lookup, suffix, a draft model, EAGLE-3, DFlash, MTP or Medusa"
        )
    passes = SplitPasses(target, channel, drafter.taps if drafter is not None else ())
    return Engine(target, drafter, passes=passes, **settings)


def split_prefill_taps(drafter_taps: Sequence[int], target) -> List[int]:
    """A prefill evaluates the cache and the taps, and every rank must run the same collectives:
    with the last layer's output, whatever rank 0's drafter taps (under tensor sharding its
    final all_sum; a pipeline stage's last layer is in its cache's graph anyway)."""
    return sorted(set(drafter_taps) | {target.num_layers - 1})


def tap_dtype(target):
    """What layer outputs cross between ranks as: the model's (its final norm's, which every stage keeps)."""
    return target.final_norm.weight.dtype


class Follower:
    """Another rank: runs rank 0's orders on its shard of the target through the same Session
    operations as rank 0's engine (so the same passes and collectives), and sends rank 0 the
    outputs of its layers that rank 0's drafter reads. settings: rank 0's engine settings (its
    KV cache's among them)."""

    def __init__(self, target, channel: Channel, **settings):
        self.target, self.channel = target, channel
        self.kv_quantization = settings.get("kv_quantization")
        self.max_kv_size = settings.get("max_kv_size")
        self.session = self._new_session()
        self.sends: List[int] = []  # the layers whose outputs rank 0's drafter reads from this rank

    def _new_session(self) -> Session:
        return Session(cache=make_cache(self.target.model, self.max_kv_size))

    def _in_step(self, held: int) -> None:
        if held != len(self.session.tokens):
            raise MlxSpecError(
                f"rank {self.channel.group.rank()} is out of step with rank 0: its cache holds "
                f"{len(self.session.tokens)} tokens, rank 0's {held}"
            )

    def _sent(self, tokens: List[int], taps: Dict[int, mx.array]) -> None:
        self.session.add(tokens)
        self.channel.send_taps(taps, self.sends, tap_dtype(self.target))

    def follow(self, plain: Optional[Callable[[List[int]], None]] = None) -> None:
        """Until rank 0 says STOP. plain: what a PLAIN order runs on every rank (the benchmark's
        decoding by mlx-lm alone, its prompt in the order)."""
        while True:
            op, ints = self.channel.receive()
            if op == STOP:
                return
            if op == PLAIN and plain is not None:
                plain(ints)
                continue
            if op in (FILL, VERIFY, ROLLBACK):
                self._in_step(ints[0])
                ints = ints[1:]
            if op == FILL:
                self._sent(
                    ints, self.session.fill(self.target, ints, split_prefill_taps(self.sends, self.target))
                )
            elif op == VERIFY:
                logits, taps = self.session.chain_pass(
                    self.target.forward, mx.array(ints, mx.int32), self.sends
                )
                # Its layers first (a pipeline stage's output goes to the next stage), and the
                # outputs rank 0's drafter reads sent at once: rank 0 receives them after its
                # verdict, and they must not wait for this rank's output layer. Then the rest of
                # the pass (a pipeline's all_gather; the logits, as rank 0 evaluates them).
                mx.eval([c.state for c in self.session.cache], taps)
                self._sent(ints, taps)
                mx.eval(logits)
            elif op == ROLLBACK:
                if not self.session.roll_back(ints[0]):
                    self.session = self._new_session()
            elif op == QUANTIZE:
                self.kv_quantization.apply(self.session.cache)
            elif op == RESET:
                self.session = self._new_session()
            elif op == TAPS:
                rank = self.channel.group.rank()
                self.sends = [layer for r, layer in zip(ints[::2], ints[1::2]) if r == rank]
            else:
                raise MlxSpecError(f"unknown order {op} from rank 0")


class SplitTarget:
    """The target split over the processes mlx.launch started, its ranks connected: rank 0 (the
    leader) runs engines over it, the others follow them."""

    def __init__(self, path, dtype, sharding: str, rank_timeout: Optional[float] = None):
        from .models.target import load_target

        group = init_group(sharding)
        self.target = load_target(
            path, dtype, shard=lambda model, config: shard_model(model, config, sharding, group)
        )
        self.leader = group.rank() == 0
        self.channel = Channel.connect(
            group, self.target, Watchdog(rank_timeout or RANK_TIMEOUT) if self.leader else None
        )

    def engine(self, drafter, **settings) -> Engine:
        """Rank 0's engine; one refused (MlxSpecError) lets the others go first."""
        try:
            return split_engine(self.target, drafter, self.channel, **settings)
        except MlxSpecError:
            try:
                self.close()
            except MlxSpecError:
                pass  # they ended already (they refused the same settings): this rank's reason stands
            raise

    def follow(self, plain: Optional[Callable[[List[int]], None]] = None, **settings) -> None:
        """Another rank: run rank 0's orders (with the engine settings rank 0 has) until it is
        done; rank 0 gone or out of step: the process ends with status 1."""
        try:
            Follower(self.target, self.channel, **settings).follow(plain)
        except RuntimeError:
            sys.exit(1)  # rank 0 is gone: it says why
        except MlxSpecError as e:
            print(f"mlx-spec: rank {self.channel.group.rank()}: {e}", file=sys.stderr)
            sys.exit(1)

    def close(self) -> None:
        """Rank 0: let the others go."""
        self.channel.send(STOP)

    def leaders(self, value: int) -> int:
        """Rank 0's `value` (an int32) on every rank: one collective, before rank 0 orders any
        (a seed each rank drew must be the same)."""
        return self.channel._all_sum([value if self.leader else 0])[0]
