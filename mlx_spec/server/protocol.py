"""The OpenAI API's requests and responses, as far as mlx-spec implements them.

A request is checked field by field before it is queued: a field mlx-spec does not implement
(`n` > 1, `tools`, `logprobs`, ...) is refused with a 400 that names it, never silently ignored.
"""

import time
import uuid
from dataclasses import dataclass, field
from typing import Any, Dict, List, Optional


class RequestError(Exception):
    """An OpenAI-style error: HTTP status, message, the offending parameter, a code."""

    def __init__(self, status: int, message: str, param: Optional[str] = None, code: Optional[str] = None,
                 kind: str = "invalid_request_error", retry_after: Optional[int] = None):
        super().__init__(message)
        self.status, self.message, self.param, self.code, self.kind = status, message, param, code, kind
        self.retry_after = retry_after   # seconds, sent as Retry-After (a 503 when busy)

    def body(self) -> dict:
        return {"error": {"message": self.message, "type": self.kind, "param": self.param, "code": self.code}}


# Fields accepted as they are; a field that changes nothing at the value given is accepted too.
COMMON = {"model", "max_tokens", "temperature", "top_p", "top_k", "min_p", "seed", "stop", "stream",
          "stream_options", "user"}
CHAT = COMMON | {"messages", "max_completion_tokens"}
COMPLETION = COMMON | {"prompt"}
# Not implemented, but harmless at these values (what clients send by default).
NEUTRAL = {"n": (1,), "logprobs": (False, None), "top_logprobs": (0, None), "frequency_penalty": (0, None),
           "presence_penalty": (0, None), "logit_bias": (None,), "tools": (None,), "tool_choice": (None, "none"),
           "functions": (None,), "function_call": (None, "none"), "parallel_tool_calls": (None,),
           "response_format": (None, {"type": "text"}), "echo": (False, None), "suffix": (None,),
           "best_of": (1, None)}
ROLES = ("system", "developer", "user", "assistant")


@dataclass
class Request:
    """A checked request: what the engine needs, in its words."""
    chat: bool
    stream: bool
    model: Optional[str]
    include_usage: bool
    messages: Optional[List[Dict[str, str]]] = None   # chat
    prompt: Any = None                                # completion: text or token ids
    max_tokens: Optional[int] = None                  # None: the server's default
    sampling: Dict[str, float] = field(default_factory=dict)   # temp, top_p, top_k, min_p given
    seed: Optional[int] = None
    stop: List[str] = field(default_factory=list)


def _number(body, name, low=None, high=None, integer=False, low_open=False):
    value = body.get(name)
    if value is None:
        return None
    kinds = (int,) if integer else (int, float)
    if isinstance(value, bool) or not isinstance(value, kinds):
        raise RequestError(400, f"'{name}' must be {'an integer' if integer else 'a number'}", name)
    if low is not None and (value <= low if low_open else value < low):
        raise RequestError(400, f"'{name}' must be {'>' if low_open else '>='} {low}, got {value}", name)
    if high is not None and value > high:
        raise RequestError(400, f"'{name}' must be <= {high}, got {value}", name)
    return value


def _text_content(content, where: str) -> str:
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        texts = []
        for part in content:
            if not isinstance(part, dict) or part.get("type") != "text" or not isinstance(part.get("text"), str):
                kind = part.get("type") if isinstance(part, dict) else type(part).__name__
                raise RequestError(400, f"{where}: only text content is supported, got {kind!r}", "messages")
            texts.append(part["text"])
        return "".join(texts)
    raise RequestError(400, f"{where}: 'content' must be a string or a list of text parts", "messages")


def _messages(value) -> List[Dict[str, str]]:
    if not isinstance(value, list) or not value:
        raise RequestError(400, "'messages' must be a non-empty list", "messages")
    messages = []
    for i, m in enumerate(value):
        where = f"messages[{i}]"
        if not isinstance(m, dict):
            raise RequestError(400, f"{where} must be an object", "messages")
        role = m.get("role")
        if role not in ROLES:
            raise RequestError(400, f"{where}: role {role!r} is not supported (one of {', '.join(ROLES)})",
                               "messages")
        extra = sorted(set(m) - {"role", "content", "name"})
        if extra:
            raise RequestError(400, f"{where}: '{extra[0]}' is not supported", "messages")
        messages.append({"role": "system" if role == "developer" else role,
                         "content": _text_content(m.get("content"), where)})
    return messages


def _prompt(value):
    if isinstance(value, str):
        return value
    if isinstance(value, list) and len(value) == 1 and isinstance(value[0], str):
        return value[0]
    if (isinstance(value, list) and value
            and all(isinstance(t, int) and not isinstance(t, bool) and t >= 0 for t in value)):
        return list(value)
    raise RequestError(400, "'prompt' must be a string or a list of token ids (one prompt per request)",
                       "prompt")


