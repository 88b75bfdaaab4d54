"""A coding agent's session replayed against servers (issue 64): `mlx-spec serve --draft X`
against mlx_lm.server on the same weights, through the real `openai` client (every server) and
the real `anthropic` client (mlx-spec's /v1/messages, --anthropic configs).

The session, as an agent sends it: a system prompt with four tool definitions (JSON schemas),
then user turns; a turn that needs a file gets the agent's scripted `read_file` call (JSON
arguments) and the file as the tool's result: real source from installed packages
(click/core.py, mlx_lm/generate.py), each cut to --file-tokens. The model's own reply ends each
turn and goes back into the history (tool calls included), so a server that is not lossless
shows as a changed history, counted in `identical`. Turn kinds:

- answer: a question about the file just read;
- rewrite: a function of a file in the context written out again with type hints and a docstring;
- patch: the same change as a unified diff against the file.

Per turn: time to the first streamed delta (TTFT: the new part of the prompt's prefill, the
previous turns being cached), completion tokens (usage), decode tok/s = tokens / (total - TTFT).
After the session the server stops (SIGTERM) and a fresh one on the same --prompt-cache-dir gets
the last turn again: `restart` TTFT (mlx_lm.server keeps no cache on disk: its restart is cold).
`cold` is the last turn on a fresh mlx-spec server with no disk cache (--cold config only: a
prefill costs the same with any --draft). Session time: the session's turns end to end.

The embedded default model (SmolLM2-135M-Instruct) has no tool-calling chat template: both
servers serve its weights with a Qwen-style template that renders tools and <tool_call> blocks
(tests/agent_model.py's, which mlx-lm reads as its json_tools parser), from a directory of links
to the float32 weights. Medians over --repeats; configs run one after the other (never sharing
the cores), in a rotated order per repeat.

    .venv/bin/python benchmarks/agent_trace.py --configs mlx_lm,none,lookup,suffix,suffix+eagle \
        --repeats 3 [--markdown out.md] [--json out.json]
"""

import argparse
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

import anthropic  # noqa: E402
import openai  # noqa: E402

import mlx_spec  # noqa: E402,F401  (OpenBLAS before mlx.core)

# isort: split
from long_context import cut, source_text  # noqa: E402
from mlx_spec.convert.default import default_model_path  # noqa: E402
from mlx_spec.models.target import load_target  # noqa: E402
from report import write_results  # noqa: E402
from serve_load import mlx_lm_server, mlx_spec_server, served_model  # noqa: E402

SYSTEM = (
    "You are a coding agent working in a Python repository. Use the tools to read files, "
    "edit them and run the tests. Keep answers short and code exact."
)
TOOLS = [
    ("read_file", "Read a file of the repository.", {"path": {"type": "string"}}),
    ("write_file", "Replace a file's content.", {"path": {"type": "string"}, "content": {"type": "string"}}),
    ("apply_patch", "Apply a unified diff to the repository.", {"patch": {"type": "string"}}),
    ("run_tests", "Run the test suite, or one test file.", {"path": {"type": "string"}}),
]
# SmolLM2's ChatML layout, with tools in the system turn and calls and results as Qwen (Hermes)
# writes them: mlx-lm reads <tool_call> and tool_call.name in a template as its json_tools parser.
TEMPLATE = "".join(
    line.strip()
    for line in r"""
{%- if messages[0]['role'] == 'system' %}{%- set system = messages[0]['content'] %}{%- set messages = messages[1:] %}
{%- else %}{%- set system = 'You are a helpful AI assistant named SmolLM, trained by Hugging Face' %}{%- endif %}
{{- '<|im_start|>system\n' + system }}
{%- if tools %}
  {{- '\n\n# Tools\nCall a tool with <tool_call>{"name": ..., "arguments": ...}</tool_call>.\n<tools>' }}
  {%- for tool in tools %}{{- '\n' + (tool | tojson) }}{%- endfor %}{{- '\n</tools>' }}
{%- endif %}
{{- '<|im_end|>\n' }}
{%- for message in messages %}
  {%- if message['role'] == 'tool' %}
    {{- '<|im_start|>user\n<tool_response>\n' + message['content'] + '\n</tool_response><|im_end|>\n' }}
  {%- else %}
    {{- '<|im_start|>' + message['role'] + '\n' + (message['content'] or '') }}
    {%- for tool_call in message.get('tool_calls') or [] %}
      {%- if tool_call.function is defined %}{%- set tool_call = tool_call.function %}{%- endif %}
      {{- '<tool_call>\n{"name": "' + tool_call.name + '", "arguments": ' }}
      {{- tool_call.arguments if tool_call.arguments is string else tool_call.arguments | tojson }}
      {{- '}\n</tool_call>' }}
    {%- endfor %}
    {{- '<|im_end|>\n' }}
  {%- endif %}
{%- endfor %}
{%- if add_generation_prompt %}{{- '<|im_start|>assistant\n' }}{%- endif %}
""".splitlines()
)
FILES = [("click.core", "click/core.py"), ("mlx_lm.generate", "mlx_lm/generate.py")]
ANSWER, REWRITE, PATCH = "answer", "rewrite", "patch"


