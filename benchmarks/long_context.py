"""Speculation as the context grows (issue 64): each draft source's decode speed against plain
mlx-lm (`mlx_lm.stream_generate`, the same weights) at several prompt lengths, on real code as
the context: a Python file from an installed package (mlx_lm/generate.py, mlx_lm/server.py,
click/core.py), cut to the length, with two tasks each: a question about a function near the
file's start (an answer that reads far back) and a rewrite of a function near its end with a
docstring added (an answer that copies its context, where lookup and suffix decoding pay).

Decode is what is timed: a prompt's prefill costs the same with or without drafts (and minutes
on a CPU at 8k), so each prompt is prefilled once per cache (mlx-lm's, by its own model calls in
chunks of 2,048; the engines', by a generation of one token, shared as a Session by the engines
whose drafters read the same features) and every run starts from a copy (mlx-lm's cache trimmed
back to the prompt). A run's time splits at its first step (the prompt's last token and one
step); decode tok/s = tokens after the first step / the seconds after it. Speedup = method
decode tok/s / mlx-lm's over a repeat's prompts (tokens and seconds summed), median over
repeats; mlx-lm and the method run one after the other, who starts alternating. The prefill
seconds are reported once per prompt. Every output is compared with mlx-lm's (greedy:
token-identical).

    .venv/bin/python benchmarks/long_context.py --contexts 1024,4096,7680 --methods lookup,suffix,eagle \
        --repeats 3 --max-tokens 128 [--markdown out.md] [--json out.json] [--model DIR]

The embedded default model (SmolLM2-135M-Instruct) has a context of 8,192 tokens: 7,680 + 128
generated is its longest; 16k needs a model with a longer context (--model).
"""

import argparse
import importlib.util
import re
import statistics
import time
from pathlib import Path

import mlx_spec  # noqa: F401  (OpenBLAS before mlx.core)

# isort: split
import mlx.core as mx

from mlx_spec.bench import baseline_steps
from mlx_spec.convert.default import default_model_path
from mlx_spec.drafters import make_drafter
from mlx_spec.engine import PREFILL_CHUNK, Engine
from mlx_spec.events import Collector, Step
from mlx_spec.models.target import load_target
from report import write_results

SOURCES = ["mlx_lm.generate", "mlx_lm.server", "click.core"]
QUESTION = "What does the function `{name}` in this file do? Answer in a few sentences."
REWRITE = "Rewrite the function `{name}` in this file with a docstring added. Return only the function."


def source_text(module: str) -> str:
    return Path(importlib.util.find_spec(module).origin).read_text()


def prompt_of(tokenizer, code: str, task: str):
    message = f"Here is a Python file:\n```python\n{code}\n```\n{task}"
    return tokenizer.apply_chat_template([{"role": "user", "content": message}], add_generation_prompt=True)


def cut(tokenizer, text: str, context: int):
    """The file's longest run of first lines whose prompt (either task) fits `context` tokens,
    and the two functions asked about: one defined in its first quarter, one in its last."""
    lines = text.splitlines()
    low, high = 1, len(lines)
    while low < high:  # the most lines that fit
        middle = (low + high + 1) // 2
        code = "\n".join(lines[:middle])
        if len(prompt_of(tokenizer, code, REWRITE.format(name="x" * 24))) <= context:
            low = middle
        else:
            high = middle - 1
    code = "\n".join(lines[:low])
    names = [(m.start(), m.group(1)) for m in re.finditer(r"^\s*def (\w+)\(", code, re.M)]
    early = [name for start, name in names if start < len(code) / 4] or [names[0][1]]
    late = [name for start, name in names if start > len(code) * 3 / 4] or [names[-1][1]]
    return code, early[0], late[-1]


