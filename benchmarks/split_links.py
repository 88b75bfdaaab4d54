"""Speculation over a target split across two "machines" joined by a simulated link, against the
same sources on one machine, in one run.

    .venv/bin/python benchmarks/split_links.py --out benchmarks/results/split-links-DATE

The model: the embedded default model (SmolLM2-135M, 30 layers, width 576) as mlx-lm's qwen2,
which has pipeline stages (llama has none): the same weights with q/k/v biases of zero, so the
same tokens (checked against the llama form here). Its 9 heads do not split over 2 ranks, so
there is no tensor-parallel row. Two ranks (pipeline: rank 1 the first 15 layers, rank 0 the
last 15 and the drafter), each pinned to its own core (`taskset`), talk through
benchmarks/link_relay.py with one-way latency L (L = 0: directly); "one machine" is one process
pinned to one core running the whole model. Every process runs one BLAS thread.

At each L: a ping-pong of [1, n, 576] float32 arrays between the ranks (the relay's own cost and
its delay, against the direct path); then plain decoding of the split target (`--draft none`)
and each source over it, greedy, adaptive, prompts from benchmarks/heldout_prompts.jsonl, every
output compared with the one-process run's. Decode tok/s (prefill excluded), medians over
repeats; passes per token; drafts verified per step (what the adaptive policy chose); the link's
share of a pass (split seconds per pass minus one process's, same method). Tree sources verify
their chains (a split target verifies chains), on one process too."""

import mlx_spec  # noqa: F401  (first: it loads OpenBLAS before mlx.core does any work)

# isort: split

import argparse
import json
import os
import shutil
import socket
import statistics
import subprocess
import sys
import time
from pathlib import Path

import mlx.core as mx

from mlx_spec.api import model_path
from mlx_spec.bench import load_prompts
from mlx_spec.distributed import SplitTarget
from mlx_spec.drafters import draft_tokens, make_drafter, source_options
from mlx_spec.engine import Engine
from mlx_spec.errors import MlxSpecError
from mlx_spec.events import Collector
from mlx_spec.models.default import SHIPPED_DRAFTERS
from mlx_spec.models.target import load_target

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
METHODS = ("none", "lookup", "suffix", "eagle", "mtp")


# --- the model ------------------------------------------------------------------------------


def qwen2_form(source: Path, out: Path) -> Path:
    """The llama checkpoint at `source` (a model, or the shipped MTP module, whose decoder layer
    is of the target's class) as mlx-lm's qwen2 in `out`: its weights and q/k/v biases of zero,
    in the dtype of the layer's quantization scales or weight (adding them changes no bit)."""
    if (out / "config.json").exists():
        return out
    out.mkdir(parents=True, exist_ok=True)
    for path in source.iterdir():
        if path.name not in ("config.json", "model.safetensors"):
            shutil.copy(path, out / path.name)
    config = json.loads((source / "config.json").read_text())
    config.update(model_type="qwen2", architectures=["Qwen2ForCausalLM"])
    weights = mx.load(str(source / "model.safetensors"))
    for name in [n for n in weights if n.endswith(("q_proj.weight", "k_proj.weight", "v_proj.weight"))]:
        stem = name.removesuffix(".weight")
        like = weights.get(f"{stem}.scales", weights[name])
        weights[f"{stem}.bias"] = mx.zeros((weights[name].shape[0],), like.dtype)
    mx.save_safetensors(str(out / "model.safetensors"), weights, metadata={"format": "mlx"})
    (out / "config.json").write_text(json.dumps(config, indent=2))
    return out


# --- what every process runs ----------------------------------------------------------------


def drafter_for(method, target):
    """The method's drafter (its chains where it drafts trees: what a split target verifies)."""

    given = {"suffix_memory": "off"} if method == "suffix" else {}
    if method == "eagle":
        given["draft_model"] = str(SHIPPED_DRAFTERS / "eagle")
    if method == "mtp":  # the qwen2 form, next to the model (the driver writes it)
        given["draft_model"] = str(Path(target.path).parent / "mtp-qwen2")
    try:
        drafter = make_drafter(method, target, source_options(method, **given))
    except Exception as e:  # refused, or weights that do not fit this target's layer class
        raise MlxSpecError(f"{method}: {str(e).splitlines()[0]}") from None
    if drafter is not None and drafter.tree:
        drafter = drafter.chains()
    return drafter


def prompts_of(target, path, limit):

    return [
        target.tokenizer.apply_chat_template(
            [{"role": "user", "content": item["turns"][0]}], add_generation_prompt=True
        )
        for item in load_prompts(path)[:limit]
    ]


