"""What clients of mlx_lm.server and OpenAI send, through the real `openai` client against
`mlx-spec serve` on loopback: tool calls, a thinking model's reasoning, logprobs, penalties,
predicted outputs, CORS and the fields SDKs send by default. The model is trained in the test to
call a tool and think (tests/agent_model.py); mlx_lm.server itself, on the same model, gives the
reference parse."""

import http.client
import json
import socket
import subprocess
import sys
import time
import urllib.request

import pytest

from agent_model import agent_model_dir, prompt_of
from test_server import API_KEY, ServerProcess
from tiny import renormalised

openai = pytest.importorskip("openai")

TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "get_weather",
            "description": "The weather in a city",
            "parameters": {
                "type": "object",
                "properties": {"city": {"type": "string"}},
                "required": ["city"],
            },
        },
    }
]
ASK = [{"role": "user", "content": "What is the weather in Paris?"}]
CALL_TEXT = '{"name": "get_weather", "arguments": {"city": "Paris"}}'
CALL = (
    f"<think>\nThe user wants the weather: call the tool.\n</think>\n\n<tool_call>\n{CALL_TEXT}\n</tool_call>"
)
TOOL_TURN = [
    {
        "role": "assistant",
        "content": "",
        "tool_calls": [
            {
                "id": "call_1",
                "type": "function",
                "function": {"name": "get_weather", "arguments": {"city": "Paris"}},
            }
        ],
    },
    {"role": "tool", "tool_call_id": "call_1", "content": "sunny, 21 C"},
]
ANSWER = "<think>\nThe tool said sunny.\n</think>\n\nIt is sunny in Paris, 21 C."
PLAIN = [{"role": "user", "content": "Say something about Paris."}]
CONVERSATIONS = [
    {"messages": ASK, "tools": TOOLS, "reply": CALL},
    {"messages": ASK + TOOL_TURN, "tools": TOOLS, "reply": ANSWER},
    {"messages": ASK, "tools": TOOLS, "suffix": "<tool_call>", "reply": f"\n{CALL_TEXT}\n</tool_call>"},
    {
        "messages": PLAIN,
        "template": {"enable_thinking": False},
        "reply": "Paris is the capital of France. Paris is the capital of France, and Paris is lovely.",
    },
]
MODEL = "agent"


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return agent_model_dir(tmp_path_factory.mktemp("agent") / "model", CONVERSATIONS)