def prefilled_mlx_lm(target, prompt):
    """mlx-lm's cache holding prompt[:-1], filled as stream_generate fills it; and the seconds."""
    from mlx_lm.models.cache import make_prompt_cache

    cache = make_prompt_cache(target.model)
    tic = time.perf_counter()
    for start in range(0, len(prompt) - 1, PREFILL_CHUNK):
        target.model(mx.array(prompt[start : min(start + PREFILL_CHUNK, len(prompt) - 1)])[None], cache=cache)
        mx.eval([c.state for c in cache])
    return cache, time.perf_counter() - tic


def mlx_lm_steps(target, prompt, cache, max_tokens, collected: Collector):
    """baseline_steps from the prefilled cache (the prompt's last token fed), which is trimmed
    back to the prompt after."""
    from mlx_lm.models.cache import trim_prompt_cache

    held = cache[0].offset
    try:
        yield from baseline_steps(target, prompt[-1:], max_tokens, None, collected, {"prompt_cache": cache})
    finally:
        trim_prompt_cache(cache, cache[0].offset - held)


def engine_steps(engine, prompt, session, max_tokens, collected: Collector):
    """An engine's generation from a copy of the prompt's session, a yield per step."""
    engine.attach(session.copy())
    for event in engine.generate(prompt, max_tokens=max_tokens):
        if isinstance(collected.add(event), Step):
            yield


def timed(steps, collected: Collector):
    """(seconds to the first step, tokens it committed, total seconds) of a step iterator."""
    tic = time.perf_counter()
    next(steps)
    mx.synchronize()
    first, first_tokens = time.perf_counter() - tic, len(collected.tokens)
    for _ in steps:
        pass
    mx.synchronize()
    return first, first_tokens, time.perf_counter() - tic


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--contexts", default="1024,4096,7680")
    parser.add_argument("--methods", default="lookup,suffix,eagle")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--max-tokens", type=int, default=128)
    parser.add_argument("--sources", default=",".join(SOURCES))
    parser.add_argument("--model", default=None)
    parser.add_argument("--markdown", default=None)
    parser.add_argument("--json", default=None)
    args = parser.parse_args()
    target = load_target(args.model or default_model_path(), "float32")
    tokenizer = target.tokenizer
    methods = args.methods.split(",")
    engines = {
        name: Engine(
            target,
            make_drafter(name, target, {"suffix_memory": "off"} if "suffix" in name else {}),
            sessions=True,
        )
        for name in methods
    }
    records, prefills, order = [], [], 0
    for context in [int(c) for c in args.contexts.split(",")]:
        prompts = []
        for module in args.sources.split(","):
            code, early, late = cut(tokenizer, source_text(module), context)
            for task, name in (("question", early), ("rewrite", late)):
                template = QUESTION if task == "question" else REWRITE
                prompts.append((module, task, prompt_of(tokenizer, code, template.format(name=name))))
        for module, task, prompt in prompts:
            cache, seconds = prefilled_mlx_lm(target, prompt)
            sessions = {}  # the drafters' tap layers -> the prompt's session
            for engine in engines.values():
                key = tuple(sorted(engine.drafter.taps))
                if key not in sessions:
                    engine.reset()
                    tic = time.perf_counter()
                    for _ in engine.generate(prompt, max_tokens=1):
                        pass
                    prefills.append(
                        dict(
                            context=context,
                            prompt_tokens=len(prompt),
                            module=module,
                            task=task,
                            mlx_lm_seconds=seconds,
                            engine_seconds=time.perf_counter() - tic,
                            taps=list(key),
                        )
                    )
                    sessions[key] = engine.detach()
            for repeat in range(args.repeats):
                for name in methods:
                    engine, session = engines[name], sessions[tuple(sorted(engines[name].drafter.taps))]
                    base, run = Collector(), Collector()
                    pair = [
                        lambda: timed(mlx_lm_steps(target, prompt, cache, args.max_tokens, base), base),
                        lambda: timed(engine_steps(engine, prompt, session, args.max_tokens, run), run),
                    ]
                    first = order % 2
                    order += 1
                    results = {first: pair[first](), 1 - first: pair[1 - first]()}
                    (b_first, b_tokens, b_total), (m_first, m_tokens, m_total) = results[0], results[1]
                    records.append(
                        dict(
                            context=context,
                            prompt_tokens=len(prompt),
                            module=module,
                            task=task,
                            method=name,
                            repeat=repeat,
                            identical=run.tokens == base.tokens,
                            tokens=len(run.tokens),
                            tau=run.stats.tokens_per_step,
                            base_ttft=b_first,
                            base_decode_tokens=len(base.tokens) - b_tokens,
                            base_decode_seconds=b_total - b_first,
                            ttft=m_first,
                            decode_tokens=len(run.tokens) - m_tokens,
                            decode_seconds=m_total - m_first,
                        )
                    )
                    print(
                        f"{context} {name} {module} {task} r{repeat}: "
                        f"{records[-1]['decode_tokens'] / records[-1]['decode_seconds']:.1f} vs "
                        f"{records[-1]['base_decode_tokens'] / records[-1]['base_decode_seconds']:.1f} tok/s, "
                        f"tau {records[-1]['tau']:.2f}, identical {records[-1]['identical']}",
                        flush=True,
                    )
    note = (
        f"{len(args.sources.split(','))} files x 2 tasks per context ({args.sources}), {args.max_tokens} "
        f"tokens, {args.repeats} repeats, greedy; weights {target.path}"
    )
    write_results(
        summary(records, methods) + "\n\n" + prefill_summary(prefills),
        note,
        {"runs": records, "prefills": prefills},
        args.markdown,
        args.json,
    )


