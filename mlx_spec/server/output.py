"""A reply as the OpenAI API returns it, whole or as stream chunks.

The reply's text is split as mlx_lm.server splits it, with mlx-lm's own pieces: its
TextStateMachine follows a thinking model's reasoning markers and the tokenizer's tool-call
markers (removing them), and the tokenizer's tool parser (mlx_lm/tool_parsers/) turns each
tool-call section into a call, formatted by mlx_lm.server's ToolCallFormatter. What the target
wrote is not changed: only where it goes (content, reasoning, tool_calls)."""

import functools
import time
import uuid
from dataclasses import dataclass, field
from typing import Callable, List, Optional

from mlx_lm.generate import TextStateMachine, make_text_state_machine
from mlx_lm.server import ToolCallFormatter

from .protocol import Request


def text_machine(tokenizer) -> TextStateMachine:
    """The reasoning / tool-call state machine of a tokenizer (built once per server)."""
    return make_text_state_machine(tokenizer)


def initial_state(tokenizer, prompt: List[int], tool_choice: str) -> str:
    """Where the reply begins: in a tool call where the prompt ends with its marker
    (tool_choice required), in reasoning where the prompt opened a thinking block it did not
    close (a thinking model's template), else in plain text (as mlx_lm.server decides)."""
    if tool_choice == "required":
        return "tool"
    state = "normal"
    if tokenizer.has_thinking and tokenizer.rfind_think_start(prompt) > tokenizer.rfind_think_end(prompt):
        state = "reasoning"
    return tokenizer.response_initial_state or state


@dataclass
class Delta:
    """What a piece of the reply adds, by where it goes."""

    content: str = ""
    reasoning: str = ""
    tool_calls: List[dict] = field(default_factory=list)


class ReplySplitter:
    """The reply's text, piece by piece, into content, reasoning and tool calls."""

    def __init__(self, tokenizer, machine: TextStateMachine, state: str, tools, streaming: bool):
        self.state, self.current = machine.make_state(state), state
        self.tool_text, self.made_tool_call = "", False
        self.formatter = ToolCallFormatter(tokenizer.tool_parser, tools, streaming) if tools else None

    def add(self, text: str, finish_reason: Optional[str] = None) -> Delta:
        self.state, segments = TextStateMachine.split(self.state, text) if text else (self.state, [])
        if finish_reason == "stop":  # a marker cut short by the end of text is not text
            self.state, state = TextStateMachine.discard(self.state)
            segments.append((state, ""))
        elif finish_reason is not None:  # cut by max_tokens: what was held back is text
            self.state, flushed, state = TextStateMachine.flush(self.state)
            segments.append((state, flushed))
        delta, calls = Delta(), []
        for state, piece in segments:
            if state == "tool":
                self.tool_text += piece
            elif self.current == "tool" and self.tool_text:  # a tool call ended
                calls.append(self.tool_text)
                self.tool_text = ""
            if state == "reasoning":
                delta.reasoning += piece
            elif state == "normal":
                delta.content += piece
            self.current = state
        if finish_reason is not None and self.current == "tool" and self.tool_text:
            calls.append(self.tool_text)  # cut by max_tokens or the end: parsed if it can be
            self.tool_text = ""
        if calls and self.formatter is not None:
            delta.tool_calls = self.formatter(calls)
            self.made_tool_call = self.made_tool_call or bool(delta.tool_calls)
        elif calls:  # tool markers without tools offered: the text as the model wrote it
            delta.content += "".join(calls)
        return delta


def token_texts(tokenizer) -> Callable[[int], str]:
    """A token's text on its own, remembered (logprobs decode six tokens per token sent)."""
    return functools.lru_cache(maxsize=None)(lambda token: tokenizer.decode([token]))


def token_logprobs(token_text: Callable[[int], str], token: int, logprob: float, top) -> dict:
    """One token's logprobs entry (OpenAI's fields, and mlx_lm.server's `id`)."""

    def entry(token_id, value):
        text = token_text(token_id)
        return {"token": text, "logprob": value, "bytes": list(text.encode("utf-8"))}

    return {**entry(token, logprob), "id": token, "top_logprobs": [entry(i, v) for i, v in top]}


def completion_logprobs(entries: List[dict], offset: int = 0) -> dict:
    """The legacy completions form of logprobs entries (tokens, token_logprobs, top_logprobs,
    text_offset), the text starting at `offset`."""
    offsets, position = [], offset
    for e in entries:
        offsets.append(position)
        position += len(e["token"])
    return {
        "tokens": [e["token"] for e in entries],
        "token_logprobs": [e["logprob"] for e in entries],
        "top_logprobs": [{t["token"]: t["logprob"] for t in e["top_logprobs"]} for e in entries],
        "text_offset": offsets,
    }


