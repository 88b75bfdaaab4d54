"""Load on OpenAI-compatible servers: `mlx-spec serve --draft X` against mlx_lm.server on the
same weights, at several numbers of concurrent clients.

Each held-out prompt (its `prompt`, or the first of its `turns`, as one user message) goes as a
streamed POST /v1/chat/completions (stream_options.include_usage; a `seed` per prompt when
--temperature > 0). N client threads take prompts from a shared list until every prompt has
gone once per level (--repeats times). Per request: time to the first non-empty content delta
(TTFT), completion tokens (the usage chunk; delta count where a server sends none), total time,
text. Per config and level: median TTFT, median decode tok/s (completion tokens / (total - TTFT),
so queueing shows in TTFT, not here), aggregate tok/s (all completion tokens / the level's wall
time), and how many outputs equal the config's own concurrency-1 output and mlx_lm.server's
concurrency-1 output for the same prompt (greedy text should match across servers: counted).

Fairness:
- one server runs at a time (start, warm up with one short request, all levels, SIGTERM), so
  they never share the CPU cores;
- both serve one float32 directory (default_model_path(dtype="float32")): mlx-spec runs the
  target in float32 on the CPU anyway (--dtype auto dequantizes the 4-bit default);
- mlx_lm.server starts through `import mlx_spec` first, which loads OpenBLAS before mlx.core
  (a plain `python -m mlx_lm.server` keeps MLX's reference BLAS, several times slower);
- mlx_lm.server's batching (--decode-concurrency, --prompt-concurrency) is left at its
  defaults; it batches only requests without a `seed`, so at --temperature > 0 it is sent none
  (--seed-mlx-lm sends them: it then serves one at a time). A config `METHOD` is `mlx-spec serve
  --draft METHOD` at its default --max-batch; `METHOD/N` passes --max-batch N (`/1`: one request
  at a time, as before batching);
- both keep prompt caches at their defaults: a prompt repeated at a later level may find its
  prefix cached (usage.prompt_tokens_details.cached_tokens, summed in --json); --cold starts a
  fresh server for each level, so that levels compare batching alone.

    .venv/bin/python benchmarks/serve_load.py --concurrency 1,2,4,8 --max-tokens 64 [--json out.json]
    .venv/bin/python benchmarks/serve_load.py --concurrency 1,2 --max-tokens 8 --limit 2 --configs mlx_lm,lookup

A config ending in +logprobs (lookup+logprobs) sends logprobs: true, top_logprobs: 5 with every
request: what asking for them costs.
"""

import argparse
import http.client
import json
import os
import queue
import re
import signal
import socket
import statistics
import subprocess
import sys
import threading
import time
from collections import deque
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PROMPTS = Path(__file__).resolve().parent / "heldout_prompts.jsonl"
MLX_SPEC = Path(sys.executable).with_name("mlx-spec")  # the venv's console script
READY = re.compile(r"mlx-spec serve: .* on http://127\.0\.0\.1:(\d+)/v1")
# mlx_lm.server behind `import mlx_spec` (OpenBLAS first); its arguments follow in sys.argv.
MLX_LM = "import mlx_spec, sys; sys.argv = ['mlx_lm.server', *sys.argv[1:]]; from mlx_lm.server import main; main()"


def load_prompts(limit):
    """[(prompt, category)] of the first `limit` held-out prompts."""
    rows = [json.loads(line) for line in PROMPTS.read_text().splitlines() if line.strip()]
    return [(row["prompt"] if "prompt" in row else row["turns"][0], row["category"]) for row in rows][:limit]