def run_methods(target, make_engine, close, args) -> list:
    """Every method: a warm-up, then every prompt `repeats` times on a fresh cache; a record per
    generation. make_engine(method) -> engine; close(engine) after each method."""

    prompts, records = prompts_of(target, args.prompts, args.limit), []
    for method in args.methods.split(","):
        try:
            engine = make_engine(method, draft_tokens(method, None))
        except MlxSpecError as e:
            records.append(dict(method=method, refused=str(e)))
            continue
        Collector.of(engine.generate(prompts[0], max_tokens=8))
        for repeat in range(args.repeats):
            for i, prompt in enumerate(prompts):
                engine.reset()
                run = Collector.of(engine.generate(prompt, max_tokens=args.max_tokens, seed=0))
                stats = run.stats
                records.append(
                    dict(
                        method=method,
                        repeat=repeat,
                        prompt=i,
                        tokens=run.tokens,
                        seconds=stats.generate_seconds,
                        steps=stats.steps,
                        verified=stats.verified_drafts,
                        accepted=stats.accepted_drafts,
                        committed=stats.committed_tokens,
                    )
                )
        close(engine)
    return records


def alone(args):
    """The whole model on this process."""

    target = load_target(args.model, "auto")
    records = run_methods(
        target,
        lambda method, k: Engine(target, drafter_for(method, target), num_draft_tokens=k),
        lambda engine: None,
        args,
    )
    if args.check_against:  # the llama form gives the same tokens
        reference = load_target(args.check_against, "auto")

        prompt = prompts_of(reference, args.prompts, 1)[0]
        a = Collector.of(Engine(reference).generate(prompt, max_tokens=args.max_tokens)).tokens
        b = Collector.of(Engine(target).generate(prompt, max_tokens=args.max_tokens)).tokens
        records.append(dict(method="llama-form check", identical=a == b))
    Path(args.result).write_text(json.dumps(records))


def pingpong(group, hidden, positions, repeats=40):
    """Rank 0: median seconds of a round trip of [1, positions, hidden] float32 to rank 1 and back."""
    x = mx.ones((1, positions, hidden))
    times = []
    for i in range(5 + repeats):
        tic = time.perf_counter()
        if group.rank() == 0:
            mx.eval(mx.distributed.send(x, 1, group=group, stream=mx.cpu))
            mx.eval(mx.distributed.recv_like(x, 1, group=group, stream=mx.cpu))
        else:
            y = mx.distributed.recv_like(x, 0, group=group, stream=mx.cpu)
            mx.eval(mx.distributed.send(y, 0, group=group, stream=mx.cpu))
        if i >= 5:
            times.append(time.perf_counter() - tic)
    return statistics.median(times)


def rank(args):
    """A rank of the split target: rank 0 runs the engines, rank 1 follows."""

    split = SplitTarget(args.model, "auto", "pipeline", rank_timeout=600)
    group = split.channel.group
    trips = {n: pingpong(group, split.target.hidden_size, n) for n in (1, 8)}
    if not split.leader:
        for _ in args.methods.split(","):
            split.follow()
        return

    def make_engine(method, k):
        try:
            drafter = drafter_for(method, split.target)
        except MlxSpecError:
            split.close()  # the follower waits for this method's orders
            raise
        return split.engine(drafter, num_draft_tokens=k)  # refused: it lets the follower go

    records = run_methods(split.target, make_engine, lambda engine: engine.close(), args)
    Path(args.result).write_text(json.dumps(dict(pingpong=trips, records=records)))


# --- the driver -----------------------------------------------------------------------------


def free_ports(n):
    socks = [socket.socket() for _ in range(n)]
    for s in socks:
        s.bind(("127.0.0.1", 0))
    ports = [s.getsockname()[1] for s in socks]
    for s in socks:
        s.close()
    return ports


def worker(role, args, result, extra=()):
    return [
        sys.executable,
        str(Path(__file__).resolve()),
        "--role",
        role,
        "--model",
        args.model,
        "--methods",
        args.methods,
        "--prompts",
        args.prompts,
        "--limit",
        str(args.limit),
        "--max-tokens",
        str(args.max_tokens),
        "--repeats",
        str(args.repeats),
        "--result",
        str(result),
        *extra,
    ]


def environment():
    return dict(os.environ, OPENBLAS_NUM_THREADS="1", PYTHONPATH=str(ROOT))


