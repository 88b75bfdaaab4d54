"""Anthropic's Messages API (what Claude Code and other agents speak): requests turned into the
same checked Request the OpenAI routes make (one engine, batch and prompt cache behind both),
replies into Messages objects and stream events.

Messages: `system` (text or blocks), user and assistant turns of text, `tool_use` and
`tool_result` blocks; `tools` ({name, description, input_schema}) and `tool_choice` (auto, any,
tool, none); `thinking` ({"type": "enabled"} / "disabled") reaches a thinking model's template
as enable_thinking. A reply's content blocks come from the same split as the OpenAI routes'
(server/output.py): thinking, text, tool_use."""

import json
import uuid
from typing import List, Optional

from .output import Delta
from .protocol import Request, RequestError, quoted

# Fields accepted and what they change: nothing, for these.
IGNORED = {
    "metadata": "nothing is stored",
    "service_tier": "one tier",
    "container": "no containers here",
    "mcp_servers": "no MCP servers here (the client runs its tools)",
}
FIELDS = {
    "model",
    "messages",
    "system",
    "max_tokens",
    "temperature",
    "top_p",
    "top_k",
    "stop_sequences",
    "stream",
    "tools",
    "tool_choice",
    "thinking",
} | set(IGNORED)
# Anthropic's error types by HTTP status.
ERROR_TYPES = {
    400: "invalid_request_error",
    401: "authentication_error",
    403: "permission_error",
    404: "not_found_error",
    411: "invalid_request_error",
    413: "request_too_large",
    429: "rate_limit_error",
    500: "api_error",
    503: "overloaded_error",
}
STOP_REASONS = {"eos": "end_turn", "stop": "stop_sequence", "length": "max_tokens"}


def error_body(error: RequestError) -> dict:
    return {
        "type": "error",
        "error": {"type": ERROR_TYPES.get(error.status, "api_error"), "message": error.message},
    }


def _text(content, where: str) -> str:
    if isinstance(content, str):
        return content
    if isinstance(content, list) and all(
        isinstance(b, dict) and b.get("type") == "text" and isinstance(b.get("text"), str) for b in content
    ):
        return "".join(b["text"] for b in content)
    raise RequestError(400, f"{where}: expected text or text blocks, got {quoted(content)}", where)


def _messages(body) -> List[dict]:
    """The conversation as chat templates take it (OpenAI's roles and tool_calls): a user turn's
    tool_result blocks become tool messages, an assistant turn's tool_use blocks its tool calls."""
    messages = []
    if body.get("system") is not None:
        messages.append({"role": "system", "content": _text(body["system"], "system")})
    turns = body.get("messages")
    if not isinstance(turns, list) or not turns:
        raise RequestError(400, "'messages' must be a non-empty list", "messages")
    for i, turn in enumerate(turns):
        where = f"messages.{i}"
        if not isinstance(turn, dict) or turn.get("role") not in ("user", "assistant"):
            raise RequestError(400, f"{where}: each message needs a role, user or assistant", "messages")
        content = turn.get("content")
        if isinstance(content, str):
            messages.append({"role": turn["role"], "content": content})
            continue
        if not isinstance(content, list):
            raise RequestError(400, f"{where}: 'content' must be a string or a list of blocks", "messages")
        texts, calls, results = [], [], []
        for block in content:
            kind = block.get("type") if isinstance(block, dict) else None
            if kind == "text" and isinstance(block.get("text"), str):
                texts.append(block["text"])
            elif kind in ("thinking", "redacted_thinking") and turn["role"] == "assistant":
                continue  # earlier thinking is not shown to the model again (as templates drop it)
            elif kind == "tool_use" and turn["role"] == "assistant" and isinstance(block.get("name"), str):
                calls.append(
                    {
                        "id": block.get("id"),
                        "type": "function",
                        "function": {"name": block["name"], "arguments": block.get("input") or {}},
                    }
                )
            elif (
                kind == "tool_result" and turn["role"] == "user" and isinstance(block.get("tool_use_id"), str)
            ):
                result = block.get("content", "")
                results.append(
                    {
                        "role": "tool",
                        "tool_call_id": block["tool_use_id"],
                        "content": result if isinstance(result, str) else _text(result, where),
                    }
                )
            else:
                raise RequestError(
                    400,
                    f"{where}: a {quoted(kind)} block is not supported in a {turn['role']} "
                    "message (text, tool_use, tool_result)",
                    "messages",
                )
        messages.extend(results)
        if texts or calls or not results:
            message = {"role": turn["role"], "content": "".join(texts)}
            if calls:
                message["tool_calls"] = calls
            messages.append(message)
    return messages