def parse(body, chat: bool) -> Request:
    """A checked Request from a decoded JSON body; RequestError (400) names what is wrong."""
    if not isinstance(body, dict):
        raise RequestError(400, "the request body must be a JSON object")
    allowed = CHAT if chat else COMPLETION
    for name in body:
        if name in allowed:
            continue
        if name in NEUTRAL:
            if body[name] in NEUTRAL[name]:
                continue
            raise RequestError(400, f"'{name}' = {body[name]!r} is not supported by mlx-spec", name)
        raise RequestError(400, f"unsupported field '{name}'", name)
    if chat and "messages" not in body:
        raise RequestError(400, "missing 'messages'", "messages")
    if not chat and "prompt" not in body:
        raise RequestError(400, "missing 'prompt'", "prompt")
    stream = body.get("stream", False)
    if not isinstance(stream, bool):
        raise RequestError(400, "'stream' must be true or false", "stream")
    options = body.get("stream_options")
    if options is not None and (not isinstance(options, dict) or set(options) - {"include_usage"}
                                or not isinstance(options.get("include_usage", False), bool)):
        raise RequestError(400, "'stream_options' takes only 'include_usage' (true or false)", "stream_options")
    max_tokens = _number(body, "max_tokens", 1, integer=True)
    if chat and body.get("max_completion_tokens") is not None:
        max_tokens = _number(body, "max_completion_tokens", 1, integer=True)
    sampling = {"temp": _number(body, "temperature", 0), "top_p": _number(body, "top_p", 0, 1, low_open=True),
                "top_k": _number(body, "top_k", 0, integer=True), "min_p": _number(body, "min_p", 0, 1)}
    stop = body.get("stop")
    stop = [stop] if isinstance(stop, str) else stop
    if stop is not None and (not isinstance(stop, list) or not all(isinstance(s, str) and s for s in stop)):
        raise RequestError(400, "'stop' must be a non-empty string or a list of them", "stop")
    model = body.get("model")
    if model is not None and not isinstance(model, str):
        raise RequestError(400, "'model' must be a string", "model")
    return Request(chat=chat, stream=stream, model=model, include_usage=bool((options or {}).get("include_usage")),
                   messages=_messages(body["messages"]) if chat else None,
                   prompt=None if chat else _prompt(body["prompt"]), max_tokens=max_tokens,
                   sampling={k: v for k, v in sampling.items() if v is not None},
                   seed=_number(body, "seed", 0, 2**63 - 1, integer=True), stop=stop or [])


def usage(stats, method: str, sampled: bool) -> dict:
    """OpenAI's usage, with the prompt tokens the cache held and what speculation did (and the
    seed that repeats a sampled reply)."""
    return {"prompt_tokens": stats.prompt_tokens, "completion_tokens": stats.generated_tokens,
            "total_tokens": stats.prompt_tokens + stats.generated_tokens,
            "prompt_tokens_details": {"cached_tokens": stats.prompt_cached},
            "speculative": {"method": method, "steps": stats.steps, "tokens_per_step": round(stats.tokens_per_step, 4),
                            "acceptance_rate": round(stats.acceptance_rate, 4),
                            "drafts_verified": stats.verified_drafts, "plain_steps": stats.plain_steps,
                            "seed": stats.seed if sampled else None}}


class Reply:
    """The response objects of one request, whole or as stream chunks."""

    def __init__(self, request: Request, model: str):
        self.chat, self.model = request.chat, model
        self.id = ("chatcmpl-" if self.chat else "cmpl-") + uuid.uuid4().hex
        self.created = int(time.time())
        self.object = "chat.completion" if self.chat else "text_completion"

    def _wrap(self, obj: str, choices: list, **extra) -> dict:
        return {"id": self.id, "object": obj, "created": self.created, "model": self.model,
                "choices": choices, **extra}

    def whole(self, text: str, finish_reason: str, usage_: dict) -> dict:
        choice = ({"index": 0, "message": {"role": "assistant", "content": text}} if self.chat
                  else {"index": 0, "text": text})
        choice.update(finish_reason=finish_reason, logprobs=None)
        return self._wrap(self.object, [choice], usage=usage_)

    def chunk(self, text: Optional[str] = None, finish_reason: Optional[str] = None, first: bool = False) -> dict:
        if self.chat:
            delta = {"role": "assistant", "content": ""} if first else ({"content": text} if text else {})
            choice = {"index": 0, "delta": delta, "finish_reason": finish_reason, "logprobs": None}
            return self._wrap("chat.completion.chunk", [choice])
        return self._wrap("text_completion", [{"index": 0, "text": text or "", "finish_reason": finish_reason,
                                              "logprobs": None}])

    def usage_chunk(self, usage_: dict) -> dict:
        return self._wrap("chat.completion.chunk" if self.chat else "text_completion", [], usage=usage_)
