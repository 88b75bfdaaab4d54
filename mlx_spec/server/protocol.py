"""The OpenAI API's requests, as far as mlx-spec implements them.

A request is checked field by field before it is queued. Every field `mlx_lm.server` reads is
implemented; a field that changes nothing for this server (what SDKs send by default: `store`,
`metadata`, `user`, ...) is accepted and named in IGNORED with the reason; a field that would
change the reply and is not implemented (`n` > 1, images, `response_format` other than text,
...) is refused with a 400 that names it, never silently ignored."""

import json
from dataclasses import dataclass, field
from typing import Any, Dict, List, Optional


class RequestError(Exception):
    """An OpenAI-style error: HTTP status, message, the offending parameter, a code."""

    def __init__(
        self,
        status: int,
        message: str,
        param: Optional[str] = None,
        code: Optional[str] = None,
        kind: str = "invalid_request_error",
        retry_after: Optional[int] = None,
    ):
        super().__init__(message)
        self.status, self.message, self.param, self.code, self.kind = status, message, param, code, kind
        self.retry_after = retry_after  # seconds, sent as Retry-After (a 503 when busy)

    def body(self) -> dict:
        return {"error": {"message": self.message, "type": self.kind, "param": self.param, "code": self.code}}


# Fields that change nothing for this server, accepted whatever their value, and why.
IGNORED = {
    "user": "no accounts here",
    "safety_identifier": "no accounts here",
    "store": "nothing is stored",
    "metadata": "nothing is stored",
    "service_tier": "one tier",
    "prompt_cache_key": "the prompt cache finds shared prefixes by itself",
    "parallel_tool_calls": "every call the model makes is returned",
    "reasoning_effort": "a thinking model's template takes chat_template_kwargs (enable_thinking)",
    "xtc_threshold": "XTC sampling is off (xtc_probability other than 0 is refused)",
}
# Fields accepted where their value changes nothing (what clients send by default).
NEUTRAL = {
    "n": (1, None),
    "echo": (False, None),
    "suffix": (None,),
    "best_of": (1, None),
    "functions": (None, []),
    "function_call": (None, "none"),
    "response_format": (None, {"type": "text"}),
    "modalities": (None, ["text"]),
    "audio": (None,),
    "web_search_options": (None,),
    "xtc_probability": (0, 0.0, None),
}
COMMON = {
    "model",
    "max_tokens",
    "temperature",
    "top_p",
    "top_k",
    "min_p",
    "seed",
    "stop",
    "stream",
    "stream_options",
    "logprobs",
    "top_logprobs",
    "logit_bias",
    "repetition_penalty",
    "repetition_context_size",
    "presence_penalty",
    "presence_context_size",
    "frequency_penalty",
    "frequency_context_size",
    "prediction",
}
# draft_marks (an mlx-spec extension): a streamed chunk's delta says which of its tokens came
# from accepted drafts, with the speculation's figures so far (the chat page colours them).
CHAT = COMMON | {
    "messages",
    "max_completion_tokens",
    "tools",
    "tool_choice",
    "chat_template_kwargs",
    "draft_marks",
}
COMPLETION = COMMON | {"prompt"}
ROLES = ("system", "developer", "user", "assistant", "tool")
MAX_TOP_LOGPROBS = 20
QUOTED = 60  # characters of a refused value quoted in its error (an agent sends dozens of tools)