@pytest.fixture(scope="module")
def server(model_dir):
    process = ServerProcess(
        "--model",
        str(model_dir),
        "--draft",
        "lookup",
        "--api-key",
        API_KEY,
        "--allowed-origins",
        "http://good.example",
    )
    try:
        yield process
    finally:
        process.stop()


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def mlx_lm_server(model_dir):
    """mlx_lm.server on the same model: the reference for what a client gets back."""
    port = free_port()
    process = subprocess.Popen(
        [sys.executable, "-m", "mlx_lm.server", "--model", str(model_dir), "--port", str(port)],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    try:
        deadline = time.time() + 120
        while True:
            try:
                urllib.request.urlopen(f"http://127.0.0.1:{port}/v1/models", timeout=5).read()
                break
            except OSError:
                if time.time() > deadline or process.poll() is not None:
                    raise AssertionError("mlx_lm.server did not start") from None
                time.sleep(0.5)
        yield openai.OpenAI(
            base_url=f"http://127.0.0.1:{port}/v1", api_key="none", max_retries=0, timeout=120
        )
    finally:
        process.terminate()
        process.wait(timeout=30)


def message_of(reply) -> dict:
    """A non-streamed reply's message as a client reads it (tool arguments parsed)."""
    message = reply.choices[0].message
    calls = [(c.function.name, json.loads(c.function.arguments)) for c in message.tool_calls or []]
    return {
        "content": message.content or None,
        "reasoning": (message.model_extra or {}).get("reasoning"),
        "tool_calls": calls,
        "finish_reason": reply.choices[0].finish_reason,
    }


def streamed_message(chunks) -> dict:
    """The same, accumulated from a stream's deltas as an OpenAI client accumulates them."""
    content, reasoning, calls, finish = "", "", {}, None
    for chunk in chunks:
        if not chunk.choices:
            continue
        choice = chunk.choices[0]
        delta = choice.delta
        content += delta.content or ""
        reasoning += (delta.model_extra or {}).get("reasoning") or ""
        for call in delta.tool_calls or []:
            entry = calls.setdefault(call.index, {"id": None, "name": "", "arguments": ""})
            entry["id"] = call.id or entry["id"]
            entry["name"] += (call.function.name or "") if call.function else ""
            entry["arguments"] += (call.function.arguments or "") if call.function else ""
        finish = choice.finish_reason or finish
    assert all(c["id"] for c in calls.values())
    return {
        "content": content or None,
        "reasoning": reasoning or None,
        "finish_reason": finish,
        "tool_calls": [(c["name"], json.loads(c["arguments"])) for _, c in sorted(calls.items())],
    }


def test_a_tool_round_trip_streamed_and_whole_as_mlx_lm_server_parses_it(server, mlx_lm_server):
    client = server.client()
    first = client.chat.completions.create(model=MODEL, messages=ASK, tools=TOOLS, max_tokens=60)
    # The text between the thinking and the call stays content, as mlx_lm.server leaves it.
    assert message_of(first) == {
        "content": "\n\n",
        "reasoning": "\nThe user wants the weather: call the tool.\n",
        "tool_calls": [("get_weather", {"city": "Paris"})],
        "finish_reason": "tool_calls",
    }
    assert streamed_message(
        client.chat.completions.create(model=MODEL, messages=ASK, tools=TOOLS, max_tokens=60, stream=True)
    ) == message_of(first)
    # The call goes back as the assistant's turn, its result as a tool message.
    call = first.choices[0].message.tool_calls[0]
    history = ASK + [
        {
            "role": "assistant",
            "content": None,
            "tool_calls": [
                {
                    "id": call.id,
                    "type": "function",
                    "function": {"name": call.function.name, "arguments": call.function.arguments},
                }
            ],
        },
        {"role": "tool", "tool_call_id": call.id, "content": "sunny, 21 C"},
    ]
    second = client.chat.completions.create(model=MODEL, messages=history, tools=TOOLS, max_tokens=60)
    assert message_of(second) == {
        "content": "\n\nIt is sunny in Paris, 21 C.",
        "reasoning": "\nThe tool said sunny.\n",
        "tool_calls": [],
        "finish_reason": "stop",
    }
    assert streamed_message(
        client.chat.completions.create(model=MODEL, messages=history, tools=TOOLS, max_tokens=60, stream=True)
    ) == message_of(second)
    # mlx_lm.server parses the same text into the same message.
    for messages in (ASK, history):
        theirs = mlx_lm_server.chat.completions.create(
            model="default_model", messages=messages, tools=TOOLS, max_tokens=60
        )
        ours = client.chat.completions.create(model=MODEL, messages=messages, tools=TOOLS, max_tokens=60)
        assert message_of(ours) == message_of(theirs)


def test_tool_choice_and_chat_template_kwargs(server):
    client = server.client()
    # required: the reply begins with a tool call (its marker ends the prompt).
    forced = client.chat.completions.create(
        model=MODEL, messages=ASK, tools=TOOLS, max_tokens=60, tool_choice="required"
    )
    assert message_of(forced)["tool_calls"] == [("get_weather", {"city": "Paris"})]
    named = client.chat.completions.create(
        model=MODEL,
        messages=ASK,
        tools=TOOLS,
        max_tokens=60,
        tool_choice={"type": "function", "function": {"name": "get_weather"}},
    )
    assert message_of(named) == message_of(forced)
    # none: the template renders no tools and nothing is parsed as a call.
    plain = client.chat.completions.create(
        model=MODEL, messages=ASK, tools=TOOLS, max_tokens=20, tool_choice="none"
    )
    auto = client.chat.completions.create(model=MODEL, messages=ASK, tools=TOOLS, max_tokens=20)
    assert not plain.choices[0].message.tool_calls and plain.usage.prompt_tokens < auto.usage.prompt_tokens
    # enable_thinking false reaches the template: no reasoning, the answer as content.
    quiet = client.chat.completions.create(
        model=MODEL,
        messages=PLAIN,
        max_tokens=60,
        extra_body={"chat_template_kwargs": {"enable_thinking": False}},
    )
    assert message_of(quiet) == {
        "content": CONVERSATIONS[3]["reply"],
        "reasoning": None,
        "tool_calls": [],
        "finish_reason": "stop",
    }


def test_logprobs_equal_mlx_lms_whole_streamed_and_completions(server, model_dir):
    import mlx.core as mx
    import mlx_lm

    model, tokenizer = mlx_lm.load(str(model_dir))
    prompt = prompt_of(tokenizer, CONVERSATIONS[3])
    reference = [r for r in mlx_lm.stream_generate(model, tokenizer, prompt, max_tokens=12)]
    client = server.client()
    whole = client.chat.completions.create(
        model=MODEL,
        messages=PLAIN,
        max_tokens=12,
        logprobs=True,
        top_logprobs=3,
        extra_body={"chat_template_kwargs": {"enable_thinking": False}},
    )
    entries = whole.choices[0].logprobs.content
    chunks = client.chat.completions.create(
        model=MODEL,
        messages=PLAIN,
        max_tokens=12,
        logprobs=True,
        top_logprobs=3,
        stream=True,
        extra_body={"chat_template_kwargs": {"enable_thinking": False}},
    )
    streamed = [
        e for c in chunks if c.choices and c.choices[0].logprobs for e in c.choices[0].logprobs.content
    ]
    assert len(entries) == len(streamed) == 12
    for ours, theirs, other in zip(entries, reference, streamed):
        assert ours.token == tokenizer.decode([theirs.token]) and bytes(ours.bytes) == ours.token.encode()
        assert abs(ours.logprob - renormalised(theirs.logprobs)[theirs.token].item()) < 1e-4
        assert [t.token for t in ours.top_logprobs] == [
            tokenizer.decode([i]) for i in mx.argsort(-theirs.logprobs)[:3].tolist()
        ]
        assert (other.token, other.logprob) == (ours.token, ours.logprob)
    completion = client.completions.create(model=MODEL, prompt=prompt, max_tokens=6, logprobs=2)
    legacy = completion.choices[0].logprobs
    assert len(legacy.tokens) == 6 and all(len(top) == 2 for top in legacy.top_logprobs)
    assert [
        abs(a - renormalised(r.logprobs)[r.token].item()) < 1e-4
        for a, r in zip(legacy.token_logprobs, reference)
    ] == [True] * 6
    assert legacy.text_offset[0] == 0 and "".join(legacy.tokens) == completion.choices[0].text


def test_penalties_equal_mlx_lm_with_its_processors(server, model_dir):
    import mlx.core as mx
    import mlx_lm
    from mlx_lm.generate import generate_step
    from mlx_lm.sample_utils import make_logits_processors

    model, tokenizer = mlx_lm.load(str(model_dir))
    prompt = prompt_of(tokenizer, CONVERSATIONS[3])
    # The trained reply's first token barred: the text changes whatever the trained weights came
    # out as (a memorized reply can hold its tokens by margins no mild penalty moves).
    barred = tokenizer.encode(CONVERSATIONS[3]["reply"], add_special_tokens=False)[0]
    penalties = dict(
        repetition_penalty=1.5, presence_penalty=0.8, frequency_penalty=0.5, logit_bias={str(barred): -100.0}
    )
    processors = make_logits_processors(
        logit_bias={barred: -100.0}, repetition_penalty=1.5, presence_penalty=0.8, frequency_penalty=0.5
    )
    reference = tokenizer.decode(
        [
            int(t)
            for t, _ in generate_step(mx.array(prompt), model, max_tokens=30, logits_processors=processors)
        ]
    )
    plain = CONVERSATIONS[3]["reply"]
    reply = server.client().chat.completions.create(
        model=MODEL,
        messages=PLAIN,
        max_tokens=30,
        extra_body={
            "chat_template_kwargs": {"enable_thinking": False},
            **{k: v for k, v in penalties.items() if k != "frequency_penalty"},
        },
        frequency_penalty=0.5,
    )
    assert reply.choices[0].message.content == reference != plain[: len(reference)]


def test_a_prediction_drafts_and_is_reported(server):
    client = server.client()
    reply = CONVERSATIONS[3]["reply"]
    kwargs = dict(
        model=MODEL,
        messages=PLAIN,
        max_tokens=60,
        extra_body={"chat_template_kwargs": {"enable_thinking": False}},
    )
    plain = client.chat.completions.create(**kwargs)
    predicted = client.chat.completions.create(prediction={"type": "content", "content": reply}, **kwargs)
    assert predicted.choices[0].message.content == plain.choices[0].message.content == reply
    details = predicted.usage.completion_tokens_details
    assert details.accepted_prediction_tokens == predicted.usage.completion_tokens
    assert details.rejected_prediction_tokens == 0
    # how much it drafts is the adaptive policy's choice (it times passes): only that it drafted and was kept
    speculative = predicted.usage.model_extra["speculative"]
    assert speculative["accepted_drafts"] > 0
    wrong = client.chat.completions.create(
        prediction={"type": "content", "content": "Rome is in Italy."}, **kwargs
    )
    assert wrong.choices[0].message.content == reply
    assert wrong.usage.completion_tokens_details.rejected_prediction_tokens > 0


def test_cors_preflight_from_an_allowed_origin_only(server):
    def preflight(origin):
        connection = http.client.HTTPConnection("127.0.0.1", server.port, timeout=30)
        connection.request(
            "OPTIONS",
            "/v1/chat/completions",
            headers={
                "Origin": origin,
                "Access-Control-Request-Method": "POST",
                "Access-Control-Request-Headers": "authorization, content-type",
            },
        )
        response = connection.getresponse()
        response.read()
        connection.close()
        return response.status, dict(response.getheaders())

    status, headers = preflight("http://good.example")
    assert status == 204 and headers["Access-Control-Allow-Origin"] == "http://good.example"
    assert (
        "POST" in headers["Access-Control-Allow-Methods"]
        and "authorization" in headers["Access-Control-Allow-Headers"]
    )
    status, headers = preflight("http://evil.example")
    assert status == 403 and "Access-Control-Allow-Origin" not in headers
    connection = http.client.HTTPConnection("127.0.0.1", server.port, timeout=60)
    for origin, allowed in (("http://good.example", True), ("http://evil.example", False)):
        connection.request(
            "POST",
            "/v1/chat/completions",
            body=json.dumps({"messages": PLAIN, "max_tokens": 2}),
            headers={"Origin": origin, "Authorization": f"Bearer {API_KEY}"},
        )
        response = connection.getresponse()
        response.read()
        assert (
            response.status == 200
            and ("Access-Control-Allow-Origin" in dict(response.getheaders())) == allowed
        )


def test_what_sdks_send_by_default_is_accepted(server):
    client = server.client()
    reply = client.chat.completions.create(
        model="gpt-4o",
        messages=PLAIN,
        max_tokens=4,
        store=False,
        metadata={},
        service_tier="auto",
        modalities=["text"],
        reasoning_effort="low",
        prediction=None,
        parallel_tool_calls=True,
        tools=[],
        user="u1",
        n=1,
        response_format={"type": "text"},
        frequency_penalty=0,
        presence_penalty=0,
        logit_bias={},
        extra_body={"repetition_penalty": 1.0},
    )
    assert reply.model == server.client().models.list().data[0].id  # any name: the served model
    # A refused list of dozens of tools is quoted, not echoed whole.
    status, body = server.http(
        "POST",
        "/v1/chat/completions",
        {"messages": PLAIN, "tools": [{"type": "function", "function": {"description": "x" * 200}}] * 40},
    )
    assert status == 400 and body["error"]["param"] == "tools" and len(body["error"]["message"]) < 300
    for field, value in (
        ("n", 2),
        ("modalities", ["text", "audio"]),
        ("response_format", {"type": "json_object"}),
    ):
        status, body = server.http("POST", "/v1/chat/completions", {"messages": PLAIN, field: value})
        assert status == 400 and body["error"]["param"] == field


def test_serve_refuses_chat_template_args_that_are_not_a_json_object():
    for value in ("{bad", "[1]"):
        result = subprocess.run(
            [sys.executable, "-m", "mlx_spec.cli", "serve", "--chat-template-args", value],
            capture_output=True,
            text=True,
            timeout=120,
        )
        assert (
            result.returncode == 2
            and "--chat-template-args" in result.stderr
            and "Traceback" not in result.stderr
        )


# --- Anthropic's Messages API (Claude Code's) --------------------------------------------------

anthropic = pytest.importorskip("anthropic")
ANTHROPIC_TOOLS = [
    {
        "name": "get_weather",
        "description": "The weather in a city",
        "input_schema": TOOLS[0]["function"]["parameters"],
    }
]


def anthropic_client(server, key=API_KEY):
    return anthropic.Anthropic(
        base_url=f"http://127.0.0.1:{server.port}", api_key=key, max_retries=0, timeout=120
    )


def blocks_of(message) -> list:
    return [
        (b.type, b.text if b.type == "text" else b.thinking if b.type == "thinking" else (b.name, b.input))
        for b in message.content
    ]


def test_messages_tool_use_round_trip_whole_and_streamed(server):
    client = anthropic_client(server)
    first = client.messages.create(
        model="claude-sonnet-4-5", max_tokens=60, tools=ANTHROPIC_TOOLS, messages=ASK
    )
    assert first.stop_reason == "tool_use" and first.role == "assistant" and first.id.startswith("msg_")
    assert blocks_of(first) == [
        ("thinking", "\nThe user wants the weather: call the tool.\n"),
        ("text", "\n\n"),
        ("tool_use", ("get_weather", {"city": "Paris"})),
    ]
    with client.messages.stream(
        model="claude-sonnet-4-5", max_tokens=60, tools=ANTHROPIC_TOOLS, messages=ASK
    ) as stream:
        streamed = stream.get_final_message()
    assert blocks_of(streamed) == blocks_of(first) and streamed.stop_reason == "tool_use"
    use = first.content[-1]
    # The call goes back as the assistant's turn (its tool_use block, as the training turn has no
    # text beside it), its result as a tool_result block.
    history = ASK + [
        {"role": "assistant", "content": [use.model_dump(exclude_none=True)]},
        {
            "role": "user",
            "content": [{"type": "tool_result", "tool_use_id": use.id, "content": "sunny, 21 C"}],
        },
    ]
    second = client.messages.create(
        model="claude-sonnet-4-5", max_tokens=60, tools=ANTHROPIC_TOOLS, messages=history
    )
    assert blocks_of(second) == [
        ("thinking", "\nThe tool said sunny.\n"),
        ("text", "\n\nIt is sunny in Paris, 21 C."),
    ]
    assert second.stop_reason == "end_turn" and second.usage.cache_read_input_tokens > 0
    # The OpenAI route writes the same reply.
    openai_reply = server.client().chat.completions.create(
        model=MODEL, messages=ASK + TOOL_TURN, tools=TOOLS, max_tokens=60
    )
    assert message_of(openai_reply)["content"] == second.content[-1].text


def test_messages_text_equals_the_openai_route_and_counts_tokens(server):
    client = anthropic_client(server)
    kwargs = dict(model="any", max_tokens=60, messages=PLAIN, thinking={"type": "disabled"})
    whole = client.messages.create(**kwargs)
    assert blocks_of(whole) == [("text", CONVERSATIONS[3]["reply"])] and whole.stop_reason == "end_turn"
    with client.messages.stream(**kwargs) as stream:
        text = "".join(stream.text_stream)
        final = stream.get_final_message()
    assert text == CONVERSATIONS[3]["reply"] and final.usage.output_tokens == whole.usage.output_tokens
    counted = client.messages.count_tokens(model="any", messages=PLAIN, thinking={"type": "disabled"})
    assert counted.input_tokens == whole.usage.input_tokens + whole.usage.cache_read_input_tokens
    stopped = client.messages.create(**dict(kwargs, stop_sequences=["capital"]))
    assert stopped.stop_reason == "stop_sequence" and stopped.stop_sequence == "capital"
    assert stopped.content[0].text == "Paris is the "
    assert client.messages.create(**dict(kwargs, max_tokens=3)).stop_reason == "max_tokens"


MALFORMED = [
    {"messages": PLAIN},  # no max_tokens
    {"max_tokens": 5},  # no messages
    {"max_tokens": 5, "messages": "hi"},
    {"max_tokens": 5, "messages": [{"role": "system", "content": "x"}]},
    {"max_tokens": 5, "messages": [{"role": "user", "content": [{"type": "image", "source": {}}]}]},
    {"max_tokens": 0, "messages": PLAIN},
    {"max_tokens": 5, "messages": PLAIN, "temperature": 3},
    {
        "max_tokens": 5,
        "messages": PLAIN,
        "tool_choice": {"type": "tool", "name": "nope"},
        "tools": ANTHROPIC_TOOLS,
    },
    {"max_tokens": 5, "messages": PLAIN, "frobnicate": True},
    {"max_tokens": 5, "messages": PLAIN, "thinking": {"type": "sometimes"}},
]


def test_malformed_messages_get_anthropic_errors_and_the_server_serves_on(server):
    for body in MALFORMED:
        status, reply = server.http("POST", "/v1/messages", body, headers={"x-api-key": API_KEY})
        assert 400 <= status < 500 and reply["type"] == "error", (body, reply)
        assert reply["error"]["type"] == "invalid_request_error" and reply["error"]["message"], reply
    with pytest.raises(anthropic.AuthenticationError):
        anthropic_client(server, key="wrong").messages.create(model="m", max_tokens=2, messages=PLAIN)
    assert anthropic_client(server).messages.create(model="m", max_tokens=2, messages=PLAIN).content
