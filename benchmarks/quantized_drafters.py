"""How much a quantized drafter still drafts what its float original does (issue 19).

For each drafter (float, as shipped) and each quantization, the target decodes the held-out
prompts greedily with the float drafter while the quantized one, fed exactly the same
prefills and commits, proposes from the same states: agreement is the share of drafted
positions where the two propose the same token (up to the first difference of each step: what
follows a difference drafts from another prefix). Then the quantized drafter's own held-out tau
at the same fixed draft length.

    .venv/bin/python benchmarks/quantized_drafters.py [--max-tokens 64] [--bits 8 4]
"""

import argparse
import json
import tempfile
from pathlib import Path

from mlx_spec.convert.default import default_model_path
from mlx_spec.convert.drafter import convert_drafter, load_drafter
from mlx_spec.drafters.base import Drafter
from mlx_spec.drafters.dflash import DFlashDrafter
from mlx_spec.drafters.eagle import EagleDrafter
from mlx_spec.engine import Engine
from mlx_spec.events import Done
from mlx_spec.models.default import SHIPPED_DRAFTERS
from mlx_spec.models.target import load_target

LENGTHS = {"eagle": 4, "dflash": 8}


class Tee(Drafter):
    """Drafts with `main`; `shadow` sees every call too and its proposals are compared."""

    def __init__(self, main, shadow):
        self.main, self.shadow = main, shadow
        self.taps, self.tree = main.taps, False
        self.same = self.compared = 0

    def bind(self, sampler, target_cache, keep_drafting=None):
        for drafter in (super(), self.main, self.shadow):
            drafter.bind(sampler, target_cache, keep_drafting)

    def prefill(self, context, taps, start):
        self.main.prefill(context, taps, start)
        self.shadow.prefill(context, taps, start)

    def propose(self, k):
        draft, other = self.main.propose(k), self.shadow.propose(k)
        for a, b in zip(*(t.tolist() if hasattr(t, "tolist") else t for t in (draft.tokens, other.tokens))):
            self.compared += 1
            if a != b:
                break
            self.same += 1
        return draft

    def commit(self, accepted, next_token, taps):
        self.main.commit(accepted, next_token, taps)
        self.shadow.commit(accepted, next_token, taps)


def make(kind, target, path):
    model = load_drafter(kind, path, target)
    return EagleDrafter(model, target.vocab_size) if kind == "eagle" else DFlashDrafter(target, model)


def held_out(target, engine, max_tokens):
    """tau over the first turn of each held-out prompt."""
    committed = steps = 0
    for line in open(Path(__file__).parent / "heldout_prompts.jsonl"):
        item = json.loads(line)
        user = item["turns"][0] if "turns" in item else item["prompt"]
        prompt = target.tokenizer.apply_chat_template(
            [{"role": "user", "content": user}], add_generation_prompt=True
        )
        for event in engine.generate(prompt, max_tokens=max_tokens):
            if isinstance(event, Done):
                committed, steps = committed + event.stats.committed_tokens, steps + event.stats.steps
    return committed / steps


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--bits", type=int, nargs="+", default=[8, 4])
    args = parser.parse_args()
    target = load_target(default_model_path(), "auto")
    print("| drafter | weights | agreement with float drafts | held-out tau (fixed k) |")
    print("|---|---|---|---|")
    with tempfile.TemporaryDirectory() as tmp:
        for kind, k in LENGTHS.items():
            shipped = SHIPPED_DRAFTERS / kind
            tau = held_out(
                target,
                Engine(target, make(kind, target, shipped), num_draft_tokens=k, adaptive=False),
                args.max_tokens,
            )
            print(f"| {kind} (k={k}) | float16 as shipped | - | {tau:.2f} |", flush=True)
            for bits in args.bits:
                out = convert_drafter(
                    shipped, Path(tmp) / f"{kind}-{bits}", target, quantize=True, q_bits=bits
                )
                tee = Tee(make(kind, target, shipped), make(kind, target, out))
                held_out(target, Engine(target, tee, num_draft_tokens=k, adaptive=False), args.max_tokens)
                tau = held_out(
                    target,
                    Engine(target, make(kind, target, out), num_draft_tokens=k, adaptive=False),
                    args.max_tokens,
                )
                size = sum(f.stat().st_size for f in out.glob("*.safetensors")) / 2**20
                print(
                    f"| {kind} (k={k}) | {bits}-bit, {size:.1f} MB | {tee.same / tee.compared:.1%} "
                    f"({tee.compared} drafts) | {tau:.2f} |",
                    flush=True,
                )


if __name__ == "__main__":
    main()