def free_port():
    with socket.socket() as s:  # bound then closed: the port is free a moment later
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class ServerProcess:
    """A server in a session of its own (a Ctrl-C here does not reach it: stop() does), its
    output drained on a thread (a full pipe would block it), the last lines kept for errors."""

    def __init__(self, name, argv, port=None):
        self.name, self.port = name, port
        self.lines = deque(maxlen=30)
        self.ready_line = threading.Event()
        self.proc = subprocess.Popen(
            argv,
            cwd=ROOT,
            stdin=subprocess.DEVNULL,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
            errors="replace",
            start_new_session=True,
        )
        threading.Thread(target=self._drain, daemon=True).start()

    def _drain(self):
        for line in self.proc.stdout:
            self.lines.append(line.rstrip())
            match = READY.search(line)
            if match and self.port is None:
                self.port = int(match.group(1))
                self.ready_line.set()
        self.ready_line.set()  # exited

    def fail(self, why):
        tail = "\n  ".join(self.lines)
        raise RuntimeError(f"{self.name}: {why}; its last output:\n  {tail}")

    def wait_ready(self, timeout):
        """Until GET /health answers 200 (mlx-spec: once it has printed its port)."""
        deadline = time.monotonic() + timeout
        if self.port is None:  # mlx-spec: --port 0, the port comes in its ready line
            self.ready_line.wait(timeout)
            if self.port is None:
                self.fail(
                    f"no ready line within {timeout} s"
                    if self.proc.poll() is None
                    else f"exited with status {self.proc.returncode}"
                )
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                self.fail(f"exited with status {self.proc.returncode}")
            try:
                if self.port is not None and get_json(self.port, "/health", 5)[0] == 200:
                    return
            except OSError:  # not listening yet
                pass
            time.sleep(0.5)
        self.fail(f"/health not up within {timeout} s")

    def stop(self, timeout=30):
        if self.proc.poll() is None:
            self.proc.terminate()  # both stop on SIGTERM
            try:
                self.proc.wait(timeout)
                return
            except subprocess.TimeoutExpired:
                print(f"{self.name}: still running {timeout} s after SIGTERM: killed", file=sys.stderr)
        try:
            os.killpg(self.proc.pid, signal.SIGKILL)  # the whole session: nothing left behind
        except ProcessLookupError:
            pass
        self.proc.wait(10)


LOGPROBS = "+logprobs"  # a config's requests ask for logprobs (and 5 alternatives)


def mlx_lm_server(model_dir, *options) -> ServerProcess:
    """mlx_lm.server on loopback (behind OpenBLAS), on a free port."""
    port = free_port()
    argv = [
        sys.executable,
        "-c",
        MLX_LM,
        "--model",
        str(model_dir),
        "--host",
        "127.0.0.1",
        "--port",
        str(port),
    ]
    return ServerProcess("mlx_lm.server", argv + list(options), port)


def mlx_spec_server(model_dir, draft, *options, name=None) -> ServerProcess:
    """`mlx-spec serve --draft draft` on loopback, on the port it picks (its ready line says it)."""
    argv = [str(MLX_SPEC), "serve", "--host", "127.0.0.1", "--port", "0", "--model", str(model_dir)]
    return ServerProcess(name or f"mlx-spec serve --draft {draft}", argv + ["--draft", draft, *options])


def start_server(config, model_dir, args):
    config = config.removesuffix(LOGPROBS)
    if config == "mlx_lm":
        return mlx_lm_server(model_dir, "--max-tokens", str(args.max_tokens))
    method, _, max_batch = config.partition("/")
    # no prompt cache on disk: mlx_lm.server has none, and --cold means a server that holds nothing
    batch = ["--max-batch", max_batch] if max_batch else []
    return mlx_spec_server(
        model_dir,
        method,
        "--max-tokens",
        str(args.max_tokens),
        "--prompt-cache-dir",
        "off",
        *batch,
        name=f"mlx-spec serve --draft {method}" + (f" --max-batch {max_batch}" if max_batch else ""),
    )


def get_json(port, path, timeout):
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=timeout)
    try:
        conn.request("GET", path)
        response = conn.getresponse()
        body = response.read()
        try:
            return response.status, json.loads(body)
        except ValueError:
            return response.status, None
    finally:
        conn.close()


def served_model(port, model_dir):
    """The id to send as `model`: mlx-spec's one model; mlx_lm.server's id of the directory (it
    lists the Hugging Face cache too, and answers an empty body when there is none). None: omit
    the field (mlx_lm.server then uses the model it was started with)."""
    status, body = get_json(port, "/v1/models", 30)
    served = [m["id"] for m in (body or {}).get("data", [])] if status == 200 else []
    return str(model_dir) if str(model_dir) in served else (served[0] if len(served) == 1 else None)