@dataclass
class Request:
    """A checked request: what the engine needs, in its words."""

    chat: bool
    stream: bool
    model: Optional[str]
    include_usage: bool
    messages: Optional[List[dict]] = None  # chat: as the chat template takes them
    prompt: Any = None  # completion: text or token ids
    max_tokens: Optional[int] = None  # None: the server's default
    sampling: Dict[str, float] = field(default_factory=dict)  # temp, top_p, top_k, min_p given
    seed: Optional[int] = None
    stop: List[str] = field(default_factory=list)
    tools: Optional[List[dict]] = None  # the functions the template renders
    tool_choice: str = "auto"  # auto, none, required (a call is due)
    chat_template_kwargs: Dict[str, Any] = field(default_factory=dict)
    logprobs: Optional[int] = None  # None: none; else this many alternatives
    penalties: Dict[str, Any] = field(default_factory=dict)  # mlx-lm's make_logits_processors'
    prediction: Optional[str] = None  # Predicted Outputs: the reply expected
    draft_marks: bool = False  # stream chunks carry which tokens were drafted (an mlx-spec extension)


def quoted(value) -> str:
    text = json.dumps(value) if not isinstance(value, str) else repr(value)
    return text if len(text) <= QUOTED else text[:QUOTED] + "..."


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
            if (
                not isinstance(part, dict)
                or part.get("type") != "text"
                or not isinstance(part.get("text"), str)
            ):
                kind = part.get("type") if isinstance(part, dict) else type(part).__name__
                raise RequestError(400, f"{where}: only text content is supported, got {kind!r}", "messages")
            texts.append(part["text"])
        return "".join(texts)
    raise RequestError(400, f"{where}: 'content' must be a string or a list of text parts", "messages")


def _tool_calls(value, where: str) -> List[dict]:
    """An assistant message's tool calls as chat templates take them (arguments as an object)."""
    if not isinstance(value, list):
        raise RequestError(400, f"{where}: 'tool_calls' must be a list", "messages")
    calls = []
    for call in value:
        function = call.get("function") if isinstance(call, dict) else None
        if not isinstance(function, dict) or not isinstance(function.get("name"), str):
            raise RequestError(400, f"{where}: each tool call needs a function with a name", "messages")
        arguments = function.get("arguments", {})
        if isinstance(arguments, str):
            try:
                arguments = json.loads(arguments) if arguments.strip() else {}
            except json.JSONDecodeError:
                raise RequestError(
                    400, f"{where}: a tool call's arguments are not JSON: {quoted(arguments)}", "messages"
                ) from None
        calls.append(
            {
                "id": call.get("id"),
                "type": "function",
                "function": {"name": function["name"], "arguments": arguments},
            }
        )
    return calls


def _messages(value) -> List[dict]:
    if not isinstance(value, list) or not value:
        raise RequestError(400, "'messages' must be a non-empty list", "messages")
    messages = []
    for i, m in enumerate(value):
        where = f"messages[{i}]"
        if not isinstance(m, dict):
            raise RequestError(400, f"{where} must be an object", "messages")
        role = m.get("role")
        if role not in ROLES:
            raise RequestError(
                400, f"{where}: role {role!r} is not supported (one of {', '.join(ROLES)})", "messages"
            )
        allowed = (
            {"role", "content", "name"}
            | ({"tool_calls", "refusal", "reasoning", "reasoning_content"} if role == "assistant" else set())
            | ({"tool_call_id"} if role == "tool" else set())
        )
        extra = sorted(set(m) - allowed)
        if extra:
            raise RequestError(
                400, f"{where}: '{extra[0]}' is not supported for a {role} message", "messages"
            )
        message = {"role": "system" if role == "developer" else role}
        if role == "assistant" and m.get("tool_calls"):
            message["tool_calls"] = _tool_calls(m["tool_calls"], where)
            message["content"] = _text_content(m["content"], where) if m.get("content") is not None else ""
        else:
            message["content"] = _text_content(m.get("content"), where)
        if role == "tool":
            if not isinstance(m.get("tool_call_id"), str):
                raise RequestError(400, f"{where}: a tool message needs its 'tool_call_id'", "messages")
            message["tool_call_id"] = m["tool_call_id"]
        if isinstance(m.get("name"), str):
            message["name"] = m["name"]
        messages.append(message)
    return messages


