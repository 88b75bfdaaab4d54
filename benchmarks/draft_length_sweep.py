"""Tokens per step and speed of a drafter at several draft lengths, against plain decoding in
the same run (greedy), on the held-out prompts, each length fixed (--fixed) or as the most the
policy may verify (--adaptive).

    .venv/bin/python benchmarks/draft_length_sweep.py --method eagle --lengths 2,3,4,6
"""

import argparse
import json
import statistics
from pathlib import Path

import mlx_spec  # noqa: F401  (loads OpenBLAS before mlx.core)

# isort: split
from mlx_spec.convert.default import default_model_path
from mlx_spec.drafters import make_drafter
from mlx_spec.engine import Engine
from mlx_spec.events import Collector
from mlx_spec.models.target import load_target

PROMPTS = Path(__file__).resolve().parent / "heldout_prompts.jsonl"


def timed(engine, prompt, max_tokens):
    """(generation tok/s, Stats) of one run."""
    stats = Collector.of(engine.generate(prompt, max_tokens=max_tokens)).stats
    return stats.tokens_per_second, stats


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--method", required=True)
    parser.add_argument("--draft-model", default=None)
    parser.add_argument("--lengths", default="2,3,4,6")
    parser.add_argument("--prompts", type=int, default=5, help="the first N held-out prompts")
    parser.add_argument("--max-tokens", type=int, default=96)
    parser.add_argument("--adaptive", action="store_true", help="let the policy choose up to each length")
    args = parser.parse_args()
    target = load_target(default_model_path())
    rows = [json.loads(line) for line in PROMPTS.read_text().splitlines()][::2][: args.prompts]
    prompts = [
        target.tokenizer.apply_chat_template(
            [{"role": "user", "content": r["prompt"]}], add_generation_prompt=True
        )
        for r in rows
    ]
    plain = Engine(target)
    timed(plain, prompts[0], 8)  # warm-up
    base = [timed(plain, p, args.max_tokens)[0] for p in prompts]
    print(f"plain: {statistics.median(base):.1f} tok/s (median of {len(prompts)} prompts)")
    for k in [int(v) for v in args.lengths.split(",")]:
        drafter = make_drafter(args.method, target, dict(draft_model=args.draft_model, num_draft_tokens=k))
        engine = Engine(target, drafter, num_draft_tokens=k, adaptive=args.adaptive)
        results = [timed(engine, p, args.max_tokens) for p in prompts]
        speed = [r[0] / b for r, b in zip(results, base)]
        taus = [r[1].tokens_per_step for r in results]
        print(
            f"{args.method} k={k}: tau {statistics.median(taus):.2f} (per prompt "
            f"{', '.join(f'{t:.2f}' for t in taus)}), speedup {statistics.median(speed):.2f}x"
        )


if __name__ == "__main__":
    main()
