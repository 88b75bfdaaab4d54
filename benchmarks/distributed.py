"""Speculative decoding over a split target against mlx-lm's own decoding of the same split
target, in one run: tokens/s of each (prefill included, as `mlx-spec bench`), whether the
outputs are identical, and what one collective costs here.

Run on every rank with mlx.launch (the embedded model has 9 heads and 3 KV heads: 3 ranks for
tensor parallelism; mlx-lm has pipeline stages for qwen3_next, qwen3_5, deepseek_v3, ...):

    mlx.launch --backend ring -n 3 .venv/bin/python benchmarks/distributed.py --sharding tensor
    mlx.launch --backend ring -n 2 .venv/bin/python benchmarks/distributed.py --sharding pipeline \\
        --model DIR --methods lookup

Plain: every rank runs mlx_lm.stream_generate over its shard (as mlx-lm's sharded generation
does); at temperature > 0 it draws by mlx-spec's seeded rule (mlx_spec.bench.seeded_sampler), so
that both write the same text. mlx-spec: rank 0 runs distributed.split_engine (adaptive), the
others distributed.Follower. Rank 0 prints the table and writes --out."""

import mlx_spec  # noqa: F401  (first: it loads OpenBLAS before mlx.core does any work)

# isort: split

import argparse
import json
import statistics
import time
from pathlib import Path

import mlx.core as mx

from mlx_spec.api import model_path
from mlx_spec.bench import baseline_sampler, baseline_steps, load_prompts, method_steps
from mlx_spec.distributed import STOP, Follower, SplitTarget
from mlx_spec.drafters import draft_tokens, make_drafter, source_options
from mlx_spec.events import Collector
from mlx_spec.sampling import SamplingParams

HERE = Path(__file__).parent


def collective_seconds(group, hidden_size, positions, repeats=50):
    """Median time of one all_sum of [1, positions, hidden] float32 (what a tensor-parallel
    layer sums twice per pass), on the CPU stream."""
    x = mx.ones((1, positions, hidden_size))
    times = []
    for _ in range(5):  # warm up
        mx.eval(mx.distributed.all_sum(x, group=group, stream=mx.cpu))
    for _ in range(repeats):
        tic = time.perf_counter()
        mx.eval(mx.distributed.all_sum(x, group=group, stream=mx.cpu))
        times.append(time.perf_counter() - tic)
    return statistics.median(times)


def transfer_seconds(group, hidden_size, positions, layers, repeats=50):
    """Median time of what a pipeline stage sends rank 0 after each pass when rank 0's drafter
    reads its layers: [1, positions, hidden x layers] float32 from rank 1 to rank 0 (None on
    the other ranks, which take no part)."""
    x = mx.ones((1, positions, hidden_size * layers))
    times = []
    for i in range(5 + repeats):
        tic = time.perf_counter()
        if group.rank() == 1:
            mx.eval(mx.distributed.send(x, 0, group=group, stream=mx.cpu))
        elif group.rank() == 0:
            mx.eval(mx.distributed.recv_like(x, 1, group=group, stream=mx.cpu))
        if i >= 5:
            times.append(time.perf_counter() - tic)
        mx.eval(
            mx.distributed.all_sum(mx.zeros(1), group=group, stream=mx.cpu)
        )  # the next one starts together
    return statistics.median(times) if group.rank() == 0 else None


