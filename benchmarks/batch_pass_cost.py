"""What one verification pass costs by the rows it batches and the width of each row (1 + the
drafts verified), on the default model: the shape the batch's pass-width choice (batch.py)
models as seconds ~ a + b * rows * width.

Every row holds the same context (a held-out prompt, --context tokens); each (rows, width) pass
is run --repeats times, its cache rolled back after each, and the median is reported, with the
fit of a + b * rows * width over all of them.

    .venv/bin/python benchmarks/batch_pass_cost.py [--rows 1,2,4,8] [--widths 1,2,3,5,9] [--json out.json]
"""

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import mlx_spec  # noqa: F401  (OpenBLAS before mlx.core)

# isort: split
import mlx.core as mx
import numpy as np

from mlx_spec.cache import RaggedKVCache, make_cache
from mlx_spec.convert.default import default_model_path
from mlx_spec.models.target import load_target

PROMPTS = Path(__file__).resolve().parent / "heldout_prompts.jsonl"


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", default="1,2,4,8")
    parser.add_argument("--widths", default="1,2,3,5,9")
    parser.add_argument("--context", type=int, default=300, help="tokens of context in every row")
    parser.add_argument("--repeats", type=int, default=7)
    parser.add_argument("--json", default=None)
    args = parser.parse_args()
    rows_list = [int(x) for x in args.rows.split(",")]
    widths = [int(x) for x in args.widths.split(",")]

    target = load_target(default_model_path(), "auto")
    text = " ".join(
        json.loads(line).get("prompt") or json.loads(line)["turns"][0]
        for line in PROMPTS.read_text().splitlines()
        if line.strip()
    )
    context = target.tokenizer.encode(text)[: args.context]
    if len(context) < args.context:
        sys.exit(f"the held-out prompts give only {len(context)} tokens")
    own = make_cache(target.model)
    mx.eval(target.model(mx.array(context)[None], cache=own))

    results = []
    for rows in rows_list:
        cache = [RaggedKVCache() for _ in own]
        for batch, layer in zip(cache, own):
            for _ in range(rows):
                batch.add(layer)
        for width in widths:
            tokens = mx.array(np.random.default_rng(0).integers(0, target.vocab_size, (rows, width)))
            seconds = []
            for repeat in range(args.repeats + 1):  # the first builds the graph: not counted
                tic = time.perf_counter()
                mx.eval(target.model(tokens, cache=cache))
                if repeat:
                    seconds.append(time.perf_counter() - tic)
                for batch in cache:
                    batch.lengths = [n - width for n in batch.lengths]
            results.append(dict(rows=rows, width=width, ms=1000 * statistics.median(seconds)))
            print(f"rows {rows} width {width}: {results[-1]['ms']:.1f} ms", file=sys.stderr)

    x = np.array([r["rows"] * r["width"] for r in results], float)
    y = np.array([r["ms"] for r in results])
    b, a = np.polyfit(x, y, 1)
    print(
        f"{len(context)} tokens of context per row; median of {args.repeats} passes; fit: "
        f"{a:.1f} ms + {b:.2f} ms x rows x width\n"
    )
    print("| rows | " + " | ".join(f"width {w}" for w in widths) + " |")
    print("|---|" + "---|" * len(widths))
    for rows in rows_list:
        cells = [next(r for r in results if r["rows"] == rows and r["width"] == w) for w in widths]
        print(
            f"| {rows} | "
            + " | ".join(f"{c['ms']:.0f} ms (fit {a + b * rows * c['width']:.0f})" for c in cells)
            + " |"
        )
    if args.json:
        Path(args.json).write_text(
            json.dumps(dict(args=vars(args), fit=dict(a_ms=a, b_ms=b), results=results), indent=1)
        )


if __name__ == "__main__":
    main()
