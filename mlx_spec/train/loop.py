"""What every trainer shares: the run (`train`: checks, the data, dev evaluation, resume, the
target's features computed once per sequence and cached on disk, the loop, the save) with a
Trainer's hooks for what one kind of drafter does its own way; a deterministic batch order,
AdamW with warmup + cosine decay, checkpoints that a later run resumes from, the progress line.

Determinism: the model's initial weights come from the seed; the rows of step s and any random
choice made for it (DFlash's anchors) are functions of (seed, s) only, so a run resumed from
a checkpoint takes exactly the steps an uninterrupted run would have taken."""

import functools
import hashlib
import json
import shutil
import sys
import time
from dataclasses import asdict, dataclass, field, fields
from pathlib import Path
from typing import Callable, Dict, List, Optional, Sequence

import mlx.core as mx
import mlx.nn as nn
import mlx.optimizers as optim
import numpy as np
from mlx.utils import tree_flatten, tree_unflatten

from ..config import setting
from ..engine import Engine
from ..errors import MlxSpecError
from ..events import Collector
from ..models.checkpoint import FLOAT_DTYPES
from ..sampling import SamplingParams
from .data import read_split

CHECKPOINT = "checkpoint"  # <out>/checkpoint: training state (weights, optimizer, step)
SAVE_DTYPES = tuple(FLOAT_DTYPES)


@dataclass
class TrainSequence:
    """One training sequence: prompt + response tokens (truncated), the prompt's length."""

    index: int  # row index in the data: names its cached features
    tokens: List[int]
    prompt_length: int


@dataclass
class TrainResult:
    step: int  # steps done (the last checkpoint's, after a resume)
    losses: List[float] = field(default_factory=list)  # one per step run in this call
    path: Optional[Path] = None  # the published checkpoint, once written


