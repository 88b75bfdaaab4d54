"""Timing harness: draft methods side by side with plain `mlx_lm.stream_generate`.

Each method's generation runs interleaved with a baseline generation of the same prompt on the
same loaded weights: the two advance in turns of about TURN_SECONDS each (whole steps), so
that the machine's drift, which here moved one generation's time by 5-6% against a baseline run
a few generations away, hits both alike (paired in turns: 2.1% for the engine without a
drafter against mlx-lm). Each one's time is the sum of its turns, prefill included (the same
work for all); the work mlx-lm computes one step ahead is waited for at the end of its turn and
counted as its own, and within a turn it keeps that pipelining (on Metal a turn's end costs it
one step's graph building; on the CPU backend async_eval computes most of a step before it
returns, so little). Speedup = a method's tok/s / its baseline's tok/s on the same prompts.

At temperature > 0 the baseline draws each token by the engine's seeded rule (sampling.Sampler:
argmax(log p + Gumbel noise keyed by (seed, position)), the distribution mlx-lm's own sampler
draws from) through mlx-lm's `sampler` argument, so that both write the same text: the timings
then compare the same work (mlx-lm's categorical would write other texts, of other lengths).
Every output is also compared with the baseline's (lossless check), at any temperature unless
the residual rule is used (its tokens depend on the drafts)."""

import json
import os
import platform
import statistics
import time
from collections import Counter
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Callable, Dict, List, Optional

import mlx.core as mx

from .distributed import PLAIN
from .engine import GenerationOptions
from .errors import MlxSpecError
from .events import Collector, Failed, Step, Text, Token
from .sampling import Sampler


@dataclass
class Record:
    method: str
    category: str
    question_id: str
    turn: int
    repeat: int
    generated_tokens: int
    seconds: float
    steps: int = 0
    plain_steps: int = 0  # steps that verified no draft
    verified_drafts: int = 0
    accepted_drafts: int = 0
    baseline_tokens: int = 0
    baseline_seconds: float = 0.0
    identical: Optional[bool] = None  # token-identical to the baseline (None: not comparable)
    first_difference: Optional[int] = None
    tokens_per_step_histogram: Dict[int, int] = field(default_factory=dict)

    @property
    def tokens_per_second(self):
        return self.generated_tokens / self.seconds if self.seconds else 0.0


def load_prompts(path=None, categories=()) -> List[dict]:
    """Items {"question_id", "category", "turns": [...]} from JSONL ({"prompt": ...} or the
    multi-turn layout), or the built-in suite."""
    if path is None:
        from .bench_suite import SUITE

        rows = SUITE
    else:
        try:
            lines = Path(path).read_text().splitlines()
        except OSError as e:
            raise MlxSpecError(f"cannot read prompts {path}: {e.strerror}") from None
        rows = []
        for number, line in enumerate(lines, start=1):
            if not line.strip():
                continue
            try:
                rows.append((f"{path} line {number}", json.loads(line)))
            except json.JSONDecodeError as e:
                raise MlxSpecError(f"{path} line {number} is not JSON: {e.msg} (column {e.colno})") from None
        if not rows:
            raise MlxSpecError(f"{path} holds no prompt")
    if path is None:
        rows = [(f"prompt {i + 1}", row) for i, row in enumerate(rows)]
    items = []
    for i, (where, row) in enumerate(rows):
        if not isinstance(row, dict):
            raise MlxSpecError(f"{where}: expected an object with 'prompt' or 'turns'")
        turns = row.get("turns") if "turns" in row else ([row["prompt"]] if "prompt" in row else None)
        if not turns:
            raise MlxSpecError(f"{where} has neither 'prompt' nor 'turns'")
        if not isinstance(turns, list) or not all(isinstance(t, str) and t for t in turns):
            raise MlxSpecError(f"{where}: 'prompt' must be a string and 'turns' a list of strings")
        items.append(
            {
                "question_id": str(row.get("question_id", i + 1)),
                "category": str(row.get("category", "default")),
                "turns": list(turns),
            }
        )
    if categories:
        items = [item for item in items if item["category"] in categories]
        if not items:
            raise MlxSpecError(f"no prompt in categories {', '.join(categories)}")
    return items


def _first_difference(a, b) -> Optional[int]:
    for i, (x, y) in enumerate(zip(a, b)):
        if x != y:
            return i
    return None if len(a) == len(b) else min(len(a), len(b))