def openai_tools():
    return [
        {
            "type": "function",
            "function": {
                "name": name,
                "description": text,
                "parameters": {"type": "object", "properties": properties, "required": list(properties)},
            },
        }
        for name, text, properties in TOOLS
    ]


def anthropic_tools():
    return [
        {
            "name": name,
            "description": text,
            "input_schema": {"type": "object", "properties": properties, "required": list(properties)},
        }
        for name, text, properties in TOOLS
    ]


def session_script(tokenizer, file_tokens):
    """[(user text, file read first or None, kind, max_tokens)], the files' text by path."""
    files, names = {}, {}
    for module, path in FILES:
        files[path], early, late = cut(tokenizer, source_text(module), file_tokens)
        names[path] = (early, late)
    (first, (_, late1)), (second, (early2, late2)) = names.items()
    script = [
        (f"`{late1}` in {first} misbehaves when it gets no arguments. Find out why.", first, ANSWER, 96),
        (
            f"Rewrite `{late1}` with type hints and a docstring. Reply with the whole function in a code block.",
            None,
            REWRITE,
            256,
        ),
        (f"Now look at {second}: what does `{early2}` do?", second, ANSWER, 96),
        (
            f"Add type hints to `{early2}` in {second}. Reply with a unified diff against the file.",
            None,
            PATCH,
            192,
        ),
        (
            f"Rewrite `{late2}` with a docstring. Reply with the whole function in a code block.",
            None,
            REWRITE,
            256,
        ),
    ]
    return script, files


def agent_model_dir(directory: Path) -> Path:
    """The default model's float32 weights (links) with a tool-calling chat template."""
    source = default_model_path(dtype="float32")
    for item in source.iterdir():
        if item.name != "tokenizer_config.json":
            (directory / item.name).symlink_to(item)
    config = json.loads((source / "tokenizer_config.json").read_text())
    config["chat_template"] = TEMPLATE
    (directory / "tokenizer_config.json").write_text(json.dumps(config))
    return directory


def start(config, model_dir, cache_dir, memory=None):
    """A server on loopback; mlx-spec's with its prompt cache on disk in cache_dir (None: off) and
    suffix decoding's memory of earlier outputs in the file `memory` (fresh for each session: a
    replayed session must not find its own replies there)."""
    if config == "mlx_lm":
        process = mlx_lm_server(model_dir)
    else:
        memory_flags = ["--suffix-memory", str(memory)] if config.startswith("suffix") else []
        process = mlx_spec_server(
            model_dir, config, "--prompt-cache-dir", str(cache_dir) if cache_dir else "off", *memory_flags
        )
    process.wait_ready(300)
    return process


def fenced(code):
    """A file as the read_file tool returns it."""
    return f"```python\n{code}\n```"


def call_text(name, arguments):
    """A tool call as one comparable string (arguments parsed where they are JSON)."""
    try:
        arguments = json.loads(arguments) if isinstance(arguments, str) else arguments
    except ValueError:
        pass
    return json.dumps({"name": name, "arguments": arguments}, sort_keys=True)