def _tools(body) -> Optional[List[dict]]:
    tools = body.get("tools")
    if tools is None or tools == []:
        return None
    if not isinstance(tools, list) or not all(
        isinstance(t, dict)
        and t.get("type") == "function"
        and isinstance(t.get("function"), dict)
        and isinstance(t["function"].get("name"), str)
        for t in tools
    ):
        raise RequestError(
            400,
            f'\'tools\' must be a list of {{"type": "function", "function": {{"name", '
            f"...}}}}, got {quoted(tools)}",
            "tools",
        )
    return tools


def _tool_choice(body, tools):
    """(tools the template renders, the mode): none drops them, a named function keeps it alone,
    required and a name make the reply begin with a tool call."""
    choice = body.get("tool_choice")
    if choice is None or choice == "auto":
        return tools, "auto"
    if choice == "none":
        return None, "none"
    if choice == "required":
        if not tools:
            raise RequestError(400, "'tool_choice' is 'required' but no 'tools' are given", "tool_choice")
        return tools, "required"
    name = choice.get("function", {}).get("name") if isinstance(choice, dict) else None
    if not isinstance(name, str):
        raise RequestError(
            400,
            f'\'tool_choice\' must be auto, none, required or {{"type": "function", '
            f'"function": {{"name"}}}}, got {quoted(choice)}',
            "tool_choice",
        )
    named = [t for t in tools or [] if t["function"]["name"] == name]
    if not named:
        raise RequestError(400, f"'tool_choice' names {name!r}, which is not among 'tools'", "tool_choice")
    return named, "required"


def _logprobs(body, chat: bool) -> Optional[int]:
    """None: no logprobs; k: each token's log-probability and k alternatives. Chat: logprobs
    true and top_logprobs; completions: logprobs as a number of alternatives (OpenAI's legacy
    form) or true, as mlx_lm.server takes it, with top_logprobs."""
    logprobs, top = body.get("logprobs"), _number(body, "top_logprobs", 0, MAX_TOP_LOGPROBS, integer=True)
    if logprobs is None or logprobs is False:
        if top:
            raise RequestError(400, "'top_logprobs' needs 'logprobs': true", "top_logprobs")
        return None
    if logprobs is True:
        return top or 0
    if not chat:
        return _number(body, "logprobs", 0, MAX_TOP_LOGPROBS, integer=True)
    raise RequestError(400, "'logprobs' must be true or false", "logprobs")


def _penalties(body) -> Dict[str, Any]:
    """make_logits_processors' arguments, the neutral values left out (repetition_penalty: 0 or
    1 is none, as mlx_lm.server and vLLM take it)."""
    given = {}
    repetition = _number(body, "repetition_penalty", 0)
    if repetition not in (None, 0, 1):
        given["repetition_penalty"] = float(repetition)
    for name in ("presence_penalty", "frequency_penalty"):
        value = _number(body, name, -2, 2)
        if value:
            given[name] = float(value)
    for name in ("repetition_context_size", "presence_context_size", "frequency_context_size"):
        value = _number(body, name, 1, integer=True)
        if value is not None and name.replace("context_size", "penalty") in given:
            given[name] = value
    bias = body.get("logit_bias")
    if bias:
        try:
            given["logit_bias"] = {int(k): float(v) for k, v in bias.items()}
        except (AttributeError, TypeError, ValueError):
            raise RequestError(
                400, f"'logit_bias' must map token ids to numbers, got {quoted(bias)}", "logit_bias"
            ) from None
        if any(not -100 <= v <= 100 for v in given["logit_bias"].values()):
            raise RequestError(400, "'logit_bias' values must be between -100 and 100", "logit_bias")
    return given


def _prediction(body) -> Optional[str]:
    prediction = body.get("prediction")
    if prediction is None:
        return None
    if not isinstance(prediction, dict) or prediction.get("type") != "content" or "content" not in prediction:
        raise RequestError(
            400,
            f'\'prediction\' must be {{"type": "content", "content": ...}}, got {quoted(prediction)}',
            "prediction",
        )
    return _text_content(prediction["content"], "prediction") or None


