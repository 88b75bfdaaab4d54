"""LayerSkip on the default model: acceptance against the exit layer (issue 18).

For each exit layer E, the default model decodes the first turn of every held-out prompt
greedily with `--draft layerskip --exit-layer E`, every draft verified (fixed k), and reports
tau (tokens per verification step) and the share of drafts accepted. SmolLM2 was not trained
for early exit, so this measures how far its intermediate layers already agree with its last.
Timing against plain mlx-lm comes from `mlx-spec bench --methods layerskip --exit-layer E`.

    .venv/bin/python benchmarks/layerskip_exit_layers.py [--exits 6 12 18 24 27] [--k 4]
"""

import argparse
import json
from pathlib import Path

from mlx_spec.convert.default import default_model_path
from mlx_spec.drafters.layerskip import LayerSkipDrafter
from mlx_spec.engine import Engine
from mlx_spec.events import Step
from mlx_spec.models.target import load_target

PROMPTS = Path(__file__).resolve().parent / "heldout_prompts.jsonl"


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--exits", type=int, nargs="+", default=[6, 12, 18, 24, 27])
    parser.add_argument("--k", type=int, default=4)
    parser.add_argument("--max-tokens", type=int, default=64)
    args = parser.parse_args()
    target = load_target(default_model_path(), "float32")
    items = [json.loads(line) for line in PROMPTS.read_text().splitlines()]
    print(f"| exit layer (of {target.num_layers}) | tau at k={args.k} | drafts accepted |")
    print("| --- | --- | --- |")
    for exit_layer in args.exits:
        steps = accepted = proposed = 0
        for item in items:
            text = item["turns"][0] if "turns" in item else item["prompt"]
            prompt = target.tokenizer.apply_chat_template(
                [{"role": "user", "content": text}], add_generation_prompt=True
            )
            engine = Engine(
                target, LayerSkipDrafter(target, exit_layer), num_draft_tokens=args.k, adaptive=False
            )
            for event in engine.generate(prompt, max_tokens=args.max_tokens):
                if isinstance(event, Step):
                    steps, proposed, accepted = (
                        steps + 1,
                        proposed + event.verified,
                        accepted + event.accepted,
                    )
        print(
            f"| {exit_layer} | {(steps + accepted) / steps:.2f} | {accepted / max(proposed, 1):.0%} |",
            flush=True,
        )


if __name__ == "__main__":
    main()