def seeded_sampler(rule: Sampler, first_position: int):
    """mlx-lm's sampler interface (log-probabilities [1, V] -> token [1]) drawing by the seeded
    rule, the first call at absolute position first_position."""
    position = first_position - 1

    def sample(logprobs):
        nonlocal position
        position += 1
        return rule.choose(logprobs, [position])

    return sample


TURN_SECONDS = 0.5  # a turn of one of two interleaved generations: short against the drift,
# long against what a turn's end costs mlx-lm (one step not overlapped)


def baseline_sampler(sampling, seed: int, residual: bool = False):
    """What the baseline draws with: the engines' seeded rule where outputs are compared (so
    that both write the same text), else mlx-lm's own sampler."""
    from mlx_lm.sample_utils import make_sampler

    if sampling.greedy or residual:
        return make_sampler(sampling.temp, sampling.top_p, sampling.min_p, top_k=sampling.top_k)
    return Sampler(sampling, seed)


def baseline_steps(
    target,
    prompt_tokens,
    max_tokens,
    sampler,
    collected: Collector,
    cache_flags: Optional[dict] = None,
    channel=None,
):
    """Plain mlx-lm on the same weights, one step per iteration, its tokens and text collected.
    sampler: mlx-lm's, or a Sampler whose seeded rule is drawn with (seeded_sampler);
    cache_flags: stream_generate's kv_bits, kv_group_size, quantized_kv_start; channel: a split
    target's (rank 0), whose other ranks are ordered to run the same (follow_baseline)."""
    from mlx_lm import stream_generate
    from mlx_lm.generate import generation_stream

    if channel is not None:
        channel.send(PLAIN, [max_tokens, *prompt_tokens])
    if isinstance(sampler, Sampler):
        sampler = seeded_sampler(sampler, len(prompt_tokens))
    eos = set(target.eos_token_ids)
    for response in stream_generate(
        target.model,
        target.tokenizer,
        prompt_tokens,
        max_tokens=max_tokens,
        sampler=sampler,
        **(cache_flags or {}),
    ):
        collected.add(Text(response.text) if response.token in eos else Token(response.token, response.text))
        yield
    mx.synchronize(generation_stream)  # the step computed ahead: its time (and collectives) end here


def follow_baseline(target, sampler, cache_flags: Optional[dict] = None) -> Callable[[List[int]], None]:
    """Another rank's side of baseline_steps over a split target (Follower.follow's plain)."""

    def run(order: List[int]) -> None:
        for _ in baseline_steps(target, order[1:], order[0], sampler, Collector(), cache_flags):
            pass

    return run


def method_steps(engine, prompt_tokens, max_tokens, collected: Collector, options=GenerationOptions()):
    """One engine generation on a fresh cache, as the baseline has, one verification step per
    iteration, collected (options: the generation's, as Engine.generate takes them)."""
    engine.reset()
    for event in engine.generate(prompt_tokens, max_tokens=max_tokens, options=options):
        if isinstance(collected.add(event), Step):
            yield


def _record(
    method, item, turn, repeat, run: Collector, seconds, base_tokens, base_seconds, compared
) -> Record:
    """One generation's record beside the baseline's; compared: whether its tokens must equal
    the baseline's (greedy, or seeded sampling)."""
    stats, diff = run.stats, _first_difference(run.tokens, base_tokens)
    return Record(
        method=method,
        category=item["category"],
        question_id=item["question_id"],
        turn=turn,
        repeat=repeat,
        generated_tokens=len(run.tokens),
        seconds=seconds,
        steps=stats.steps,
        plain_steps=stats.plain_steps,
        verified_drafts=stats.verified_drafts,
        accepted_drafts=stats.accepted_drafts,
        baseline_tokens=len(base_tokens),
        baseline_seconds=base_seconds,
        identical=(diff is None) if compared else None,
        first_difference=diff if compared else None,
        tokens_per_step_histogram=run.sorted_histogram(),
    )


def timed_in_turns(runs, turn_seconds=TURN_SECONDS) -> List[float]:
    """Advance the step iterators `runs` in turns of ~turn_seconds each until all are done; the
    seconds each one took, its turns summed. Work a run left in flight (mlx-lm evaluates the
    next step asynchronously) is waited for inside its own turn."""
    seconds = [0.0] * len(runs)
    live = list(range(len(runs)))
    while live:
        for i in list(live):
            tic = time.perf_counter()
            try:
                while time.perf_counter() - tic < turn_seconds:
                    next(runs[i])
            except StopIteration:
                live.remove(i)
            mx.synchronize()
            seconds[i] += time.perf_counter() - tic
    return seconds