def _prompt(value):
    if isinstance(value, str):
        return value
    if isinstance(value, list) and len(value) == 1 and isinstance(value[0], str):
        return value[0]
    if (
        isinstance(value, list)
        and value
        and all(isinstance(t, int) and not isinstance(t, bool) and t >= 0 for t in value)
    ):
        return list(value)
    raise RequestError(
        400, "'prompt' must be a string or a list of token ids (one prompt per request)", "prompt"
    )


def parse(body, chat: bool) -> Request:
    """A checked Request from a decoded JSON body; RequestError (400) names what is wrong."""
    if not isinstance(body, dict):
        raise RequestError(400, "the request body must be a JSON object")
    allowed = CHAT if chat else COMPLETION
    for name in body:
        if name in allowed or name in IGNORED:
            continue
        if name in NEUTRAL and body[name] in NEUTRAL[name]:
            continue
        if name in NEUTRAL:
            raise RequestError(400, f"'{name}' = {quoted(body[name])} is not supported by mlx-spec", name)
        raise RequestError(400, f"unsupported field '{name}'", name)
    if chat and "messages" not in body:
        raise RequestError(400, "missing 'messages'", "messages")
    if not chat and "prompt" not in body:
        raise RequestError(400, "missing 'prompt'", "prompt")
    stream = body.get("stream", False)
    if not isinstance(stream, bool):
        raise RequestError(400, "'stream' must be true or false", "stream")
    options = body.get("stream_options")
    if options is not None and (
        not isinstance(options, dict)
        or set(options) - {"include_usage"}
        or not isinstance(options.get("include_usage", False), bool)
    ):
        raise RequestError(
            400, "'stream_options' takes only 'include_usage' (true or false)", "stream_options"
        )
    max_tokens = _number(body, "max_tokens", 1, integer=True)
    if chat and body.get("max_completion_tokens") is not None:
        max_tokens = _number(body, "max_completion_tokens", 1, integer=True)
    sampling = {
        "temp": _number(body, "temperature", 0),
        "top_p": _number(body, "top_p", 0, 1, low_open=True),
        "top_k": _number(body, "top_k", 0, integer=True),
        "min_p": _number(body, "min_p", 0, 1),
    }
    stop = body.get("stop")
    stop = [stop] if isinstance(stop, str) else stop
    if stop is not None and (not isinstance(stop, list) or not all(isinstance(s, str) and s for s in stop)):
        raise RequestError(400, "'stop' must be a non-empty string or a list of them", "stop")
    model = body.get("model")
    if model is not None and not isinstance(model, str):
        raise RequestError(400, "'model' must be a string", "model")
    kwargs = body.get("chat_template_kwargs") or {}
    if not isinstance(kwargs, dict):
        raise RequestError(400, "'chat_template_kwargs' must be an object", "chat_template_kwargs")
    tools, tool_choice = _tool_choice(body, _tools(body)) if chat else (None, "auto")
    draft_marks = body.get("draft_marks", False)
    if not isinstance(draft_marks, bool):
        raise RequestError(400, "'draft_marks' must be true or false", "draft_marks")
    return Request(
        chat=chat,
        stream=stream,
        model=model,
        include_usage=bool((options or {}).get("include_usage")),
        messages=_messages(body["messages"]) if chat else None,
        prompt=None if chat else _prompt(body["prompt"]),
        max_tokens=max_tokens,
        sampling={k: v for k, v in sampling.items() if v is not None},
        seed=_number(body, "seed", 0, 2**63 - 1, integer=True),
        stop=stop or [],
        tools=tools,
        tool_choice=tool_choice,
        chat_template_kwargs=kwargs,
        logprobs=_logprobs(body, chat),
        penalties=_penalties(body),
        prediction=_prediction(body),
        draft_marks=draft_marks,
    )