def summary(records, methods) -> str:
    lines = [
        "| context (tokens) | task | method | decode tok/s | mlx-lm decode tok/s | speedup (per repeat) "
        "| first step ms (mlx-lm) | tau | identical |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for context in sorted({r["context"] for r in records}):
        for task in ("question", "rewrite", "both"):
            for name in methods:
                rs = [
                    r
                    for r in records
                    if r["context"] == context and r["method"] == name and task in (r["task"], "both")
                ]
                repeats = sorted({r["repeat"] for r in rs})
                rates = []
                for repeat in repeats:
                    mine = [r for r in rs if r["repeat"] == repeat]
                    rates.append(
                        (
                            sum(r["decode_tokens"] for r in mine) / sum(r["decode_seconds"] for r in mine),
                            sum(r["base_decode_tokens"] for r in mine)
                            / sum(r["base_decode_seconds"] for r in mine),
                        )
                    )
                speedups = [m / b for m, b in rates]
                lines.append(
                    f"| {context} | {task} | {name} | {statistics.median(m for m, _ in rates):.1f} | "
                    f"{statistics.median(b for _, b in rates):.1f} | {statistics.median(speedups):.2f}x "
                    f"({', '.join(f'{x:.2f}' for x in speedups)}) | {statistics.median(r['ttft'] for r in rs) * 1e3:.0f} "
                    f"({statistics.median(r['base_ttft'] for r in rs) * 1e3:.0f}) | "
                    f"{statistics.median(r['tau'] for r in rs):.2f} | {sum(r['identical'] for r in rs)}/{len(rs)} |"
                )
    return "\n".join(lines)


def prefill_summary(prefills) -> str:
    lines = [
        "| context (tokens) | prompt tokens (median) | mlx-lm prefill s | engine prefill s (drafter's taps) |",
        "|---|---|---|---|",
    ]
    for context in sorted({p["context"] for p in prefills}):
        ps = [p for p in prefills if p["context"] == context]
        by_taps = {}
        for p in ps:
            by_taps.setdefault(tuple(p["taps"]), []).append(p["engine_seconds"])
        lines.append(
            f"| {context} | {statistics.median(p['prompt_tokens'] for p in ps):.0f} | "
            f"{statistics.median(p['mlx_lm_seconds'] for p in ps):.1f} | "
            + ", ".join(f"{statistics.median(v):.1f} ({list(k) or 'none'})" for k, v in by_taps.items())
            + " |"
        )
    return "\n".join(lines)


if __name__ == "__main__":
    main()