def usage(stats, method: str, sampled: bool, prediction: Optional[dict] = None) -> dict:
    """OpenAI's usage, with the prompt tokens the cache held, the prediction's tokens where one
    drafted, and what speculation did (and the seed that repeats a sampled reply)."""
    out = {
        "prompt_tokens": stats.prompt_tokens,
        "completion_tokens": stats.generated_tokens,
        "total_tokens": stats.prompt_tokens + stats.generated_tokens,
        "prompt_tokens_details": {"cached_tokens": stats.prompt_cached},
    }
    if prediction is not None:
        out["completion_tokens_details"] = prediction
    out["speculative"] = {
        "method": method,
        "steps": stats.steps,
        "tokens_per_step": round(stats.tokens_per_step, 4),
        "acceptance_rate": round(stats.acceptance_rate, 4),
        "verified_drafts": stats.verified_drafts,
        "accepted_drafts": stats.accepted_drafts,
        "plain_steps": stats.plain_steps,
        "seed": stats.seed if sampled else None,
    }
    return out


class Reply:
    """The response objects of one request, whole or as stream chunks."""

    def __init__(self, request: Request, model: str):
        self.chat, self.model = request.chat, model
        self.id = ("chatcmpl-" if self.chat else "cmpl-") + uuid.uuid4().hex
        self.created = int(time.time())
        self.object = "chat.completion" if self.chat else "text_completion"

    def _wrap(self, obj: str, choices: list, **extra) -> dict:
        return {
            "id": self.id,
            "object": obj,
            "created": self.created,
            "model": self.model,
            "choices": choices,
            **extra,
        }

    def _logprobs(self, entries: Optional[List[dict]], offset: int = 0):
        if entries is None:
            return None
        return {"content": entries} if self.chat else completion_logprobs(entries, offset)

    def whole(
        self, delta: Delta, finish_reason: str, usage_: dict, logprobs: Optional[List[dict]] = None
    ) -> dict:
        if self.chat:
            message = {"role": "assistant", "content": delta.content or (None if delta.tool_calls else "")}
            if delta.reasoning:
                message["reasoning"] = delta.reasoning
            if delta.tool_calls:
                message["tool_calls"] = delta.tool_calls
            choice = {"index": 0, "message": message}
        else:
            choice = {"index": 0, "text": delta.content}
        choice.update(finish_reason=finish_reason, logprobs=self._logprobs(logprobs))
        return self._wrap(self.object, [choice], usage=usage_)

    def chunks(
        self,
        delta: Delta,
        finish_reason: Optional[str] = None,
        logprobs: Optional[List[dict]] = None,
        offset: int = 0,
        marks: Optional[dict] = None,
    ) -> List[dict]:
        """The stream chunks of a delta: its reasoning and content in one (with its draft_marks
        where the request asked), then each tool call as OpenAI streams them (its id and name,
        then its arguments)."""
        if not self.chat:
            if not (delta.content or finish_reason or logprobs):
                return []
            return [
                self._wrap(
                    "text_completion",
                    [
                        {
                            "index": 0,
                            "text": delta.content,
                            "finish_reason": finish_reason,
                            "logprobs": self._logprobs(logprobs, offset),
                        }
                    ],
                )
            ]
        chunks = []
        if delta.content or delta.reasoning or logprobs or (finish_reason and not delta.tool_calls):
            message = {}
            if delta.reasoning:
                message["reasoning"] = delta.reasoning
            if delta.content:
                message["content"] = delta.content
            if marks:
                message["draft_marks"] = marks
            chunks.append(self._chunk(message, None if delta.tool_calls else finish_reason, logprobs))
        for i, call in enumerate(delta.tool_calls):
            head = {
                "index": call["index"],
                "id": call["id"],
                "type": "function",
                "function": {"name": call["function"]["name"], "arguments": ""},
            }
            chunks.append(self._chunk({"tool_calls": [head]}))
            last = i == len(delta.tool_calls) - 1
            arguments = {"index": call["index"], "function": {"arguments": call["function"]["arguments"]}}
            chunks.append(self._chunk({"tool_calls": [arguments]}, finish_reason if last else None))
        return chunks

    def _chunk(self, delta: dict, finish_reason: Optional[str] = None, logprobs=None) -> dict:
        return self._wrap(
            "chat.completion.chunk",
            [
                {
                    "index": 0,
                    "delta": delta,
                    "finish_reason": finish_reason,
                    "logprobs": self._logprobs(logprobs),
                }
            ],
        )

    def first_chunk(self) -> dict:
        return self._chunk({"role": "assistant", "content": ""})

    def usage_chunk(self, usage_: dict) -> dict:
        return self._wrap("chat.completion.chunk" if self.chat else "text_completion", [], usage=usage_)