class OpenAIAgent:
    """The session as OpenAI chat messages, sent by the `openai` client."""

    def __init__(self, port, model):
        self.client = openai.OpenAI(
            base_url=f"http://127.0.0.1:{port}/v1", api_key="none", timeout=1800, max_retries=0
        )
        self.model = model or "default_model"
        self.messages = [{"role": "system", "content": SYSTEM}]

    def user(self, text, read_path, content, call_id):
        self.messages.append({"role": "user", "content": text})
        if read_path:
            self.messages.append(
                {
                    "role": "assistant",
                    "content": "",
                    "tool_calls": [
                        {
                            "id": call_id,
                            "type": "function",
                            "function": {"name": "read_file", "arguments": json.dumps({"path": read_path})},
                        }
                    ],
                }
            )
            self.messages.append({"role": "tool", "tool_call_id": call_id, "content": fenced(content)})

    def reply(self, max_tokens):
        start, ttft, pieces, calls, usage = time.perf_counter(), None, [], {}, None
        stream = self.client.chat.completions.create(
            model=self.model,
            messages=self.messages,
            tools=openai_tools(),
            max_tokens=max_tokens,
            temperature=0.0,
            stream=True,
            stream_options={"include_usage": True},
        )
        for chunk in stream:
            if chunk.usage:
                usage = chunk.usage
            for choice in chunk.choices:
                delta = choice.delta
                if (delta.content or delta.tool_calls) and ttft is None:
                    ttft = time.perf_counter() - start
                pieces.append(delta.content or "")
                for call in delta.tool_calls or []:
                    entry = calls.setdefault(call.index, {"id": call.id, "name": "", "arguments": ""})
                    entry["name"] += (call.function.name or "") if call.function else ""
                    entry["arguments"] += (call.function.arguments or "") if call.function else ""
        total = time.perf_counter() - start
        text = "".join(pieces)
        message = {"role": "assistant", "content": text}
        if calls:
            message["tool_calls"] = [
                {
                    "id": c["id"],
                    "type": "function",
                    "function": {"name": c["name"], "arguments": c["arguments"]},
                }
                for c in calls.values()
            ]
        self.messages.append(message)
        cached = getattr(usage, "prompt_tokens_details", None) or {}
        cached = (
            getattr(cached, "cached_tokens", None)
            if not isinstance(cached, dict)
            else cached.get("cached_tokens")
        )
        return dict(
            ttft=ttft,
            total=total,
            tokens=usage.completion_tokens,
            prompt_tokens=usage.prompt_tokens,
            cached=cached,
            text=text
            + "".join(
                call_text(m["function"]["name"], m["function"]["arguments"])
                for m in message.get("tool_calls", [])
            ),
        )

    def last_turn(self):
        """The session up to its last reply, to send again to another server."""
        return self.messages[:-1]


class AnthropicAgent:
    """The same session as Anthropic messages (tool_use and tool_result blocks), sent by the
    `anthropic` client to /v1/messages."""

    def __init__(self, port, model):
        self.client = anthropic.Anthropic(
            base_url=f"http://127.0.0.1:{port}", api_key="none", timeout=1800, max_retries=0
        )
        self.model = model or "default_model"
        self.messages = []

    def user(self, text, read_path, content, call_id):
        self.messages.append({"role": "user", "content": [{"type": "text", "text": text}]})
        if read_path:
            self.messages.append(
                {
                    "role": "assistant",
                    "content": [
                        {"type": "tool_use", "id": call_id, "name": "read_file", "input": {"path": read_path}}
                    ],
                }
            )
            self.messages.append(
                {
                    "role": "user",
                    "content": [{"type": "tool_result", "tool_use_id": call_id, "content": fenced(content)}],
                }
            )

    def reply(self, max_tokens):
        start, ttft, usage_in, usage_out = time.perf_counter(), None, None, None
        # the client has no `temperature` (deprecated upstream): greedy is sent in the body
        with self.client.messages.stream(
            model=self.model,
            system=SYSTEM,
            messages=self.messages,
            tools=anthropic_tools(),
            max_tokens=max_tokens,
            extra_body={"temperature": 0.0},
        ) as stream:
            for event in stream:
                if event.type == "message_start":
                    usage_in = event.message.usage
                elif event.type == "content_block_delta" and ttft is None:
                    ttft = time.perf_counter() - start
                elif event.type == "message_delta":  # its usage says what the cache held, as Anthropic's does
                    usage_out = event.usage
            message = stream.get_final_message()
        total = time.perf_counter() - start
        content = [b.model_dump(include={"type", "text", "id", "name", "input"}) for b in message.content]
        self.messages.append({"role": "assistant", "content": content or [{"type": "text", "text": ""}]})
        text = "".join(b.text if b.type == "text" else call_text(b.name, b.input) for b in message.content)
        cached = usage_out.cache_read_input_tokens or 0
        return dict(
            ttft=ttft,
            total=total,
            tokens=usage_out.output_tokens,
            prompt_tokens=(usage_out.input_tokens or usage_in.input_tokens) + cached,
            cached=cached,
            text=text,
        )

    def last_turn(self):
        return self.messages[:-1]


def replay(agent, script, files):
    turns = []
    start = time.perf_counter()
    for index, (text, read_path, kind, max_tokens) in enumerate(script):
        agent.user(text, read_path, files.get(read_path), f"call_{index}")
        turn = agent.reply(max_tokens)
        turns.append(dict(turn, kind=kind, index=index))
    return turns, time.perf_counter() - start


