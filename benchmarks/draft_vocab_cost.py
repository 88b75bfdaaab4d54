"""Cost of one proposal of the default model's shipped MTP, Medusa and DFlash drafters over the
target's whole vocabulary (49152 rows of its output layer per draft) and over a reduced draft
vocabulary (models/vocabulary.py: the --size ids most frequent in the training answers), relative
to the verification forward those drafts need (the target over k + 1 tokens).

Timed, medians over --runs rounds of --reps calls, each call evaluated on its own (one sync, as
in the engine): propose(k) at temperature 0 and at 0.7 (the residual rule builds q over the
target's vocabulary). Also printed: the share of the held-out answers' tokens the reduced
vocabulary covers (a token outside it can never be drafted)."""

import argparse
import statistics
import time

import mlx_spec  # noqa: F401  (loads OpenBLAS before mlx.core does any work)

# isort: split

import mlx.core as mx
import numpy as np

from mlx_spec.cache import make_cache, rollback_to
from mlx_spec.convert.default import default_model_path
from mlx_spec.drafters.dflash import DFlashDrafter
from mlx_spec.drafters.eagle import EagleDrafter
from mlx_spec.drafters.medusa import MedusaDrafter
from mlx_spec.models import vocabulary
from mlx_spec.models.default import shipped_drafter
from mlx_spec.models.dflash import load_dflash
from mlx_spec.models.medusa import load_medusa
from mlx_spec.models.mtp import load_mtp
from mlx_spec.models.target import load_target
from mlx_spec.sampling import Sampler, SamplingParams
from mlx_spec.train.data import read_split


def median_ms(step, reps, runs):
    for _ in range(3):
        mx.eval(step())
    times = []
    for _ in range(runs):
        tic = time.perf_counter()
        for _ in range(reps):
            mx.eval(step())
        times.append((time.perf_counter() - tic) / reps * 1e3)
    return statistics.median(times)


def drafters(target):
    """(name, load(), make drafter(model), draft length) of each shipped drafter."""
    path = target.path
    return [
        (
            "mtp",
            lambda: load_mtp(shipped_drafter("mtp", path), target),
            lambda m: EagleDrafter(m, target.vocab_size),
            3,
        ),
        (
            "medusa",
            lambda: load_medusa(shipped_drafter("medusa", path), target),
            lambda m: MedusaDrafter(target, m),
            4,
        ),
        (
            "dflash",
            lambda: load_dflash(shipped_drafter("dflash", path), target),
            lambda m: DFlashDrafter(target, m),
            4,
        ),
    ]


def main():
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--data", default="work/drafters/data", help="`train data` directory")
    parser.add_argument("--size", type=int, default=8192)
    parser.add_argument("--context", type=int, default=300)
    parser.add_argument("--reps", type=int, default=10)
    parser.add_argument("--runs", type=int, default=5)
    opts = parser.parse_args()

    target = load_target(default_model_path(), "float32")
    ids = vocabulary.frequent_ids(
        (r["response_tokens"] for r in read_split(opts.data, "train")), target.vocab_size, opts.size
    )
    heldout = [t for r in read_split(opts.data, "heldout") for t in r["response_tokens"]]
    if heldout:
        print(
            f"{len(ids)}-token draft vocabulary from {opts.data}/train.jsonl covers "
            f"{np.isin(heldout, ids).mean():.2%} of the {len(heldout)} held-out answer tokens"
        )
    context = (np.arange(opts.context + 1) * 7919 % 1000 + 100).tolist()
    taps_wanted = sorted({target.num_layers - 1} | set(range(target.num_layers)))
    cache = make_cache(target.model)
    _, taps = target.forward(mx.array(context[:-1])[None], cache, taps_wanted)
    mx.eval([c.state for c in cache], taps)

    print(
        f"| drafter | k | verify k+1 (ms) | mode | whole vocabulary (ms, x verify) | {len(ids)} tokens (ms, x verify) |"
    )
    print("|---|---|---|---|---|---|")
    for name, load, make, k in drafters(target):
        block = mx.array([context[-k - 1 :]])

        def verify():
            logits = target.model(block, cache=cache)
            rollback_to(cache, opts.context)
            return logits

        verify_ms = median_ms(verify, opts.reps, opts.runs)
        for mode, params in (("greedy", SamplingParams()), ("temp 0.7", SamplingParams(temp=0.7))):
            cells = []
            for reduced in (False, True):
                model = load()
                if reduced:
                    model.use_vocabulary(ids, target) if name == "dflash" else model.use_vocabulary(ids)
                drafter = make(model)
                drafter.sampler = Sampler(params)
                drafter.prefill(context, {i: taps[i] for i in drafter.taps}, 0)

                def propose():
                    draft = drafter.propose(k)
                    if isinstance(drafter, EagleDrafter):  # drop the draft steps' cache entries (lazily)
                        rollback_to(drafter.cache, len(drafter.paired))
                    return [a for a in (draft.tokens, draft.q) if a is not None]

                ms = median_ms(propose, opts.reps, opts.runs)
                cells.append(f"{ms:.2f} ({ms / verify_ms:.2f}x)")
            print(f"| {name} | {k} | {verify_ms:.2f} | {mode} | {cells[0]} | {cells[1]} |", flush=True)


if __name__ == "__main__":
    main()