def timed_in_sequence(runs) -> List[float]:
    """The step iterators `runs` one after the other (a split target's ranks run one generation
    at a time): the seconds each one took."""
    seconds = []
    for run in runs:
        tic = time.perf_counter()
        for _ in run:
            pass
        mx.synchronize()
        seconds.append(time.perf_counter() - tic)
    return seconds


def run_bench(
    target,
    engines: Dict[str, object],
    items,
    max_tokens,
    repeats,
    sampling,
    seed=0,
    progress=None,
    residual=False,
    cache_flags: Optional[dict] = None,
    channel=None,
) -> List[Record]:
    """Every turn of every item, `repeats` times: each method interleaved with a baseline run
    (with mlx-lm's cache_flags, as the engines have them). channel: a split target's (rank 0;
    the engines are its split engines): every rank runs the baseline too, and the two runs of a
    pair go one after the other, not in turns."""
    compared = sampling.greedy or not residual  # outputs that must equal the baseline's
    sampler = baseline_sampler(sampling, seed, residual)
    timed = timed_in_turns if channel is None else timed_in_sequence
    tokenizer = target.tokenizer
    warmup = tokenizer.apply_chat_template([{"role": "user", "content": "Hello"}], add_generation_prompt=True)
    timed(
        [
            baseline_steps(target, warmup, 8, sampler, Collector(), cache_flags, channel),
            *(method_steps(engine, warmup, 8, Collector()) for engine in engines.values()),
        ]
    )
    mx.random.seed(seed)

    records = []
    for item in items:
        for repeat in range(repeats):
            histories = {name: [] for name in ["baseline", *engines]}
            for turn, user in enumerate(item["turns"]):

                def prompt_of(name):
                    histories[name].append({"role": "user", "content": user})
                    return tokenizer.apply_chat_template(histories[name], add_generation_prompt=True)

                base_prompt = prompt_of("baseline")
                for name, engine in engines.items():
                    base, run = Collector(), Collector()
                    runs = [
                        baseline_steps(target, base_prompt, max_tokens, sampler, base, cache_flags, channel),
                        method_steps(engine, prompt_of(name), max_tokens, run),
                    ]
                    # Who starts alternates (one record per pair): neither always gets the
                    # first turn's machine state.
                    order = [0, 1] if len(records) % 2 == 0 else [1, 0]
                    seconds_in_order = timed([runs[i] for i in order])
                    base_seconds, seconds = (
                        seconds_in_order[order.index(0)],
                        seconds_in_order[order.index(1)],
                    )
                    histories[name].append({"role": "assistant", "content": run.text})
                    records.append(
                        _record(name, item, turn, repeat, run, seconds, base.tokens, base_seconds, compared)
                    )
                    if progress is not None:
                        progress(1)
                # The next turn follows the baseline's answer (the same text in every pair
                # where outputs are compared).
                histories["baseline"].append({"role": "assistant", "content": base.text})
    return records