def run_config(config, client, model_dir, script, files, cold):
    record = dict(config=config, client=client)
    agent_type = AnthropicAgent if client == "anthropic" else OpenAIAgent
    with tempfile.TemporaryDirectory() as cache_dir, tempfile.TemporaryDirectory() as memory_dir:
        memory = Path(memory_dir) / "suffix-memory.npz"
        process = start(config, model_dir, cache_dir if config != "mlx_lm" else None, memory)
        try:
            agent = agent_type(
                process.port, served_model(process.port, model_dir) if config == "mlx_lm" else None
            )
            record["turns"], record["session"] = replay(agent, script, files)
        finally:
            process.stop()
        history = agent.last_turn()
        for label, directory in [("restart", cache_dir if config != "mlx_lm" else None)] + (
            [("cold", None)] if cold else []
        ):
            process = start(
                config, model_dir, directory, memory if label == "restart" else Path(memory_dir) / "cold.npz"
            )
            try:
                again = agent_type(
                    process.port, served_model(process.port, model_dir) if config == "mlx_lm" else None
                )
                again.messages = list(history)
                record[label] = again.reply(script[-1][3])
            finally:
                process.stop()
    return record


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--configs", default="mlx_lm,none,lookup,suffix,suffix+eagle")
    parser.add_argument(
        "--anthropic", default="suffix", help="configs replayed through the anthropic client too"
    )
    parser.add_argument("--cold", default="suffix", help="the mlx-spec config whose cold TTFT is measured")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--file-tokens", type=int, default=2900)
    parser.add_argument("--markdown", default=None)
    parser.add_argument("--json", default=None)
    args = parser.parse_args()
    configs = args.configs.split(",")
    runs = [(c, "openai") for c in configs] + [(c, "anthropic") for c in args.anthropic.split(",") if c]
    with tempfile.TemporaryDirectory() as directory:
        model_dir = agent_model_dir(Path(directory))
        script, files = session_script(load_target(model_dir, "float32").tokenizer, args.file_tokens)
        records = []
        for repeat in range(args.repeats):
            for config, client in runs[repeat % len(runs) :] + runs[: repeat % len(runs)]:
                record = run_config(
                    config, client, model_dir, script, files, cold=config == args.cold and client == "openai"
                )
                record["repeat"] = repeat
                records.append(record)
                print(json.dumps({k: v for k, v in record.items()}), flush=True)
    note = (
        f"medians of {args.repeats} repeats; --file-tokens {args.file_tokens}; the default model's float32 "
        "weights with a tool template"
    )
    write_results(summary(records, runs), note, records, args.markdown, args.json)


def decode_rate(turns, kind=None):
    chosen = [t for t in turns if kind is None or t["kind"] == kind]
    return sum(t["tokens"] for t in chosen) / sum(t["total"] - t["ttft"] for t in chosen)


def summary(records, runs) -> str:
    reference = {r["repeat"]: r for r in records if r["config"] == "mlx_lm"}
    texts = {r["repeat"]: [t["text"] for t in r["turns"]] for r in reference.values()}
    lines = [
        "| config | client | decode tok/s (answer, rewrite, patch) | x mlx_lm.server (answer, rewrite, patch) "
        "| session s | x mlx_lm.server | last turn's prompt | TTFT s: memory-warm, restart, cold "
        "| cached at restart | identical to mlx_lm.server |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    for config, client in runs:
        rs = [r for r in records if r["config"] == config and r["client"] == client]
        rates = [
            statistics.median(decode_rate(r["turns"], kind) for r in rs) for kind in (ANSWER, REWRITE, PATCH)
        ]
        ratios = (
            [
                statistics.median(
                    decode_rate(r["turns"], kind) / decode_rate(reference[r["repeat"]]["turns"], kind)
                    for r in rs
                )
                for kind in (ANSWER, REWRITE, PATCH)
            ]
            if reference
            else [None] * 3
        )
        session = statistics.median(r["session"] for r in rs)
        session_ratio = (
            statistics.median(reference[r["repeat"]]["session"] / r["session"] for r in rs)
            if reference
            else None
        )
        warm = statistics.median(r["turns"][-1]["ttft"] for r in rs)
        restart = statistics.median(r["restart"]["ttft"] for r in rs)
        cold = statistics.median(r["cold"]["ttft"] for r in rs) if "cold" in rs[0] else None
        # the session's replies equal mlx_lm.server's, and its last reply after a restart (and cold) equal its own
        same = sum(
            texts.get(r["repeat"]) == [t["text"] for t in r["turns"]]
            and all(r[k]["text"] == r["turns"][-1]["text"] for k in ("restart", "cold") if k in r)
            for r in rs
        )
        lines.append(
            f"| {config} | {client} | {', '.join(f'{x:.1f}' for x in rates)} | "
            + (", ".join(f"{x:.2f}" for x in ratios) if reference else "-")
            + f" | {session:.0f} | "
            + (f"{session_ratio:.2f}" if session_ratio else "-")
            + f" | {rs[0]['turns'][-1]['prompt_tokens']} | "
            f"{warm:.2f}, {restart:.2f}, "
            + (f"{cold:.2f}" if cold else "-")
            + f" | {rs[0]['restart']['cached']} | {same}/{len(rs)} |"
        )
    return "\n".join(lines)


if __name__ == "__main__":
    main()
