"""Random-weight copies of the drafters shipped for the default model, for the policy's worst
case: `mlx-spec bench --draft-model eagle=OUT/eagle --draft-model dflash=OUT/dflash ...`
should end up drafting almost nothing and run at plain speed.

Same config and tensor names as the shipped drafter; every matrix is drawn from N(0, 0.02^2)
(the usual initialisation), norm weights are ones, integer tensors (EAGLE-3's d2t/t2d vocabulary
maps) are kept so that the checkpoint stays valid.

    python benchmarks/random_drafters.py OUT [--seed 0]"""

import argparse
import shutil
from pathlib import Path

import mlx.core as mx

SHIPPED = Path(__file__).resolve().parent.parent / "mlx_spec" / "shipped" / "smollm2-135m-instruct"


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("out")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    mx.random.seed(args.seed)
    for name in ("eagle", "dflash"):
        source, out = SHIPPED / name, Path(args.out) / name
        out.mkdir(parents=True, exist_ok=True)
        shutil.copy(source / "config.json", out / "config.json")
        weights = mx.load(str(source / "model.safetensors"))
        for key, w in weights.items():
            if not mx.issubdtype(w.dtype, mx.floating):
                continue
            weights[key] = (mx.ones(w.shape) if "norm" in key else 0.02 * mx.random.normal(w.shape)).astype(
                w.dtype
            )
        mx.save_safetensors(str(out / "model.safetensors"), weights, metadata={"format": "pt"})
        print(f"{out}: {len(weights)} tensors")


if __name__ == "__main__":
    main()