def run_split(args, latency_ms, work: Path, relay: bool, timeout=3600):
    """Two ranks, each on its own core, through a relay of `latency_ms` (relay False: directly)."""
    real, relayed = free_ports(2), free_ports(2)
    if relay:
        hosts = [
            [[f"127.0.0.1:{real[0]}"], [f"127.0.0.1:{relayed[1]}"]],
            [[f"127.0.0.1:{relayed[0]}"], [f"127.0.0.1:{real[1]}"]],
        ]
    else:
        hosts = [[[f"127.0.0.1:{p}"] for p in real]] * 2
    relay_process = None
    if relay:
        routes = [f"--route={relayed[r]}:127.0.0.1:{real[r]}" for r in (0, 1)]
        relay_process = subprocess.Popen(
            [sys.executable, str(HERE / "link_relay.py"), *routes, f"--latency-ms={latency_ms}"],
            env=environment(),
        )
    result = work / f"split-{latency_ms}-{'relay' if relay else 'direct'}.json"
    ranks = []
    try:
        for r in (0, 1):
            hostfile = work / f"hosts-{r}.json"
            hostfile.write_text(json.dumps(hosts[r]))
            env = dict(environment(), MLX_RANK=str(r), MLX_HOSTFILE=str(hostfile))
            ranks.append(
                subprocess.Popen(["taskset", "-c", str(r), *worker("rank", args, result)], env=env, cwd=ROOT)
            )
        for process in ranks:
            if process.wait(timeout=timeout) != 0:
                raise SystemExit(f"a rank failed at L = {latency_ms} ms")
    finally:
        for process in ranks + ([relay_process] if relay_process else []):
            if process.poll() is None:
                process.kill()
                process.wait()
    return json.loads(result.read_text())


def summarize(alone_records, split_runs, methods):
    """One row per (L, method) and one per method alone."""

    def per_repeat(records, method):
        out = {}
        for r in records:
            if r.get("method") == method and "tokens" in r:
                tokens, seconds = out.get(r["repeat"], (0, 0.0))
                out[r["repeat"]] = (tokens + len(r["tokens"]), seconds + r["seconds"])
        return {repeat: tokens / seconds for repeat, (tokens, seconds) in out.items()}

    def row(records, method, base):
        rs = [r for r in records if r.get("method") == method]
        rates, plain = per_repeat(records, method), per_repeat(records, "none")
        steps = sum(r["steps"] for r in rs)
        return dict(
            method=method,
            tps=statistics.median(rates.values()),
            speedup=statistics.median(rates[k] / plain[k] for k in rates),
            passes_per_token=steps / sum(r["committed"] for r in rs),
            drafts_per_step=sum(r["verified"] for r in rs) / steps,
            seconds_per_pass=sum(r["seconds"] for r in rs) / steps,
            identical=f"{sum(r['tokens'] == base[(r['prompt'], r['repeat'])] for r in rs)}/{len(rs)}",
        )

    def tokens_of(records, method):
        return {(r["prompt"], r["repeat"]): r["tokens"] for r in records if r.get("method") == method}

    refused = {
        r["method"]
        for records in [alone_records] + [run["records"] for _, run in split_runs]
        for r in records
        if "refused" in r
    }
    methods = [m for m in methods if m not in refused]
    rows = [dict(link="one process", **row(alone_records, m, tokens_of(alone_records, m))) for m in methods]
    alone_pass = {r["method"]: r["seconds_per_pass"] for r in rows}
    for latency, run in split_runs:
        for m in methods:
            r = row(run["records"], m, tokens_of(alone_records, m))
            r["link_ms_per_pass"] = 1e3 * (r["seconds_per_pass"] - alone_pass[m])
            rows.append(dict(link=f"split, L = {latency:g} ms", **r))
    return rows


