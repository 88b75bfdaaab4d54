"""Cost of one DFlash drafter forward relative to one verification forward of the default model
(float32), and the loop's host overhead per round.

A random 5-layer DFlash drafter at the default model's width and head shape (576 wide, 9 query
/ 3 KV heads of 64, block 16, taps spread over the 30 layers) drafts from --context tokens of
context. Timed, medians over --runs rounds of --reps calls, each call evaluated on its own:
  - the target's forward over 16 tokens (a verification step of 15 drafts);
  - the drafter's forward over the block: its layers alone, then with the target's head on the
    15 draft positions (greedy argmax; sampled: q and a draw);
  - the engine's round (--tokens generated with 15 drafts per step, the drafts nearly never
    accepted), and the part of it spent outside the step's one evaluation: the host loop's
    overhead per round (graph building, verdict, commit, rollback, detokenizing)."""

import argparse
import statistics
import time

import mlx_spec  # noqa: F401  (loads OpenBLAS before mlx.core does any work)

# isort: split

import mlx.core as mx
import numpy as np

from mlx_spec import engine as engine_module
from mlx_spec.cache import make_cache, rollback_to
from mlx_spec.convert.default import default_model_path
from mlx_spec.drafters.dflash import DFlashDrafter
from mlx_spec.engine import Engine
from mlx_spec.events import Step
from mlx_spec.models.dflash import DFlashModel, ModelArgs, spread_layer_ids
from mlx_spec.models.target import load_target
from mlx_spec.sampling import Sampler, SamplingParams

BLOCK = 16


def median_ms(step, reps, runs):
    """step() builds one lazy result, evaluated on its own (one sync per call, as in the engine).
    Medians over runs of the ms per call: (evaluation, building the graph on the host)."""
    for _ in range(3):
        mx.eval(step())
    evals, builds = [], []
    for _ in range(runs):
        build = total = 0.0
        for _ in range(reps):
            tic = time.perf_counter()
            result = step()
            built = time.perf_counter()
            mx.eval(result)
            build += built - tic
            total += time.perf_counter() - tic
        evals.append((total - build) / reps * 1e3)
        builds.append(build / reps * 1e3)
    return statistics.median(evals), statistics.median(builds)


class TimedEval:
    """Stands in for mlx.core in the engine's module: the same, with mx.eval timed."""

    def __init__(self):
        self.seconds = 0.0

    def __getattr__(self, name):
        return getattr(mx, name)

    def eval(self, *args):
        tic = time.perf_counter()
        mx.eval(*args)
        self.seconds += time.perf_counter() - tic


def random_dflash(target, layers=5, seed=0):
    c = target.config
    args = ModelArgs(
        hidden_size=c["hidden_size"],
        num_hidden_layers=layers,
        num_attention_heads=c["num_attention_heads"],
        num_key_value_heads=c["num_key_value_heads"],
        head_dim=c.get("head_dim"),
        intermediate_size=c["intermediate_size"],
        mask_token_id=0,
        rms_norm_eps=c["rms_norm_eps"],
        rope_theta=c.get("rope_theta", 10000.0),
        block_size=BLOCK,
        target_layer_ids=spread_layer_ids(target.num_layers, layers),
    )
    mx.random.seed(seed)
    model = DFlashModel(args)
    mx.eval(model.parameters())
    return model


def main():
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--context", type=int, default=128)
    parser.add_argument("--tokens", type=int, default=64, help="tokens generated per engine run")
    parser.add_argument("--reps", type=int, default=10)
    parser.add_argument("--runs", type=int, default=5)
    opts = parser.parse_args()

    target = load_target(default_model_path(), "float32")
    model = random_dflash(target)
    context = (np.arange(opts.context + 1) * 7919 % 1000 + 100).tolist()
    cache = make_cache(target.model)
    _, taps = target.forward(mx.array(context[:-1])[None], cache, model.args.target_layer_ids)
    mx.eval([c.state for c in cache], taps)
    block = mx.array([context[-1:] + [model.args.mask_token_id] * (BLOCK - 1)])

    def verify():
        logits = target.model(block, cache=cache)
        rollback_to(cache, opts.context)  # lazy: the step reads what it wrote before the trim
        return logits

    def propose(drafter):
        draft = drafter.propose(BLOCK - 1)
        return draft.tokens, draft.q

    verify_ms, verify_build = median_ms(verify, opts.reps, opts.runs)
    print(
        f"target forward over {BLOCK} tokens (float32, {opts.context} tokens of context): "
        f"{verify_ms:.2f} ms (+ {verify_build:.2f} ms building the graph)"
    )
    draft_ms = {}
    for mode, params in (("greedy", SamplingParams()), ("sampled", SamplingParams(temp=0.7))):
        drafter = DFlashDrafter(target, model)
        drafter.sampler = Sampler(params)
        drafter.prefill(context, taps, 0)
        mx.eval(drafter.block_logits(1))  # the context K/V is computed at the first proposal
        if mode == "greedy":
            layers_ms, _ = median_ms(lambda: model(target.embed(block), drafter.cache), opts.reps, opts.runs)
            print(
                f"drafter forward, {model.args.num_hidden_layers} layers only: {layers_ms:.2f} ms = "
                f"{layers_ms / verify_ms:.3f} x"
            )
        draft_ms[mode], build = median_ms(lambda: propose(drafter), opts.reps, opts.runs)
        print(
            f"drafter propose (layers + head on 15 rows), {mode}: {draft_ms[mode]:.2f} ms = "
            f"{draft_ms[mode] / verify_ms:.3f} x (+ {build:.2f} ms building the graph)"
        )

    # The engine's round, greedy: propose, verify, one sync, commit. With random weights almost
    # every round verifies 15 drafts and commits one token. Timed between consecutive "step"
    # events (prefill and the first step left out); the engine's evaluations are timed through
    # its module's `mx`, so what remains is host work.
    rounds, host = [], []
    for _ in range(opts.runs):
        engine = Engine(target, DFlashDrafter(target, model), num_draft_tokens=BLOCK - 1, adaptive=False)
        timed = TimedEval()
        engine_module.mx = timed
        marks = [
            (time.perf_counter(), timed.seconds)
            for event in engine.generate(context, max_tokens=opts.tokens)
            if isinstance(event, Step)
        ]
        engine_module.mx = mx
        (t0, e0), (t1, e1) = marks[0], marks[-1]
        rounds.append((t1 - t0) / (len(marks) - 1) * 1e3)
        host.append(((t1 - t0) - (e1 - e0)) / (len(marks) - 1) * 1e3)
    round_ms, host_ms = statistics.median(rounds), statistics.median(host)
    print(
        f"engine round (greedy, {opts.tokens} tokens, median of {opts.runs} runs): {round_ms:.2f} ms; "
        f"host overhead (outside the step's one evaluation) = {host_ms:.2f} ms ({host_ms / round_ms:.0%}); "
        f"round - both forwards timed alone = {round_ms - verify_ms - draft_ms['greedy']:.2f} ms"
    )


if __name__ == "__main__":
    main()
