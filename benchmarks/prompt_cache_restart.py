"""The prompt cache on disk after a restart (issue 64's target): time to first token of a
conversation's second turn at several lengths of context, three ways, each on a fresh
`mlx-spec serve` process on loopback (the embedded default model, float32, --draft lookup):

- cold: the second turn on a server that holds nothing (--prompt-cache-dir off);
- memory-warm: the second turn right after the first on the same server (its conversation in
  memory, as a chat client's next turn finds it);
- restart: the second turn on a server started after another answered the first turn and
  stopped (SIGTERM: the conversation written to a fresh --prompt-cache-dir, read back here).

The context is real code (mlx_lm/generate.py cut to the length, as benchmarks/long_context.py
builds it): the first turn asks about one function, the second about another. Medians over
--repeats; the three second replies must be identical (greedy).

    .venv/bin/python benchmarks/prompt_cache_restart.py --contexts 2048,4096 --repeats 3 [--markdown out.md]

On this CPU a prompt of 7,680 tokens takes ~3 minutes to prefill (float32, 2 cores): 8k makes a
repeat ~10 minutes.
"""

import argparse
import json
import statistics
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

import mlx_spec  # noqa: E402,F401  (OpenBLAS before mlx.core)

# isort: split
from long_context import QUESTION, cut, source_text  # noqa: E402
from mlx_spec.convert.default import default_model_path  # noqa: E402
from mlx_spec.models.target import load_target  # noqa: E402
from report import write_results  # noqa: E402
from serve_load import mlx_spec_server, stream_chat  # noqa: E402


def server(model_dir, draft, cache_dir):
    process = mlx_spec_server(
        model_dir,
        draft,
        "--prompt-cache-dir",
        cache_dir or "off",
        name=f"mlx-spec serve ({cache_dir or 'no disk cache'})",
    )
    process.wait_ready(300)
    return process


def turn(process, messages, max_tokens):
    body = {
        "messages": messages,
        "max_tokens": max_tokens,
        "temperature": 0.0,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    result = stream_chat(process.port, body, 900)
    if result["error"]:
        process.fail(result["error"])
    cached = ((result["usage"] or {}).get("prompt_tokens_details") or {}).get("cached_tokens")
    return result["text"], result["ttft"], cached, (result["usage"] or {}).get("prompt_tokens")


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--contexts", default="2048,4096")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--draft", default="lookup")
    parser.add_argument("--max-tokens", type=int, default=24)
    parser.add_argument("--markdown", default=None)
    parser.add_argument("--json", default=None)
    args = parser.parse_args()
    model_dir = default_model_path(dtype="float32")
    tokenizer = load_target(model_dir, "float32").tokenizer  # the chat template as the server applies it
    records = []
    for context in [int(c) for c in args.contexts.split(",")]:
        code, early, late = cut(tokenizer, source_text("mlx_lm.generate"), context)
        first = [
            {
                "role": "user",
                "content": f"Here is a Python file:\n```python\n{code}\n```\n" + QUESTION.format(name=late),
            }
        ]
        for repeat in range(args.repeats):
            record = dict(context=context, repeat=repeat)
            warm = server(model_dir, args.draft, None)
            try:
                reply, record["first_ttft"], _, record["first_prompt_tokens"] = turn(
                    warm, first, args.max_tokens
                )
                second = first + [
                    {"role": "assistant", "content": reply},
                    {"role": "user", "content": QUESTION.format(name=early)},
                ]
                texts = {}
                texts["warm"], record["warm"], record["warm_cached"], record["prompt_tokens"] = turn(
                    warm, second, args.max_tokens
                )
            finally:
                warm.stop()
            with tempfile.TemporaryDirectory() as directory:
                writer = server(model_dir, args.draft, directory)
                try:
                    turn(writer, first, args.max_tokens)
                finally:
                    writer.stop()
                reader = server(model_dir, args.draft, directory)
                try:
                    texts["restart"], record["restart"], record["restart_cached"], _ = turn(
                        reader, second, args.max_tokens
                    )
                finally:
                    reader.stop()
            cold = server(model_dir, args.draft, None)
            try:
                texts["cold"], record["cold"], record["cold_cached"], _ = turn(cold, second, args.max_tokens)
            finally:
                cold.stop()
            record["identical"] = len(set(texts.values())) == 1
            records.append(record)
            print(json.dumps(record), flush=True)
    lines = [
        "| context (tokens) | second turn's prompt | cold TTFT s | memory-warm TTFT s | restart TTFT s "
        "| restart / warm | cold / restart | cached (warm, restart) | identical |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for context in sorted({r["context"] for r in records}):
        rs = [r for r in records if r["context"] == context]
        cold, warm, restart = (statistics.median(r[k] for r in rs) for k in ("cold", "warm", "restart"))
        lines.append(
            f"| {context} | {rs[0]['prompt_tokens']} | {cold:.2f} | {warm:.2f} | {restart:.2f} | "
            f"{restart / warm:.2f} | {cold / restart:.1f} | {rs[0]['warm_cached']}, {rs[0]['restart_cached']} "
            f"| {sum(r['identical'] for r in rs)}/{len(rs)} |"
        )
    note = f"medians of {args.repeats} repeats; --draft {args.draft}; {args.max_tokens} tokens per turn; weights {model_dir}"
    write_results("\n".join(lines), note, records, args.markdown, args.json)


if __name__ == "__main__":
    main()