def _tools(body):
    tools = body.get("tools")
    if tools is None or tools == []:
        return None
    if not isinstance(tools, list) or not all(
        isinstance(t, dict) and isinstance(t.get("name"), str) for t in tools
    ):
        raise RequestError(
            400,
            f"'tools' must be a list of {{name, description, input_schema}}, got {quoted(tools)}",
            "tools",
        )
    return [
        {
            "type": "function",
            "function": {
                "name": t["name"],
                "description": t.get("description", ""),
                "parameters": t.get("input_schema", {}),
            },
        }
        for t in tools
    ]


def _tool_choice(body, tools):
    choice = body.get("tool_choice") or {"type": "auto"}
    kind = choice.get("type") if isinstance(choice, dict) else None
    if kind == "auto":
        return tools, "auto"
    if kind == "none":
        return None, "none"
    if kind in ("any", "tool") and not tools:
        raise RequestError(400, f"'tool_choice' {kind} needs 'tools'", "tool_choice")
    if kind == "any":
        return tools, "required"
    if kind == "tool":
        named = [t for t in tools if t["function"]["name"] == choice.get("name")]
        if not named:
            raise RequestError(
                400, f"'tool_choice' names {quoted(choice.get('name'))}, not among 'tools'", "tool_choice"
            )
        return named, "required"
    raise RequestError(
        400, f"'tool_choice' must be auto, any, tool or none, got {quoted(choice)}", "tool_choice"
    )


def _number(body, name, low, high=None, integer=False):
    value = body.get(name)
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int if integer else (int, float)):
        raise RequestError(400, f"'{name}' must be {'an integer' if integer else 'a number'}", name)
    if value < low or (high is not None and value > high):
        raise RequestError(
            400,
            f"'{name}' must be between {low} and {high}, got {value}"
            if high is not None
            else f"'{name}' must be >= {low}, got {value}",
            name,
        )
    return value


def parse(body, count_only: bool = False) -> Request:
    """A checked Request from a Messages API body (count_tokens: max_tokens not required)."""
    if not isinstance(body, dict):
        raise RequestError(400, "the request body must be a JSON object")
    for name in body:
        if name not in FIELDS:
            raise RequestError(400, f"unsupported field '{name}'", name)
    if "max_tokens" not in body and not count_only:
        raise RequestError(400, "missing 'max_tokens'", "max_tokens")
    stream = body.get("stream", False)
    if not isinstance(stream, bool):
        raise RequestError(400, "'stream' must be true or false", "stream")
    stop = body.get("stop_sequences") or []
    if not isinstance(stop, list) or not all(isinstance(s, str) and s for s in stop):
        raise RequestError(400, "'stop_sequences' must be a list of non-empty strings", "stop_sequences")
    thinking = body.get("thinking")
    kwargs = {}
    if thinking is not None:
        if not isinstance(thinking, dict) or thinking.get("type") not in ("enabled", "disabled", "adaptive"):
            raise RequestError(
                400,
                f'\'thinking\' must be {{"type": "enabled" | "disabled"}}, got {quoted(thinking)}',
                "thinking",
            )
        kwargs["enable_thinking"] = thinking["type"] != "disabled"
    sampling = {
        "temp": _number(body, "temperature", 0, 1),
        "top_p": _number(body, "top_p", 0, 1),
        "top_k": _number(body, "top_k", 0, integer=True),
    }
    tools, tool_choice = _tool_choice(body, _tools(body))
    if body.get("model") is not None and not isinstance(body["model"], str):
        raise RequestError(400, "'model' must be a string", "model")
    return Request(
        chat=True,
        stream=stream,
        model=body.get("model"),
        include_usage=True,
        messages=_messages(body),
        max_tokens=_number(body, "max_tokens", 1, integer=True),
        sampling={k: v for k, v in sampling.items() if v is not None},
        stop=stop,
        tools=tools,
        tool_choice=tool_choice,
        chat_template_kwargs=kwargs,
    )


def _usage(stats) -> dict:
    return {
        "input_tokens": stats.prompt_tokens - stats.prompt_cached,
        "output_tokens": stats.generated_tokens,
        "cache_read_input_tokens": stats.prompt_cached,
        "cache_creation_input_tokens": 0,
    }


