"""Acceptance of the seeded (Gumbel) rule against the residual rule, per sampling drafter, on
the held-out prompts of the default model: every draft verified (fixed length), so that the
rule alone differs. The seeded rule couples the drafter's draw with the target's through the
same noise; the residual rule accepts x with min(1, p/q).

    .venv/bin/python benchmarks/sampling_rule_acceptance.py --temp 1 --prompts 5
"""

import argparse
import json
from pathlib import Path

import mlx_spec  # noqa: F401  (loads OpenBLAS before mlx.core)

# isort: split
from mlx_spec.convert.default import default_model_path
from mlx_spec.drafters import draft_tokens, make_drafter
from mlx_spec.engine import Engine
from mlx_spec.events import Collector
from mlx_spec.models.target import load_target
from mlx_spec.sampling import SamplingParams

PROMPTS = Path(__file__).resolve().parent / "heldout_prompts.jsonl"


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--methods", default="eagle,dflash")
    parser.add_argument("--temp", type=float, default=1.0)
    parser.add_argument("--prompts", type=int, default=5, help="the first N single-turn held-out prompts")
    parser.add_argument("--max-tokens", type=int, default=64)
    args = parser.parse_args()
    target = load_target(default_model_path())
    rows = [json.loads(line) for line in PROMPTS.read_text().splitlines()]
    rows = [r for r in rows if "prompt" in r][::2][: args.prompts]
    prompts = [
        target.tokenizer.apply_chat_template(
            [{"role": "user", "content": r["prompt"]}], add_generation_prompt=True
        )
        for r in rows
    ]
    params = SamplingParams(temp=args.temp)
    for method in args.methods.split(","):
        k = draft_tokens(method)
        for residual in (False, True):
            engine = Engine(
                target,
                make_drafter(method, target, {}),
                num_draft_tokens=k,
                sampling=params,
                seed=0,
                residual=residual,
                adaptive=False,
            )
            proposed = accepted = committed = steps = 0
            for prompt in prompts:
                stats = Collector.of(engine.generate(prompt, max_tokens=args.max_tokens)).stats
                proposed, accepted = proposed + stats.verified_drafts, accepted + stats.accepted_drafts
                committed, steps = committed + stats.committed_tokens, steps + stats.steps
            print(
                f"{method} k={k} temp {args.temp} {'residual' if residual else 'seeded  '} rule: "
                f"acceptance {accepted / proposed:.1%}, tau {committed / steps:.2f} "
                f"({len(prompts)} prompts x {args.max_tokens} tokens)",
                flush=True,
            )


if __name__ == "__main__":
    main()