def plain_run(target, prompt, max_tokens, sampling, seed):
    """mlx-lm's decoding of the split target on every rank: (tokens, seconds)."""
    out = Collector()
    tic = time.perf_counter()
    for _ in baseline_steps(target, prompt, max_tokens, baseline_sampler(sampling, seed), out):
        pass
    return out.tokens, time.perf_counter() - tic


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--sharding", choices=["tensor", "pipeline"], required=True)
    parser.add_argument("--model", default=None, help="default: the embedded model")
    parser.add_argument("--methods", default="lookup,eagle")
    parser.add_argument("--prompts", default=str(HERE / "heldout_prompts.jsonl"))
    parser.add_argument("--limit", type=int, default=0, help="first N prompts (0: all)")
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--temps", default="0,1")
    parser.add_argument("--out", default=None)
    args = parser.parse_args()

    split = SplitTarget(model_path(args.model), "auto", args.sharding, rank_timeout=300)
    target, channel, rank0 = split.target, split.channel, split.leader
    group = channel.group
    follower = None if rank0 else Follower(target, channel)
    comm = {n: collective_seconds(group, target.hidden_size, n) for n in (1, 8)}
    # EAGLE-3 reads 3 layers, DFlash 5 (its shipped layer: 3): one pass of 1 or 8 positions
    taps = {f"{n}x{k}": transfer_seconds(group, target.hidden_size, n, k) for n in (1, 8) for k in (3, 5)}
    items = load_prompts(args.prompts)[: args.limit or None]
    methods = args.methods.split(",")
    records = []
    for temp in (float(t) for t in args.temps.split(",")):
        sampling = SamplingParams(temp=temp)
        engines = {}
        for item in items:
            prompt = target.tokenizer.apply_chat_template(
                [{"role": "user", "content": item["turns"][0]}], add_generation_prompt=True
            )
            for repeat in range(args.repeats):
                tokens, seconds = plain_run(target, prompt, args.max_tokens, sampling, seed=repeat)
                row = dict(
                    temp=temp,
                    question_id=item["question_id"],
                    repeat=repeat,
                    plain_tokens=len(tokens),
                    plain_seconds=seconds,
                )
                for method in methods:
                    if not rank0:
                        follower.follow()
                        continue
                    if method not in engines:
                        drafter = make_drafter(method, target, source_options(method))
                        engines[method] = split.engine(
                            drafter, sampling=sampling, num_draft_tokens=draft_tokens(method, None)
                        )
                    engine = engines[method]
                    engine.sampler.reseed(repeat)
                    out = Collector()
                    tic = time.perf_counter()
                    for _ in method_steps(engine, prompt, args.max_tokens, out):
                        pass
                    row[method] = dict(
                        tokens=len(out.tokens),
                        seconds=time.perf_counter() - tic,
                        identical=out.tokens == tokens,
                        steps=out.stats.steps,
                        accepted=out.stats.accepted_drafts,
                    )
                    channel.send(STOP)
                records.append(row)
    if not rank0:
        return
    summary = summarize(records, methods)
    print(
        f"{group.size()} ranks, --sharding {args.sharding}, {target.model_type} "
        f"{target.num_layers} layers; one all_sum of [1, n, {target.hidden_size}] float32: "
        + ", ".join(f"n={n} {s * 1e3:.2f} ms" for n, s in comm.items())
        + f"; rank 1 -> 0 of [1, n, {target.hidden_size} x layers] (a stage's taps): "
        + ", ".join(f"{key} {s * 1e3:.2f} ms" for key, s in taps.items())
    )
    print(
        f"{'temp':>4} {'method':>8} {'plain tok/s':>11} {'tok/s':>7} {'speedup':>7} {'tokens/step':>11} identical"
    )
    for row in summary:
        print(
            f"{row['temp']:>4g} {row['method']:>8} {row['plain_tps']:>11.1f} {row['tps']:>7.1f} "
            f"{row['speedup']:>6.2f}x {row['tokens_per_step']:>11.2f} {row['identical']}"
        )
    if args.out:
        Path(args.out).write_text(
            json.dumps(
                dict(
                    ranks=group.size(),
                    sharding=args.sharding,
                    model=args.model or "embedded",
                    collective_seconds=comm,
                    tap_transfer_seconds=taps,
                    summary=summary,
                    records=records,
                ),
                indent=1,
            )
        )


def summarize(records, methods):
    """Per temperature and method: tok/s over all prompts of each repeat, the median of the
    repeats; the speedup is the median of the repeats' ratios."""
    rows = []
    for temp in sorted({r["temp"] for r in records}):
        at = [r for r in records if r["temp"] == temp]
        for method in methods:
            per_repeat = []
            for repeat in sorted({r["repeat"] for r in at}):
                rs = [r for r in at if r["repeat"] == repeat]
                plain = sum(r["plain_tokens"] for r in rs) / sum(r["plain_seconds"] for r in rs)
                tps = sum(r[method]["tokens"] for r in rs) / sum(r[method]["seconds"] for r in rs)
                per_repeat.append((plain, tps, tps / plain))
            steps = sum(r[method]["steps"] for r in at)
            rows.append(
                dict(
                    temp=temp,
                    method=method,
                    plain_tps=statistics.median(p for p, _, _ in per_repeat),
                    tps=statistics.median(t for _, t, _ in per_repeat),
                    speedup=statistics.median(s for _, _, s in per_repeat),
                    tokens_per_step=sum(r[method]["tokens"] for r in at) / steps if steps else 0.0,
                    identical=f"{sum(r[method]['identical'] for r in at)}/{len(at)}",
                )
            )
    return rows


if __name__ == "__main__":
    main()