def _tool_use(call: dict) -> dict:
    arguments = call["function"]["arguments"]
    return {
        "type": "tool_use",
        "id": "toolu_" + (call.get("id") or uuid.uuid4().hex).replace("-", ""),
        "name": call["function"]["name"],
        "input": json.loads(arguments) if arguments else {},
    }


def stop_reason(stats, tool_calls: bool) -> str:
    return (
        "tool_use"
        if tool_calls and stats.finish_reason != "length"
        else STOP_REASONS.get(stats.finish_reason, "end_turn")
    )


class MessageReply:
    """A Messages API reply: whole (message), or stream events in Anthropic's order."""

    def __init__(self, model: str, stop_sequences):
        self.model, self.stop_sequences = model, stop_sequences
        self.id = "msg_" + uuid.uuid4().hex
        self.blocks = 0  # content blocks started so far
        self.open: Optional[str] = None  # the type of the block being streamed

    def _message(self, content: list, stop_reason_: Optional[str], stop_sequence, usage: dict) -> dict:
        return {
            "id": self.id,
            "type": "message",
            "role": "assistant",
            "model": self.model,
            "content": content,
            "stop_reason": stop_reason_,
            "stop_sequence": stop_sequence,
            "usage": usage,
        }

    def whole(self, delta: Delta, stats) -> dict:
        content = []
        if delta.reasoning:
            content.append({"type": "thinking", "thinking": delta.reasoning, "signature": ""})
        if delta.content:
            content.append({"type": "text", "text": delta.content})
        content += [_tool_use(call) for call in delta.tool_calls]
        return self._message(
            content, stop_reason(stats, bool(delta.tool_calls)), self._stop_sequence(stats), _usage(stats)
        )

    def _stop_sequence(self, stats):
        return stats.stop_string or None if stats.finish_reason == "stop" else None

    # --- stream ------------------------------------------------------------------------
    def start(self, prompt_tokens: int) -> List[tuple]:
        """message_start as the request is queued (what the cache holds is known at the end: the
        message_delta's usage says it, as Anthropic's does)."""
        usage = {
            "input_tokens": prompt_tokens,
            "output_tokens": 0,
            "cache_read_input_tokens": 0,
            "cache_creation_input_tokens": 0,
        }
        return [
            ("message_start", {"type": "message_start", "message": self._message([], None, None, usage)}),
            ("ping", {"type": "ping"}),
        ]

    def _switch(self, kind: str, block: dict) -> List[tuple]:
        events = self._close()
        events.append(
            (
                "content_block_start",
                {"type": "content_block_start", "index": self.blocks, "content_block": block},
            )
        )
        self.open = kind
        return events

    def _close(self) -> List[tuple]:
        if self.open is None:
            return []
        self.open = None
        self.blocks += 1
        return [("content_block_stop", {"type": "content_block_stop", "index": self.blocks - 1})]

    def _delta(self, delta: dict) -> tuple:
        return ("content_block_delta", {"type": "content_block_delta", "index": self.blocks, "delta": delta})

    def events(self, delta: Delta) -> List[tuple]:
        """The events of a piece of the reply: each kind of text in a block of its own."""
        events = []
        if delta.reasoning:
            if self.open != "thinking":
                events += self._switch("thinking", {"type": "thinking", "thinking": "", "signature": ""})
            events.append(self._delta({"type": "thinking_delta", "thinking": delta.reasoning}))
        if delta.content:
            if self.open != "text":
                events += self._switch("text", {"type": "text", "text": ""})
            events.append(self._delta({"type": "text_delta", "text": delta.content}))
        for call in delta.tool_calls:
            block = _tool_use(call)
            events += self._switch("tool_use", {**block, "input": {}})
            events.append(
                self._delta({"type": "input_json_delta", "partial_json": json.dumps(block["input"])})
            )
        return events

    def finish(self, stats, tool_calls: bool) -> List[tuple]:
        return self._close() + [
            (
                "message_delta",
                {
                    "type": "message_delta",
                    "delta": {
                        "stop_reason": stop_reason(stats, tool_calls),
                        "stop_sequence": self._stop_sequence(stats),
                    },
                    "usage": _usage(stats),
                },
            ),
            ("message_stop", {"type": "message_stop"}),
        ]
