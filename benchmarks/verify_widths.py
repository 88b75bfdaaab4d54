"""Seconds of one verification pass of the default model by width (1 = a plain step, w = 1 +
w - 1 drafts) at several context lengths: the curve the policy's verification cost follows
(cost.LinearCost).

On this 2-core CPU the first draft adds more than each later one: at 450 tokens of context,
two runs gave 49 ms for width 1, then 58-62 (width 2), 67-69, 75-78, 81-84 (width 6), 97-100
(width 9). A line through all of them underrates the first draft, so the policy's
verification cost measures the plain step on its own and fits the line to the wider ones
(cost.LinearCost's plain_width).

    python benchmarks/verify_widths.py [--contexts 100 450 1500] [--reps 3] [--runs 7]"""

import argparse

import mlx_spec  # noqa: F401  (loads OpenBLAS before mlx.core does any work)

# isort: split

import mlx.core as mx

from eagle_cost import interleaved_medians
from mlx_spec.cache import make_cache, rollback_to
from mlx_spec.convert.default import default_model_path
from mlx_spec.models.target import load_target

WIDTHS = (1, 2, 3, 4, 6, 9)


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--contexts", type=int, nargs="+", default=[100, 450, 1500])
    parser.add_argument("--reps", type=int, default=3, help="timed calls per round")
    parser.add_argument("--runs", type=int, default=7, help="rounds over every width")
    args = parser.parse_args()
    target = load_target(default_model_path(), "auto")
    for context in args.contexts:
        cache = make_cache(target.model)
        target.forward(mx.random.randint(0, 1000, (1, context)), cache, ())
        mx.eval([c.state for c in cache])

        def verification(width):
            tokens = mx.random.randint(0, 1000, (1, width))

            def step():
                logits, _ = target.forward(tokens, cache, ())
                rollback_to(cache, context, None)  # lazy: the step reads what it wrote before the trim
                return logits

            return step

        ms = interleaved_medians([verification(w) for w in WIDTHS], args.reps, args.runs)
        print(f"context {context}: " + ", ".join(f"width {w} {t:.1f} ms" for w, t in zip(WIDTHS, ms)))


if __name__ == "__main__":
    main()
