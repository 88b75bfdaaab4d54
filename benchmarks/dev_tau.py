"""Tau (tokens per verification step) at a fixed number of drafts, every draft verified, of
published drafters on a `mlx-spec train data` held-out split: the learning curves' dev measure
(train/loop.py DevEvaluation) for finished drafters, and at any temperature (sampled: one
generation per --seeds seed, each prompt meeting the same noise whatever the drafter).

Not a speed measure (that is `mlx-spec bench`): it compares drafters by what they get accepted,
e.g. a candidate against the shipped one, or the same drafter at temperature 0 and 1.

    python benchmarks/dev_tau.py --data work/drafters/data-mixed --method eagle \\
        --draft-model shipped --draft-model work/drafters/eagle5 --temp 1 --seeds 0,1 --prompts 16
"""

import argparse
import json

import mlx_spec  # noqa: F401  (loads OpenBLAS before mlx.core does any work)

# isort: split

from mlx_spec.api import model_path
from mlx_spec.drafters import make_drafter
from mlx_spec.models.target import load_target
from mlx_spec.sampling import SamplingParams
from mlx_spec.train.loop import DevEvaluation


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default=None, help="target (default: the embedded model)")
    parser.add_argument("--data", required=True, help="a `train data` directory: its heldout.jsonl")
    parser.add_argument("--method", default="eagle", help="the draft source (--draft)")
    parser.add_argument(
        "--draft-model",
        action="append",
        default=[],
        help="a drafter directory, or 'shipped' (the default model's); repeat to compare",
    )
    parser.add_argument("--temp", type=float, default=0.0)
    parser.add_argument("--seeds", default="0", help="comma-separated sampling seeds")
    parser.add_argument("--prompts", type=int, default=16)
    parser.add_argument("--max-tokens", type=int, default=48)
    parser.add_argument("--draft-tokens", type=int, default=4)
    args = parser.parse_args()

    target = load_target(model_path(args.model), "auto")
    seeds = [int(s) for s in args.seeds.split(",")]
    for drafter_dir in args.draft_model or ["shipped"]:
        options = {"draft_model": None if drafter_dir == "shipped" else drafter_dir}
        evaluate = DevEvaluation(
            target,
            args.data,
            lambda _: make_drafter(args.method, target, options),
            args.prompts,
            args.max_tokens,
            args.draft_tokens,
            SamplingParams(temp=args.temp),
            seeds,
        )
        result = evaluate(None)
        print(
            json.dumps(
                {
                    "method": args.method,
                    "draft_model": drafter_dir,
                    "temp": args.temp,
                    "seeds": seeds,
                    "max_tokens": args.max_tokens,
                    "draft_tokens": args.draft_tokens,
                    **result,
                }
            ),
            flush=True,
        )


if __name__ == "__main__":
    main()