def stream_chat(port, body, timeout):
    """One streamed chat completion, read line by line as the SSE events come."""
    result = dict(ttft=None, total=None, text="", tokens=0, deltas=0, usage=None, error=None)
    pieces = []
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=timeout)
    start = time.perf_counter()
    try:
        conn.request("POST", "/v1/chat/completions", json.dumps(body), {"Content-Type": "application/json"})
        response = conn.getresponse()
        if response.status != 200:
            result["error"] = f"HTTP {response.status}: {response.read(500).decode(errors='replace')}"
            return result
        done = False
        while not done:
            if time.perf_counter() - start > timeout:
                result["error"] = f"not done within {timeout} s"
                break
            line = response.readline()
            if not line:
                result["error"] = "the stream ended without data: [DONE]"
                break
            line = line.strip()
            if not line.startswith(b"data:"):
                continue  # blank separators, comments
            data = line[5:].strip()
            if data == b"[DONE]":
                done = True
                break
            event = json.loads(data)
            if "error" in event:
                result["error"] = f"mid-stream error: {event['error']}"
            for choice in event.get("choices") or []:
                content = (choice.get("delta") or {}).get("content")
                if content:
                    if result["ttft"] is None:
                        result["ttft"] = time.perf_counter() - start
                    pieces.append(content)
                    result["deltas"] += 1
            if event.get("usage"):
                result["usage"] = event["usage"]
    except (OSError, http.client.HTTPException, ValueError) as e:
        result["error"] = f"{type(e).__name__}: {e}"
    finally:
        conn.close()
        result["total"] = time.perf_counter() - start
    result["text"] = "".join(pieces)
    usage = result["usage"] or {}
    result["tokens"] = usage.get("completion_tokens", result["deltas"])
    return result


def request_body(model, prompt, index, args, max_tokens=None, seeded=True, extra=None):
    body = {
        "messages": [{"role": "user", "content": prompt}],
        "max_tokens": max_tokens or args.max_tokens,
        "temperature": args.temperature,
        "stream": True,
        "stream_options": {"include_usage": True},
        **(extra or {}),
    }
    if model is not None:
        body["model"] = model
    if args.temperature > 0 and seeded:
        body["seed"] = args.seed + index  # reproducible per prompt, different across prompts
    return body


