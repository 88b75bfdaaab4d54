"""Seconds of one verification pass of the default model by width (1 = a plain step, w = 1 +
w - 1 drafts) at several context lengths: the curve the policy's verification cost fits with a
line (cost.LinearCost).

On this 2-core CPU the first draft adds more than each later one: at 450 tokens of context,
two runs gave 49 ms for width 1, then 58-62 (width 2), 67-69, 75-78, 81-84 (width 6), 97-100
(width 9). A line through all of them underrates the first draft; measuring the plain step on
its own was tried and made the policy draft less where drafting pays (see the README).

    python benchmarks/verify_widths.py [--contexts 100 450 1500] [--runs 7]"""

import argparse
import statistics
import time

import mlx_spec  # noqa: F401  (loads OpenBLAS before mlx.core does any work)

import mlx.core as mx

from mlx_spec.cache import make_cache, rollback_to
from mlx_spec.models.default import default_model_path
from mlx_spec.models.target import load_target

WIDTHS = (1, 2, 3, 4, 6, 9)


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--contexts", type=int, nargs="+", default=[100, 450, 1500])
    parser.add_argument("--runs", type=int, default=7, help="rounds over every width; the first is warm-up")
    args = parser.parse_args()
    target = load_target(default_model_path(), "auto")
    for context in args.contexts:
        cache = make_cache(target.model)
        target.forward(mx.random.randint(0, 1000, (1, context)), cache, ())
        mx.eval([c.state for c in cache])
        seconds = {w: [] for w in WIDTHS}
        for run in range(args.runs):
            for w in WIDTHS:   # widths in alternation, so that load on the machine hits all alike
                tokens = mx.random.randint(0, 1000, (1, w))
                mx.eval(tokens)
                tic = time.perf_counter()
                logits, _ = target.forward(tokens, cache, ())
                mx.eval(logits)
                if run:
                    seconds[w].append(time.perf_counter() - tic)
                rollback_to(cache, context, None)
        print(f"context {context}: " + ", ".join(
            f"width {w} {1000 * statistics.median(s):.1f} ms" for w, s in seconds.items()))


if __name__ == "__main__":
    main()