def run_concurrent(
    target,
    engines: Dict[str, object],
    items,
    max_tokens,
    repeats,
    sampling,
    seed=0,
    concurrency=4,
    progress=None,
) -> List[Record]:
    """--concurrency N: every item's first turn, N generated at once: each method's BatchEngine
    (continuous batching: a prompt joins as another finishes) against mlx-lm's own batched
    generation (BatchGenerator, N rows) over the same prompts, in turns whose order alternates
    per repeat. One record per prompt and method, category "all": its seconds are the batch's
    wall time shared in proportion to tokens, so that a repeat's tok/s is the aggregate
    throughput. Outputs are compared with mlx-lm's where greedy (its batched sampling is not
    seeded per row)."""
    from mlx_lm.generate import BatchGenerator
    from mlx_lm.sample_utils import make_sampler

    from .batch import BatchEngine

    tokenizer = target.tokenizer
    prompts = [
        tokenizer.apply_chat_template(
            [{"role": "user", "content": item["turns"][0]}], add_generation_prompt=True
        )
        for item in items
    ]
    batches = {name: BatchEngine.spawned(engine, concurrency) for name, engine in engines.items()}

    def baseline(prompts=prompts, max_tokens=max_tokens):
        generator = BatchGenerator(
            target.model,
            max_tokens=max_tokens,
            stop_tokens=[[t] for t in target.eos_token_ids],
            sampler=None
            if sampling.greedy
            else make_sampler(sampling.temp, sampling.top_p, sampling.min_p, top_k=sampling.top_k),
            completion_batch_size=concurrency,
            prefill_batch_size=concurrency,
        )
        uids = generator.insert(prompts, [max_tokens] * len(prompts))
        tokens = {uid: [] for uid in uids}
        while responses := generator.next_generated():
            for r in responses:
                if r.finish_reason != "stop":  # "stop": the EOS token, not output
                    tokens[r.uid].append(r.token)
        generator.close()
        return [tokens[uid] for uid in uids]

    def method(batch):
        for engine in batch.engines:  # fresh caches, as the baseline's
            engine.reset()
        collected = [Collector() for _ in prompts]
        requests = [
            dict(prompt=prompt, max_tokens=max_tokens, seed=seed + i) for i, prompt in enumerate(prompts)
        ]
        for i, event in batch.generate_all(requests):
            if isinstance(collected[i].add(event), Failed):
                raise event.error
        return collected

    def timed(run):
        tic = time.perf_counter()
        results = run()
        mx.synchronize()
        return results, time.perf_counter() - tic

    def share(tokens, seconds):
        total = sum(len(t) for t in tokens) or 1
        return [seconds * len(t) / total for t in tokens]

    baseline(prompts[:1], 8)  # warm-up on the first prompt: both paths build their graphs once
    for batch in batches.values():
        batch.add(prompts[0], max_tokens=8)
        while batch.rows:
            batch.step()
    records = []
    for repeat in range(repeats):
        for n, (name, batch) in enumerate(batches.items()):
            runs = [baseline, lambda: method(batch)]
            order = [0, 1] if (repeat + n) % 2 == 0 else [1, 0]
            timings = {i: timed(runs[i]) for i in order}
            (base, base_seconds), (results, seconds) = timings[0], timings[1]
            for item, result, spent, reference, base_spent in zip(
                items, results, share([r.tokens for r in results], seconds), base, share(base, base_seconds)
            ):
                records.append(
                    _record(
                        name,
                        dict(item, category="all"),
                        0,
                        repeat,
                        result,
                        spent,
                        reference,
                        base_spent,
                        compared=sampling.greedy,
                    )
                )
            if progress is not None:
                progress(len(items))
    return records


def summarize(records: List[Record]) -> List[dict]:
    """One row per (method, category) and per method overall ("all", where it has several
    categories), in the order the methods came; tok/s and speedup are medians over repeats."""
    groups: Dict[tuple, List[Record]] = {}
    for r in records:
        groups.setdefault((r.method, r.category), []).append(r)
    categories = {method: {c for m, c in groups if m == method} for method, _ in groups}
    for r in records:
        if len(categories[r.method]) > 1:  # one category: its row is the whole
            groups.setdefault((r.method, "all"), []).append(r)
    rows = []
    for (method, category), rs in groups.items():
        # One aggregate tok/s per repeat (a pass over the category's prompts), then the median
        # over repeats: drift and outliers hit a median less than a mean.
        repeats = sorted({r.repeat for r in rs})
        per_repeat = []
        for repeat in repeats:
            run = [r for r in rs if r.repeat == repeat]
            tps = sum(r.generated_tokens for r in run) / sum(r.seconds for r in run)
            base = sum(r.baseline_tokens for r in run) / sum(r.baseline_seconds for r in run)
            per_repeat.append((tps, base, tps / base))
        tokens = sum(r.generated_tokens for r in rs)
        steps = sum(r.steps for r in rs)
        committed = sum(k * v for r in rs for k, v in r.tokens_per_step_histogram.items())
        verified = sum(r.verified_drafts for r in rs)
        histogram = Counter()
        for r in rs:
            histogram.update(r.tokens_per_step_histogram)
        checked = [r for r in rs if r.identical is not None]
        rows.append(
            dict(
                method=method,
                category=category,
                runs=len(rs),
                repeats=len(repeats),
                tokens=tokens,
                tokens_per_second=statistics.median(t for t, _, _ in per_repeat),
                baseline_tokens_per_second=statistics.median(b for _, b, _ in per_repeat),
                speedup=statistics.median(x for _, _, x in per_repeat),
                speedup_per_repeat=[x for _, _, x in per_repeat],
                tokens_per_step=committed / steps if steps else 0.0,
                verified_drafts_per_step=verified / steps if steps else 0.0,
                plain_steps=sum(r.plain_steps for r in rs),
                plain_step_share=sum(r.plain_steps for r in rs) / steps if steps else 0.0,
                acceptance_rate=sum(r.accepted_drafts for r in rs) / verified
                if verified
                else None,  # no drafts: n/a
                identical=f"{sum(r.identical for r in checked)}/{len(checked)}" if checked else "n/a",
                first_differences=[r.first_difference for r in checked if not r.identical],
                tokens_per_step_histogram=dict(sorted(histogram.items())),
            )
        )
    order = list(dict.fromkeys(r.method for r in records))  # as --methods gave them
    rows.sort(key=lambda row: (order.index(row["method"]), row["category"] == "all", row["category"]))
    return rows