def load_sequences(data_dir, max_length: int = 1024, split: str = "train") -> List[TrainSequence]:
    """Rows of `mlx-spec train data` as sequences; one-line errors for missing or empty data.
    A row longer than max_length keeps at most half of it as response and drops the start of
    its prompt (the response's near context stays)."""
    data_dir = Path(data_dir)
    if not data_dir.is_dir():
        raise MlxSpecError(f"training data not found: {data_dir} is not a directory")
    if max_length < 4:
        raise MlxSpecError(f"--max-length must be at least 4, got {max_length}")
    try:
        rows = read_split(data_dir, split)
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise MlxSpecError(f"corrupt {data_dir / (split + '.jsonl')}: {e}") from None
    if not rows:
        raise MlxSpecError(
            f"no training data in {data_dir} ({split}.jsonl missing or empty): "
            "build it with `mlx-spec train data`"
        )
    out = []
    for i, row in enumerate(rows):
        try:
            prompt, response = list(row["prompt_tokens"]), list(row["response_tokens"])
        except (KeyError, TypeError):
            raise MlxSpecError(
                f"{data_dir / (split + '.jsonl')} row {i + 1} lacks prompt_tokens/response_tokens"
            ) from None
        if not response or not prompt:
            continue
        if len(prompt) + len(response) > max_length:
            response = response[: max(1, max_length // 2, max_length - len(prompt))]
            prompt = prompt[-(max_length - len(response)) :]
        out.append(TrainSequence(i, [int(t) for t in prompt + response], len(prompt)))
    if not out:
        raise MlxSpecError(
            f"no usable training rows in {data_dir}: every row has an empty prompt or response"
        )
    return out


def layer_config(target) -> dict:
    """The target's layer shape, as a drafter layer copies it; one-line errors when missing."""
    cfg = target.config.get("text_config", target.config)
    missing = [k for k in ("num_attention_heads", "intermediate_size") if not cfg.get(k)]
    if missing:
        raise MlxSpecError(
            f"the target's config.json lacks {', '.join(missing)}: cannot shape a drafter "
            "layer like the target's"
        )
    heads = int(cfg["num_attention_heads"])
    return {
        "num_attention_heads": heads,
        "num_key_value_heads": int(cfg.get("num_key_value_heads") or heads),
        "head_dim": int(cfg.get("head_dim") or target.hidden_size // heads),
        "intermediate_size": int(cfg["intermediate_size"]),
        "rms_norm_eps": float(cfg.get("rms_norm_eps", 1e-6)),
        "rope_theta": float(cfg.get("rope_theta", 10000.0)),
        "rope_scaling": cfg.get("rope_scaling"),
        "max_position_embeddings": int(cfg.get("max_position_embeddings") or 4096),
    }


@functools.lru_cache(maxsize=4)
def _epoch_order(n: int, seed: int, epoch: int) -> np.ndarray:
    return np.random.default_rng([seed, epoch]).permutation(n)


def batch_indices(n: int, batch_size: int, step: int, seed: int) -> List[int]:
    """The sequences of step `step`: epochs of seeded permutations, read in order."""
    return [
        int(_epoch_order(n, seed, k // n)[k % n]) for k in range(step * batch_size, (step + 1) * batch_size)
    ]


def step_rng(seed: int, step: int) -> np.random.Generator:
    """Random choices of one step (anchors), independent of how the run got there."""
    return np.random.default_rng([seed, 1_000_003, step])


class FeatureStore:
    """The target's tapped hidden states of each sequence, concatenated in `taps` order,
    computed once (no gradient) and kept in memory or, with `directory`, on disk (where a later
    or resumed run finds them). Files are named by their tokens, so that grown or reordered data
    (more answers, greedy and sampled merged) reuses every sequence already computed."""

    def __init__(self, target, taps: Sequence[int], directory=None):
        self.target, self.taps = target, list(taps)
        self.memory: Dict[int, mx.array] = {}
        self.directory = None
        if directory is not None:  # one folder per set of taps: EAGLE and DFlash runs may share
            self.directory = Path(directory) / ("taps_" + "_".join(str(i) for i in self.taps))
            self.directory.mkdir(parents=True, exist_ok=True)
            meta = {
                "target": str(getattr(target, "path", None)),
                "taps": self.taps,
                "hidden_size": target.hidden_size,
                "num_layers": target.num_layers,
            }
            meta_path = self.directory / "features.json"
            if meta_path.exists() and json.loads(meta_path.read_text()) != meta:
                for f in self.directory.glob("*.safetensors"):  # another target or other taps
                    f.unlink()
            meta_path.write_text(json.dumps(meta))

    def _path(self, seq: TrainSequence) -> Path:
        digest = hashlib.sha256(np.asarray(seq.tokens, np.int32).tobytes()).hexdigest()[:24]
        return self.directory / f"{digest}.safetensors"

    def has(self, seq: TrainSequence) -> bool:
        return seq.index in self.memory or (self.directory is not None and self._path(seq).exists())

    def compute(self, seqs: Sequence[TrainSequence]) -> List[mx.array]:
        """Features of several sequences in one forward: right padding leaves the real
        positions of a causal model untouched. Layers past the last tap and the head are never
        evaluated (lazy graph)."""
        from mlx_lm.models.cache import make_prompt_cache

        length = max(len(s.tokens) for s in seqs)
        tokens = mx.array([s.tokens + [0] * (length - len(s.tokens)) for s in seqs])
        _, taps = self.target.forward(tokens, make_prompt_cache(self.target.model), self.taps)
        features = mx.concatenate([taps[i] for i in self.taps], axis=-1).astype(mx.float32)
        mx.eval(features)
        return [features[i, : len(s.tokens)] for i, s in enumerate(seqs)]

    def get(self, seq: TrainSequence) -> mx.array:
        """[len(tokens), len(taps) * H] float32."""
        if seq.index in self.memory:
            return self.memory[seq.index]
        if self.directory is not None and self._path(seq).exists():
            stored = mx.load(str(self._path(seq)))
            if stored["tokens"].tolist() == seq.tokens:
                return stored["features"]
        return self._keep(seq, self.compute([seq])[0])

    def _keep(self, seq: TrainSequence, features: mx.array) -> mx.array:
        if self.directory is not None:
            mx.save_safetensors(
                str(self._path(seq)), {"features": features, "tokens": mx.array(seq.tokens, mx.int32)}
            )
        else:
            self.memory[seq.index] = features
        return features

    def prepare(
        self,
        sequences: Sequence[TrainSequence],
        progress: Optional[Callable[[int], None]] = None,
        batch_size: int = 8,
    ):
        """Compute (and store) every missing feature up front, in batches of similar lengths
        (1.5x the one-sequence rate on 2 CPU cores)."""
        missing = sorted((s for s in sequences if not self.has(s)), key=lambda s: len(s.tokens))
        if progress:
            progress(len(sequences) - len(missing))
        for start in range(0, len(missing), batch_size):
            group = missing[start : start + batch_size]
            for seq, features in zip(group, self.compute(group)):
                self._keep(seq, features)
            if progress:
                progress(len(group))


def used_indices(n: int, batch_size: int, start: int, steps: int, seed: int) -> List[int]:
    seen = []
    for step in range(start, steps):
        for i in batch_indices(n, batch_size, step, seed):
            if i not in seen:
                seen.append(i)
        if len(seen) == n:
            break
    return seen


def make_optimizer(lr: float, steps: int, warmup: int, weight_decay: float) -> optim.Optimizer:
    """AdamW; linear warmup, then cosine decay to a tenth of lr."""
    decay = optim.cosine_decay(lr, max(1, steps - warmup), lr * 0.1)
    schedule = (
        decay
        if warmup <= 0
        else optim.join_schedules([optim.linear_schedule(lr * 1e-2, lr, warmup), decay], [warmup])
    )
    return optim.AdamW(learning_rate=schedule, weight_decay=weight_decay)


# --- checkpoints ------------------------------------------------------------------------------


def save_checkpoint(out_dir, model: nn.Module, optimizer: optim.Optimizer, step: int, state: dict) -> Path:
    """<out>/checkpoint: weights, optimizer state and step, replaced atomically."""
    out_dir = Path(out_dir)
    final, tmp = out_dir / CHECKPOINT, out_dir / (CHECKPOINT + ".tmp")
    if tmp.exists():
        shutil.rmtree(tmp)
    tmp.mkdir(parents=True)
    mx.save_safetensors(str(tmp / "weights.safetensors"), dict(tree_flatten(model.parameters())))
    mx.save_safetensors(str(tmp / "optimizer.safetensors"), dict(tree_flatten(optimizer.state)))
    (tmp / "state.json").write_text(json.dumps(dict(state, step=step), indent=1))
    if final.exists():
        old = out_dir / (CHECKPOINT + ".old")
        final.rename(old)
        tmp.rename(final)
        shutil.rmtree(old)
    else:
        tmp.rename(final)
    return final


def read_checkpoint_state(out_dir) -> Optional[dict]:
    final, old = Path(out_dir) / CHECKPOINT, Path(out_dir) / (CHECKPOINT + ".old")
    if not final.exists() and old.exists():  # interrupted between the two renames of a save
        old.rename(final)
    path = final / "state.json"
    if not path.exists():
        return None
    try:
        return json.loads(path.read_text())
    except (OSError, json.JSONDecodeError) as e:
        raise MlxSpecError(f"corrupt checkpoint {path}: {e}") from None


def resume_step(out_dir, resume: bool) -> int:
    """The step a run starts from; an existing checkpoint without --resume is an error (it
    would be overwritten)."""
    saved = read_checkpoint_state(out_dir)
    if saved is not None and not resume:
        raise MlxSpecError(
            f"{out_dir} already holds a training checkpoint: pass --resume to continue "
            "it, or choose another --out"
        )
    return int(saved["step"]) if saved else 0


def check_resumable(saved: dict, kind: str, architecture: dict, out_dir) -> None:
    if saved.get("kind") != kind:
        raise MlxSpecError(f"{out_dir}/{CHECKPOINT} is a {saved.get('kind')} checkpoint, not {kind}")
    old = saved.get("architecture", {})
    diff = sorted(k for k in set(old) | set(architecture) if old.get(k) != architecture.get(k))
    if diff:
        k = diff[0]
        raise MlxSpecError(
            f"cannot resume {out_dir}/{CHECKPOINT}: it was trained with {k}="
            f"{old.get(k)}, this run asks for {architecture.get(k)}"
        )


def load_checkpoint(out_dir, model: nn.Module, optimizer: optim.Optimizer) -> None:
    path = Path(out_dir) / CHECKPOINT
    try:
        model.load_weights(str(path / "weights.safetensors"), strict=True)
        optimizer.init(model.trainable_parameters())
        state = mx.load(str(path / "optimizer.safetensors"))
        optimizer.state = tree_unflatten(list(state.items()))
    except Exception as e:
        msg = str(e).splitlines()[0] if str(e) else type(e).__name__
        raise MlxSpecError(f"cannot resume from {path}: {msg}") from None
    mx.eval(model.parameters(), optimizer.state)


def cast_for_saving(weights: Dict[str, mx.array], dtype: str) -> Dict[str, mx.array]:
    if dtype not in SAVE_DTYPES:
        raise MlxSpecError(f"unknown save dtype {dtype!r}: choose one of {', '.join(SAVE_DTYPES)}")
    target = getattr(mx, dtype)
    return {k: v.astype(target) if mx.issubdtype(v.dtype, mx.floating) else v for k, v in weights.items()}


def write_checkpoint(path: Path, config: dict, weights: Dict[str, mx.array]) -> Path:
    """A published checkpoint in path: config.json and model.safetensors (with the metadata
    PyTorch's writers give it, as the published checkpoints have)."""
    path.mkdir(parents=True, exist_ok=True)
    (path / "config.json").write_text(json.dumps(config, indent=2))
    mx.save_safetensors(str(path / "model.safetensors"), weights, metadata={"format": "pt"})
    return path


# --- the loop -----------------------------------------------------------------------------------


@dataclass
class LoopOptions:
    """What every trainer shares; each trainer's options class adds its own fields and may give
    these other defaults (without help: the help is read here). The defaults are the only
    ones: `mlx-spec train KIND` shows and uses them (cli/train.py builds its options from these
    fields)."""

    steps: int = setting(
        2000, "Optimizer steps in all (a resumed run continues up to it).", type=("IntRange", 1)
    )
    batch_size: int = setting(4, "Sequences per step.", type=("IntRange", 1))
    lr: float = setting(3e-4, "Peak AdamW learning rate.", type=("FloatRange", 0, None, True))
    warmup: int = setting(50, "Linear warmup steps, then cosine decay to lr/10.", type=("IntRange", 0))
    weight_decay: float = setting(0.0, "AdamW weight decay.", type=("FloatRange", 0))
    grad_clip: float = setting(
        1.0, "Clip the gradients' global norm to this (0: no clipping).", type=("FloatRange", 0)
    )
    max_length: int = setting(1024, "Longest sequence (prompt + response) in tokens.", type=("IntRange", 4))
    save_every: int = setting(200, "Checkpoint every N steps (0: only at the end).", type=("IntRange", 0))
    seed: int = setting(0, "Initial weights, batch order and random choices (anchors, rows).", type=("INT",))
    save_dtype: str = setting(
        "float32", "dtype of the published weights.", type=("Choice", list(FLOAT_DTYPES))
    )
    max_minutes: float = setting(
        0.0,
        "Stop after this many minutes of training, checkpointed (0: no limit); --resume continues.",
        type=("FloatRange", 0),
    )
    init: Optional[str] = setting(
        None,
        "Start from this published drafter's weights (a directory or a repo id, e.g. a shipped one); "
        "its shape and taps win over the shape options.",
    )
    eval_every: int = setting(
        0,
        "Every N steps (and before the first, and at the end) log the drafter's tau at 4 drafts on the "
        "data's held-out prompts to OUT/train_log.jsonl (0: never).",
        type=("IntRange", 0),
    )
    eval_prompts: int = setting(8, "Held-out prompts per evaluation, 32 tokens each.", type=("IntRange", 1))
    eval_data: Optional[str] = setting(
        None,
        "Take the held-out prompts from this `train data` directory instead of --data (runs on "
        "different data, evaluated on the same prompts).",
    )

    @classmethod
    def given(cls, **options):
        """The options given (None: not given, the default stands), as mlx-lm's
        BaseModelArgs.from_dict keeps only what it knows."""
        names = {f.name for f in fields(cls)}
        return cls(**{k: v for k, v in options.items() if v is not None and k in names})


class DevEvaluation:
    """The drafter's tau (tokens per verification step) at a fixed 4 drafts, every draft
    verified, on the first `prompts` distinct prompts of the data's held-out split (by id): what
    the learning curves plot (greedy). Each prompt generates `max_tokens` tokens through the
    engine with a drafter built from the model as it is (make_drafter(model)); with sampling
    (temp > 0), once per seed of `seeds`."""

    def __init__(
        self,
        target,
        data_dir,
        make_drafter: Callable,
        prompts: int = 8,
        max_tokens: int = 32,
        draft_tokens: int = 4,
        sampling: SamplingParams = SamplingParams(),
        seeds: Sequence[int] = (0,),
    ):
        # One row per prompt: data merged from several runs (greedy and sampled) repeats them.
        rows = sorted({r["id"]: r for r in read_split(data_dir, "heldout")}.values(), key=lambda r: r["id"])[
            :prompts
        ]
        if not rows:
            raise MlxSpecError(
                f"--eval-every needs held-out prompts: {data_dir}/heldout.jsonl is empty or missing"
            )
        self.target, self.make_drafter = target, make_drafter
        self.prompts = [r["prompt_tokens"] for r in rows]
        self.max_tokens, self.draft_tokens = max_tokens, draft_tokens
        self.sampling, self.seeds = sampling, list(seeds) if not sampling.greedy else [0]

    def __call__(self, model: nn.Module) -> dict:
        committed = steps = 0
        engine = Engine(
            self.target,
            self.make_drafter(model),
            num_draft_tokens=self.draft_tokens,
            adaptive=False,
            sampling=self.sampling,
        )
        for prompt in self.prompts:
            for seed in self.seeds:
                stats = Collector.of(engine.generate(prompt, max_tokens=self.max_tokens, seed=seed)).stats
                committed, steps = committed + stats.committed_tokens, steps + stats.steps
        return {"dev_tau": committed / steps if steps else 0.0, "dev_prompts": len(self.prompts)}


class Trainer:
    """One kind of drafter's part in a training run (train/eagle.py, dflash.py, mtp.py,
    medusa.py); `train` does the rest. Hooks not overridden do nothing."""

    kind: str = ""  # the name in checkpoints (a resume checks it) and in `mlx-spec train KIND`
    options_class = LoopOptions  # its options: `mlx-spec train KIND`'s are made from its fields

    def __init__(self, target, options: LoopOptions):
        self.target, self.options = target, options

    def check(self) -> None:
        """Raise MlxSpecError where the options cannot train."""

    def new_model(self, sequences: List[TrainSequence]) -> nn.Module:
        """A fresh model (float32) for the target."""
        raise NotImplementedError

    def load(self, path) -> nn.Module:
        """The published drafter at --init, to continue."""
        raise NotImplementedError

    def prepare(self, model: nn.Module) -> None:
        """The model is set (built, continued or about to be resumed): derive what the batches
        need from it."""

    def drafter(self, model: nn.Module):
        """A drafter on the model as it is: what the dev evaluation decodes with."""
        raise NotImplementedError

    def taps(self, model: nn.Module) -> Sequence[int]:
        """The target layers whose features the batches read (cached once per sequence)."""
        return model.taps

    def batch(self, model: nn.Module, store: "FeatureStore", sequences: List[TrainSequence], step: int):
        """(the loss's inputs after the model, positions trained, for the rate)."""
        raise NotImplementedError

    def loss(self, model: nn.Module, *batch):
        """(loss, metrics: a dict of scalars)."""
        raise NotImplementedError

    def architecture(self, model: nn.Module) -> dict:
        """What a checkpoint must match to be resumed."""
        raise NotImplementedError

    def save(self, model: nn.Module, out_dir: Path) -> Path:
        """Write the published checkpoint into out_dir; its path."""
        raise NotImplementedError


def train(
    trainer: Trainer,
    data_dir,
    out_dir,
    resume: bool = False,
    feature_dir="default",
    progress: Optional[Callable[[dict], None]] = None,
    feature_progress: Optional[Callable[[int], None]] = None,
) -> TrainResult:
    """Train the trainer's drafter for its target on `mlx-spec train data` output; write it to
    out_dir with training checkpoints in out_dir/checkpoint. feature_dir: where the target's
    features are cached ("default": out_dir/features; None: in memory). progress(record) runs
    after each step; feature_progress(n) while features are computed."""
    o, target = trainer.options, trainer.target
    if o.steps < 1 or o.batch_size < 1:
        raise MlxSpecError("--steps and --batch-size must be >= 1")
    trainer.check()
    out_dir = Path(out_dir)
    sequences = load_sequences(data_dir, o.max_length)
    evaluate = (
        DevEvaluation(target, o.eval_data or data_dir, trainer.drafter, o.eval_prompts)
        if o.eval_every
        else None
    )
    out_dir.mkdir(parents=True, exist_ok=True)
    mx.random.seed(o.seed)
    start = resume_step(out_dir, resume)
    if o.init and not start:  # continue a published drafter (its own shape, taps, vocabulary)
        model = trainer.load(o.init)
        model.set_dtype(mx.float32)
    else:
        model = trainer.new_model(sequences)
    trainer.prepare(model)
    store = FeatureStore(
        target, trainer.taps(model), out_dir / "features" if feature_dir == "default" else feature_dir
    )
    store.prepare(
        [sequences[i] for i in used_indices(len(sequences), o.batch_size, start, o.steps, o.seed)],
        feature_progress,
    )

    def make_batch(step):
        batch = [sequences[i] for i in batch_indices(len(sequences), o.batch_size, step, o.seed)]
        return trainer.batch(model, store, batch, step)

    result = run_loop(
        trainer.kind,
        model,
        trainer.loss,
        make_batch,
        o,
        out_dir,
        trainer.architecture(model),
        {trainer.kind: asdict(o)},
        resume,
        progress,
        evaluate,
    )
    result.path = trainer.save(model, out_dir)
    return result


def run_loop(
    kind: str,
    model: nn.Module,
    loss_fn: Callable,
    make_batch: Callable[[int], tuple],
    options: LoopOptions,
    out_dir,
    architecture: dict,
    extra_state: dict,
    resume: bool,
    progress: Optional[Callable[[dict], None]] = None,
    evaluate: Optional[DevEvaluation] = None,
) -> TrainResult:
    """Train `model` for options.steps steps (from the checkpoint's step with `resume`).

    loss_fn(model, *batch) -> (loss, metrics dict of scalars); make_batch(step) -> (batch tuple,
    positions trained, for the rate). Checkpoints every save_every steps and at the end. With
    `evaluate` and options.eval_every, a dev record {"step", "dev_tau", ...} is logged before
    the first step, every eval_every steps and at the end."""
    out_dir = Path(out_dir)
    optimizer = make_optimizer(options.lr, options.steps, options.warmup, options.weight_decay)
    start = resume_step(out_dir, resume)
    saved = read_checkpoint_state(out_dir)
    if saved is not None:
        check_resumable(saved, kind, architecture, out_dir)
        load_checkpoint(out_dir, model, optimizer)
    state = dict(extra_state, kind=kind, architecture=architecture, options=asdict(options))
    value_and_grad = nn.value_and_grad(model, loss_fn)
    result = TrainResult(step=start)
    log = open(out_dir / "train_log.jsonl", "a")
    deadline = time.monotonic() + 60 * options.max_minutes if options.max_minutes > 0 else None
    evaluated = None

    def dev_record(step):
        nonlocal evaluated
        if evaluate is not None and options.eval_every and evaluated != step:
            evaluated = step
            log.write(json.dumps({"step": step, **evaluate(model)}) + "\n")
            log.flush()

    try:
        dev_record(start)
        for step in range(start, options.steps):
            if deadline is not None and time.monotonic() > deadline:
                break  # the time budget is spent: checkpoint below, a later --resume continues
            tic = time.perf_counter()
            batch, positions = make_batch(step)
            (loss, metrics), grads = value_and_grad(model, *batch)
            if options.grad_clip > 0:
                grads, _ = optim.clip_grad_norm(grads, options.grad_clip)
            optimizer.update(model, grads)
            mx.eval(loss, metrics, model.parameters(), optimizer.state)
            seconds = time.perf_counter() - tic
            record = {
                "step": step + 1,
                "loss": loss.item(),
                "positions_per_s": positions / seconds,
                **{k: v.item() for k, v in metrics.items()},
            }
            if not np.isfinite(record["loss"]):
                raise MlxSpecError(
                    f"training diverged at step {step + 1} (loss {record['loss']}): lower --lr"
                )
            result.losses.append(record["loss"])
            result.step = step + 1
            log.write(json.dumps(record) + "\n")
            log.flush()
            if progress:
                progress(record)
            if options.save_every and (step + 1) % options.save_every == 0 and step + 1 < options.steps:
                save_checkpoint(out_dir, model, optimizer, step + 1, state)
            if options.eval_every and (step + 1) % options.eval_every == 0:
                dev_record(step + 1)
        dev_record(result.step)
        if result.step > start or saved is None:
            save_checkpoint(out_dir, model, optimizer, result.step, state)
    finally:
        log.close()
    return result


def progress_bar(steps: int, start: int, label: str):
    """click's progress bar on stderr; returns (bar, callback for run_loop)."""
    import click

    def show(record):
        if not record:
            return None
        extra = f" acc {record['accuracy']:.2f}" if "accuracy" in record else ""
        if "accepted" in record:
            extra += f" accepted/block {record['accepted']:.2f}"
        return f"loss {record['loss']:.3f}{extra} {record['positions_per_s']:.0f} tok/s"

    bar = click.progressbar(length=steps, label=label, item_show_func=show, file=sys.stderr)
    if start:
        bar.update(start)
    return bar, lambda record: bar.update(1, record)