def cost_model(rows, latencies, methods):
    """Seconds per pass = c + a x L for each method (least squares over the split rows): a is
    how many one-way link latencies a pass waits; then time per token = (c + a L) x passes per
    token, the split speedup predicted from it against the measured."""
    fits = {}
    for m in methods:
        points = [
            (latency, r["seconds_per_pass"])
            for latency in latencies
            for r in rows
            if r["method"] == m and r["link"] == f"split, L = {latency:g} ms"
        ]
        n = len(points)
        mean_x, mean_y = sum(x for x, _ in points) / n, sum(y for _, y in points) / n
        var = sum((x - mean_x) ** 2 for x, _ in points)
        slope = sum((x - mean_x) * (y - mean_y) for x, y in points) / var if var else 0.0
        fits[m] = dict(c_ms=1e3 * (mean_y - slope * mean_x), latencies_per_pass=slope * 1e3)
    return fits


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--role", choices=["driver", "alone", "rank"], default="driver")
    parser.add_argument("--model", default=None, help="(workers) the qwen2-form model")
    parser.add_argument("--methods", default=",".join(METHODS))
    parser.add_argument("--prompts", default=str(HERE / "heldout_prompts.jsonl"))
    parser.add_argument("--limit", type=int, default=4, help="the first N prompts")
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--latencies", default="0,0.1,1,5", help="one-way, ms (0: no relay)")
    parser.add_argument("--work", default=str(ROOT / "work" / "split-links"))
    parser.add_argument("--out", default=None, help="a directory for results.json and summary.md")
    parser.add_argument("--result", default=None, help="(workers) where to write")
    parser.add_argument("--check-against", default=None, help="(alone) the llama form, for the check")
    args = parser.parse_args()
    if args.role == "alone":
        return alone(args)
    if args.role == "rank":
        return rank(args)

    work = Path(args.work)
    work.mkdir(parents=True, exist_ok=True)
    llama = Path(model_path(None))
    args.model = str(qwen2_form(llama, work / "model-qwen2"))
    qwen2_form(SHIPPED_DRAFTERS / "mtp", work / "mtp-qwen2")
    methods = args.methods.split(",")
    latencies = [float(x) for x in args.latencies.split(",")]
    print("one process (core 0) ...", file=sys.stderr, flush=True)
    result = work / "alone.json"
    subprocess.run(
        ["taskset", "-c", "0", *worker("alone", args, result, ["--check-against", str(llama)])],
        env=environment(),
        cwd=ROOT,
        check=True,
    )
    alone_records = json.loads(result.read_text())
    check = next(r for r in alone_records if r.get("method") == "llama-form check")
    # The relay's own cost: a ping-pong through it with no delay, against the direct one.
    print("relay at L = 0 (its own cost) ...", file=sys.stderr, flush=True)
    relay_zero = run_split(
        argparse.Namespace(**{**vars(args), "methods": "none", "repeats": 1, "limit": 1}),
        0.0,
        work,
        relay=True,
    )
    split_runs = []
    for latency in latencies:
        print(f"split, L = {latency:g} ms ...", file=sys.stderr, flush=True)
        split_runs.append((latency, run_split(args, latency, work, relay=latency > 0)))
    rows = summarize(alone_records, split_runs, methods)
    fits = cost_model(rows, latencies, methods)
    trips = {f"L = {latency:g} ms": run["pingpong"] for latency, run in split_runs}
    trips["relay, L = 0"] = relay_zero["pingpong"]
    lines = [
        f"llama form and qwen2 form give the same tokens: {check['identical']}",
        "",
        "round trip of [1, n, 576] float32 between the ranks (median of 40), ms:",
        *(
            f"  {name}: " + ", ".join(f"n={n} {1e3 * s:.3f}" for n, s in t.items())
            for name, t in trips.items()
        ),
        "",
        f"{'link':>18} {'method':>7} {'tok/s':>7} {'speedup':>7} {'passes/tok':>10} {'drafts/step':>11} "
        f"{'ms/pass':>7} {'link ms/pass':>12} identical",
    ]
    for r in rows:
        link = f"{r['link_ms_per_pass']:12.2f}" if "link_ms_per_pass" in r else f"{'':>12}"
        lines.append(
            f"{r['link']:>18} {r['method']:>7} {r['tps']:7.1f} {r['speedup']:6.2f}x {r['passes_per_token']:10.2f} "
            f"{r['drafts_per_step']:11.2f} {1e3 * r['seconds_per_pass']:7.2f} {link} {r['identical']}"
        )
    lines += ["", "cost model, seconds per pass = c + a x L (fit over the split rows):"]
    lines += [
        f"  {m}: c = {f['c_ms']:.2f} ms, a = {f['latencies_per_pass']:.2f} one-way latencies"
        for m, f in fits.items()
    ]
    print("\n".join(lines))
    if args.out:
        out = Path(args.out)
        out.mkdir(parents=True, exist_ok=True)
        (out / "summary.md").write_text("```\n" + "\n".join(lines) + "\n```\n")
        (out / "results.json").write_text(
            json.dumps(
                dict(
                    args=vars(args),
                    rows=rows,
                    cost_model=fits,
                    pingpong=trips,
                    llama_form_identical=check["identical"],
                    alone=alone_records,
                    split={str(latency): run for latency, run in split_runs},
                ),
                indent=1,
            )
        )


if __name__ == "__main__":
    main()