def run_level(port, model, prompts, concurrency, args, seeded=True, extra=None):
    """(results in job order, wall seconds): each prompt --repeats times, N clients sharing the list."""
    jobs = [i for _ in range(args.repeats) for i in range(len(prompts))]
    todo = queue.Queue()
    for j in range(len(jobs)):
        todo.put(j)
    results = [None] * len(jobs)

    def client():
        while True:
            try:
                j = todo.get_nowait()
            except queue.Empty:
                return
            results[j] = stream_chat(
                port,
                request_body(model, prompts[jobs[j]], jobs[j], args, seeded=seeded, extra=extra),
                args.timeout,
            )

    threads = [threading.Thread(target=client, daemon=True) for _ in range(concurrency)]
    start = time.perf_counter()
    for t in threads:
        t.start()
    deadline = time.monotonic() + args.timeout * (-(-len(jobs) // concurrency) + 1)  # each request is bounded
    for t in threads:
        t.join(max(0.0, deadline - time.monotonic()))
    wall = time.perf_counter() - start
    missing = dict(
        ttft=None, total=None, text="", tokens=0, deltas=0, usage=None, error="client still waiting"
    )
    return [r or dict(missing) for r in results], wall, jobs


def run_config(config, model_dir, prompts, args):
    """One server, started and stopped here (with --cold, one per level):
    dict(model=the id sent, levels={concurrency: level})."""
    levels, model = {}, None
    groups = [[c] for c in args.concurrency] if args.cold else [args.concurrency]
    for group in groups:
        server = start_server(config, model_dir, args)
        try:
            server.wait_ready(args.start_timeout)
            model = served_model(server.port, model_dir)
            warm = stream_chat(
                server.port, request_body(model, "Hello!", 0, args, max_tokens=4), args.start_timeout
            )
            if warm["error"]:
                server.fail(f"warm-up failed: {warm['error']}")
            for concurrency in group:
                # mlx_lm.server batches only requests without a seed: at temperature > 0 it gets none
                # (its best throughput; its sampled texts are then not comparable), unless --seed-mlx-lm.
                seeded = config != "mlx_lm" or args.seed_mlx_lm
                extra = {"logprobs": True, "top_logprobs": 5} if config.endswith(LOGPROBS) else None
                results, wall, jobs = run_level(server.port, model, prompts, concurrency, args, seeded, extra)
                levels[concurrency] = dict(results=results, wall=wall, jobs=jobs)
                errors = [r["error"] for r in results if r["error"]]
                print(
                    f"{config} x{concurrency}: {len(results)} requests in {wall:.1f} s"
                    + (f", {len(errors)} failed (first: {errors[0]})" if errors else ""),
                    file=sys.stderr,
                )
        finally:
            server.stop()
    return dict(model=model, levels=levels)


def summarize(config, concurrency, level, own_c1, mlx_lm_c1):
    ok = [r for r in level["results"] if not r["error"]]
    ttfts = [r["ttft"] for r in ok if r["ttft"] is not None]  # None: an empty reply
    decode = [
        r["tokens"] / (r["total"] - r["ttft"]) for r in ok if r["ttft"] is not None and r["total"] > r["ttft"]
    ]

    def same(reference):
        if reference is None:
            return "n/a"
        pairs = [(r, reference[i]) for r, i in zip(level["results"], level["jobs"]) if i in reference]
        return f"{sum(not r['error'] and r['text'] == ref for r, ref in pairs)}/{len(pairs)}"

    return dict(
        config=config,
        concurrency=concurrency,
        requests=len(level["results"]),
        ok=len(ok),
        median_ttft_ms=1000 * statistics.median(ttfts) if ttfts else None,
        median_decode_tok_s=statistics.median(decode) if decode else None,
        aggregate_tok_s=sum(r["tokens"] for r in ok) / level["wall"],
        wall_s=level["wall"],
        same_as_own_c1=same(own_c1),
        same_as_mlx_lm_c1=same(mlx_lm_c1),
        cached_prompt_tokens=sum(
            ((r["usage"] or {}).get("prompt_tokens_details") or {}).get("cached_tokens", 0) for r in ok
        ),
        usage_missing=sum(r["usage"] is None for r in ok),
    )


def c1_texts(run):
    """prompt index -> text of the concurrency-1 level's first request for it (None: no such level)."""
    level = run["levels"].get("1") if run else None
    if level is None:
        return None
    texts = {}
    for r, i in zip(level["results"], level["jobs"]):
        if not r["error"] and i not in texts:
            texts[i] = r["text"]
    return texts


def category_rates(level, categories):
    """category -> completion tokens / request seconds (TTFT included) of its requests in one level."""
    tokens, seconds = {}, {}
    for r, i in zip(level["results"], level["jobs"]):
        if not r["error"] and r["total"]:
            tokens[categories[i]] = tokens.get(categories[i], 0) + r["tokens"]
            seconds[categories[i]] = seconds.get(categories[i], 0) + r["total"]
    return {c: tokens[c] / seconds[c] for c in tokens}


def interrupt(signum, frame):
    raise KeyboardInterrupt


def fmt(value, spec):
    return "-" if value is None else format(value, spec)


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--configs",
        default="mlx_lm,none,lookup,eagle,mtp,lookup/1,eagle/1",
        help="mlx_lm = mlx_lm.server; any other = mlx-spec serve --draft NAME",
    )
    parser.add_argument("--concurrency", default="1,2,4,8", help="client threads per level")
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--temperature", type=float, default=0.0)
    parser.add_argument("--seed", type=int, default=0, help="seed of the first prompt (temperature > 0)")
    parser.add_argument(
        "--seed-mlx-lm",
        action="store_true",
        help="send seeds to mlx_lm.server too (it then serves one request at a time)",
    )
    parser.add_argument("--limit", type=int, default=None, help="the first N held-out prompts")
    parser.add_argument("--repeats", type=int, default=1, help="times each prompt goes per level")
    parser.add_argument("--timeout", type=float, default=600, help="seconds one request may take")
    parser.add_argument(
        "--start-timeout", type=float, default=600, help="seconds a server may take to come up"
    )
    parser.add_argument(
        "--cold",
        action="store_true",
        help="a fresh server for each level: no prompt cached by an earlier level (batching alone)",
    )
    parser.add_argument("--json", default=None, help="write every request's result here")
    parser.add_argument(
        "--report",
        default=None,
        metavar="JSON",
        help="print the tables of an earlier run's --json file (runs nothing)",
    )
    args = parser.parse_args()
    if args.report:
        data = json.loads(Path(args.report).read_text())
        if "categories" not in data:  # files written before categories were stored
            by_prompt = dict(load_prompts(None))
            data["categories"] = [by_prompt.get(p) for p in data["prompts"]]
        report(data)
        return
    args.concurrency = [int(c) for c in args.concurrency.split(",")]
    configs = args.configs.split(",")
    signal.signal(signal.SIGTERM, interrupt)  # a SIGTERM here stops the servers too, as Ctrl-C does

    from mlx_spec.convert.default import default_model_path  # after argparse: --help stays quick

    model_dir = default_model_path(dtype="float32").resolve()
    prompts, categories = zip(*load_prompts(args.limit))
    runs = {}
    for config in configs:
        try:
            runs[config] = run_config(config, model_dir, prompts, args)
        except RuntimeError as e:  # a server that did not come up: report it, measure the others
            print(e, file=sys.stderr)

    data = dict(
        args=vars(args),
        model_dir=str(model_dir),
        prompts=prompts,
        categories=categories,
        summary=None,
        runs={
            config: dict(model=run["model"], levels={str(c): level for c, level in run["levels"].items()})
            for config, run in runs.items()
        },
    )
    data["summary"] = report(data)
    if args.json:
        Path(args.json).write_text(json.dumps(data, indent=1))


def report(data):
    """Print the tables of one run (as --json writes it) and return its summary rows."""
    args, runs = argparse.Namespace(**data["args"]), data["runs"]
    levels = [str(c) for c in args.concurrency]
    mlx_lm_c1 = c1_texts(runs.get("mlx_lm"))
    rows = [
        summarize(config, int(c), run["levels"][c], c1_texts(run), mlx_lm_c1)
        for config, run in runs.items()
        for c in levels
    ]
    print(
        f"{len(data['prompts'])} prompts x {args.repeats}, max_tokens {args.max_tokens}, temperature {args.temperature}; "
        f"weights {data['model_dir']}. mlx_lm = mlx_lm.server, batching at its defaults"
        f"{(' (off: requests carry a seed)' if args.seed_mlx_lm else ' (requests carry no seed)') if args.temperature > 0 else ''}"
        f"{'; a fresh server per level (--cold)' if args.cold else ''}"
        "; others = mlx-spec serve --draft X (batched, --max-batch at its default), X/N: --max-batch N "
        "(X/1: one request at a time). Decode tok/s = completion tokens / (total - TTFT), per request.\n"
    )
    print(
        "| config | clients | ok | median TTFT ms | median decode tok/s | aggregate tok/s | = own c1 | = mlx_lm c1 |"
    )
    print("|---|---|---|---|---|---|---|---|")
    for row in rows:
        print(
            f"| {row['config']} | {row['concurrency']} | {row['ok']}/{row['requests']} | "
            f"{fmt(row['median_ttft_ms'], '.0f')} | {fmt(row['median_decode_tok_s'], '.1f')} | "
            f"{row['aggregate_tok_s']:.1f} | {row['same_as_own_c1']} | {row['same_as_mlx_lm_c1']} |"
        )
    for row in rows:
        if row["usage_missing"]:
            print(
                f"\n{row['config']} x{row['concurrency']}: {row['usage_missing']} replies without usage "
                "(tokens counted as content deltas)"
            )
    categories = data.get("categories")
    if categories and "mlx_lm" in runs:
        # Where drafts are good shows per category: tokens per request-second against mlx_lm.server's
        # at the same level (requests overlap above one client, so these are rough there).
        names = sorted(set(categories))
        print("\nPer category, tokens per request-second / mlx_lm.server's at the same level:\n")
        print("| config | clients | " + " | ".join(names) + " |")
        print("|---|---|" + "---|" * len(names))
        for config, run in runs.items():
            if config == "mlx_lm":
                continue
            for c in levels:
                base, rates = (category_rates(r["levels"][c], categories) for r in (runs["mlx_lm"], run))
                print(
                    f"| {config} | {c} | "
                    + " | ".join(
                        fmt(rates[n] / base[n] if n in rates and n in base else None, ".2f") for n in names
                    )
                    + " |"
                )
    return rows


if __name__ == "__main__":
    try:
        main()
    except KeyboardInterrupt:  # the servers were stopped on the way out
        sys.exit("interrupted")
