"""OpenAI's Predicted Outputs as a draft source, on rewrite tasks: the prediction is the file the
prompt asks to edit (benchmarks/workloads/edit.jsonl: a Python file, then a small edit, "return
the whole file"), as an agent would send it.

Each method generates every prompt's first turn beside plain mlx-lm (`mlx_lm.stream_generate` on
the same float32 weights), the two interleaved in turns as `mlx-spec bench` times them (who
starts alternates); speedup = method tok/s / mlx-lm tok/s over a repeat's prompts, median over
repeats. Methods: `suffix` (suffix decoding alone, no memory), `suffix+prediction` (the same with
the request's prediction), `none+prediction` (the prediction alone), `lookup+prediction`.
Every output is compared with mlx-lm's (greedy: token-identical).

    .venv/bin/python benchmarks/predicted_outputs.py --repeats 3 --max-tokens 160 [--markdown out.md]
"""

import argparse
import json
import re
import statistics
from pathlib import Path

import mlx_spec  # noqa: F401  (OpenBLAS before mlx.core)

# isort: split
from mlx_spec.bench import baseline_steps, method_steps, timed_in_turns
from mlx_spec.convert.default import default_model_path
from mlx_spec.drafters import make_drafter
from mlx_spec.engine import Engine, GenerationOptions
from mlx_spec.events import Collector
from mlx_spec.models.target import load_target
from report import write_results

WORKLOAD = Path(__file__).resolve().parent / "workloads" / "edit.jsonl"
METHODS = {
    "suffix": ("suffix", False),
    "suffix+prediction": ("suffix", True),
    "none+prediction": ("none", True),
    "lookup+prediction": ("lookup", True),
}


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--max-tokens", type=int, default=160)
    parser.add_argument("--methods", default=",".join(METHODS))
    parser.add_argument("--markdown", default=None)
    args = parser.parse_args()
    target = load_target(default_model_path(), "float32")
    tokenizer = target.tokenizer
    items = []
    for line in WORKLOAD.read_text().splitlines():
        turn = json.loads(line)["turns"][0]
        code = re.search(r"```python\n(.*?)```", turn, re.S).group(1)
        prompt = tokenizer.apply_chat_template(
            [{"role": "user", "content": turn}], add_generation_prompt=True
        )
        # As a client sends it: the file the reply is expected to be, in its fence.
        prediction = tokenizer.encode(f"```python\n{code}```", add_special_tokens=False)
        items.append((prompt, prediction))
    names = args.methods.split(",")
    engines = {
        name: Engine(
            target,
            make_drafter(
                METHODS[name][0], target, {"suffix_memory": "off"} if METHODS[name][0] == "suffix" else {}
            ),
        )
        for name in names
    }
    sampler = None  # greedy: mlx-lm's default
    rows = {name: [] for name in names}
    identical = {name: [0, 0] for name in names}
    taus = {name: [] for name in names}
    order = 0
    for _ in range(args.repeats):
        for name in names:
            method_tokens = method_seconds = base_tokens = base_seconds = 0
            for prompt, prediction in items:
                options = GenerationOptions(prediction=tuple(prediction) if METHODS[name][1] else ())
                base, run = Collector(), Collector()
                runs = [
                    baseline_steps(target, prompt, args.max_tokens, sampler, base),
                    method_steps(engines[name], prompt, args.max_tokens, run, options),
                ]
                first = [0, 1] if order % 2 == 0 else [1, 0]
                order += 1
                spent = timed_in_turns([runs[i] for i in first])
                base_s, run_s = spent[first.index(0)], spent[first.index(1)]
                method_tokens, method_seconds = method_tokens + len(run.tokens), method_seconds + run_s
                base_tokens, base_seconds = base_tokens + len(base.tokens), base_seconds + base_s
                identical[name][0] += run.tokens == base.tokens
                identical[name][1] += 1
                taus[name].append(run.stats.tokens_per_step)
            rows[name].append((method_tokens / method_seconds, base_tokens / base_seconds))
    lines = [
        "| method | tok/s | mlx-lm tok/s | speedup | tau (median) | identical |",
        "|---|---|---|---|---|---|",
    ]
    for name in names:
        speedups = [m / b for m, b in rows[name]]
        lines.append(
            f"| {name} | {statistics.median(m for m, _ in rows[name]):.1f} | "
            f"{statistics.median(b for _, b in rows[name]):.1f} | {statistics.median(speedups):.2f}x "
            f"({', '.join(f'{x:.2f}' for x in speedups)}) | {statistics.median(taus[name]):.2f} | "
            f"{identical[name][0]}/{identical[name][1]} |"
        )
    note = (
        f"{len(items)} prompts (benchmarks/workloads/edit.jsonl, first turns), {args.max_tokens} tokens, "
        f"{args.repeats} repeats, greedy"
    )
    write_results("\n".join(lines), note, None, args.markdown)


if __name__ == "__main__":
    main()