COLUMNS = [
    ("method", "{}"),
    ("category", "{}"),
    ("tokens_per_second", "{:.1f}"),
    ("baseline_tokens_per_second", "{:.1f}"),
    ("speedup", "{:.2f}x"),
    ("tokens_per_step", "{:.2f}"),
    ("acceptance_rate", "{:.0%}"),
    ("verified_drafts_per_step", "{:.2f}"),
    ("plain_step_share", "{:.0%}"),
    ("identical", "{}"),
]
HEADERS = [
    "method",
    "category",
    "tok/s",
    "mlx-lm tok/s",
    "speedup",
    "tau",
    "acceptance",
    "drafts/step",
    "plain steps",
    "identical",
]


def _cells(rows):
    return [["n/a" if row[key] is None else fmt.format(row[key]) for key, fmt in COLUMNS] for row in rows]


def overall_rows(rows) -> list:
    """Each method's row over all its prompts: its "all" row, or its one category's row (a
    method run on one category has no "all" row: that row is the whole)."""
    methods = {row["method"] for row in rows if row["category"] == "all"}
    return [row for row in rows if row["category"] == "all" or row["method"] not in methods]


def render_histograms(rows) -> str:
    return "tokens committed per step (histogram): " + "; ".join(
        f"{row['method']}: {row['tokens_per_step_histogram']}" for row in overall_rows(rows)
    )


def render_table(rows) -> str:
    cells = [HEADERS] + _cells(rows)
    widths = [max(len(r[i]) for r in cells) for i in range(len(HEADERS))]
    lines = ["  ".join(c.ljust(w) for c, w in zip(r, widths)) for r in cells]
    lines.insert(1, "  ".join("-" * w for w in widths))
    return "\n".join(lines + ["", render_histograms(rows)])


def render_markdown(rows, meta) -> str:
    lines = ["| " + " | ".join(HEADERS) + " |", "|" + "---|" * len(HEADERS)]
    lines += ["| " + " | ".join(r) + " |" for r in _cells(rows)]
    lines += ["", render_histograms(rows)]
    lines += ["", "; ".join(f"{k}: {v}" for k, v in meta.items())]
    return "\n".join(lines) + "\n"


def plot(rows, path) -> None:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        raise MlxSpecError("--plot needs matplotlib: pip install 'mlx-spec[plot]'") from None
    overall = overall_rows(rows)
    fig, (left, right) = plt.subplots(1, 2, figsize=(11, 4))
    categories = sorted({row["category"] for row in rows if row["category"] != "all"})
    methods = [row["method"] for row in overall]
    width = 0.8 / max(1, len(methods))
    for i, method in enumerate(methods):
        by_category = {row["category"]: row["speedup"] for row in rows if row["method"] == method}
        left.bar(
            [c + i * width for c in range(len(categories))],
            [by_category.get(c, 0) for c in categories],
            width,
            label=method,
        )
    left.axhline(1.0, color="gray", linewidth=0.8)
    left.set_xticks([c + width * (len(methods) - 1) / 2 for c in range(len(categories))], categories)
    left.set_ylabel("speedup vs plain mlx-lm")
    left.legend()
    for row in overall:
        hist = row["tokens_per_step_histogram"]
        total = sum(hist.values()) or 1
        right.plot(list(hist), [v / total for v in hist.values()], marker="o", label=row["method"])
    right.set_xlabel("tokens committed per step")
    right.set_ylabel("fraction of steps")
    right.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def machine_info(target, drafter_paths) -> dict:
    import importlib.metadata as md

    return {
        "machine": f"{platform.system()} {platform.machine()} ({platform.processor() or 'cpu'}), "
        f"{os.cpu_count()} cores",
        "mlx": md.version("mlx"),
        "mlx-lm": md.version("mlx-lm"),
        "device": str(mx.default_device()),
        "dtype": target.dtype,
        "model": target.path,
        "drafters": drafter_paths,
    }


def write_json(path, meta, rows, records) -> None:
    Path(path).write_text(
        json.dumps({"meta": meta, "summary": rows, "records": [asdict(r) for r in records]}, indent=1)
    )
