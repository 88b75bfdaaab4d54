"""`mlx-spec serve` as a real process on a free loopback port, spoken to by the `openai` client
and by raw HTTP: the embedded default model with its shipped EAGLE-3 drafter."""

import http.client
import json
import re
import signal
import socket
import subprocess
import sys
import threading
import time

import pytest

openai = pytest.importorskip("openai")  # a dev extra: `make test` installs it

API_KEY = "sk-test"
CACHE_BYTES = 24 << 20  # a few conversations of the default model: the load test evicts


class ServerProcess:
    def __init__(self, *args):
        if "--prompt-cache-dir" not in args:  # a test's models are not the user's
            args = (*args, "--prompt-cache-dir", "off")
        self.process = subprocess.Popen(
            [sys.executable, "-m", "mlx_spec.cli", "serve", "--port", "0", *args],
            stderr=subprocess.PIPE,
            text=True,
        )
        self.lines = []
        deadline = time.time() + 120
        while time.time() < deadline:
            line = self.process.stderr.readline()
            if not line:
                break
            self.lines.append(line)
            match = re.search(r"on http://127\.0\.0\.1:(\d+)/v1", line)
            if match:
                self.port = int(match.group(1))
                break
        else:
            self.stop()
            raise AssertionError("the server did not start: " + "".join(self.lines))
        if not hasattr(self, "port"):
            raise AssertionError("the server did not start: " + "".join(self.lines))
        self.reader = threading.Thread(target=self._read, daemon=True)
        self.reader.start()

    def _read(self):
        for line in self.process.stderr:
            self.lines.append(line)

    def stop(self, sig=signal.SIGTERM) -> int:
        if self.process.poll() is None:
            self.process.send_signal(sig)
            try:
                self.process.wait(timeout=20)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait()
        return self.process.returncode

    def client(self, **kwargs):
        return openai.OpenAI(
            base_url=f"http://127.0.0.1:{self.port}/v1", api_key=API_KEY, max_retries=0, timeout=120, **kwargs
        )

    def http(self, method, path, body=None, headers=None, raw=None):
        """(status, decoded JSON) of one raw request."""
        connection = http.client.HTTPConnection("127.0.0.1", self.port, timeout=120)
        data = raw if raw is not None else (json.dumps(body).encode() if body is not None else None)
        connection.request(
            method, path, body=data, headers={"Authorization": f"Bearer {API_KEY}", **(headers or {})}
        )
        response = connection.getresponse()
        payload = response.read()
        connection.close()
        return response.status, json.loads(payload)

    def rss_mb(self) -> float:
        with open(f"/proc/{self.process.pid}/status") as f:
            return int(next(line for line in f if line.startswith("VmRSS")).split()[1]) / 1024


@pytest.fixture(scope="module")
def server():
    process = ServerProcess(
        "--draft",
        "eagle",
        "--api-key",
        API_KEY,
        "--prompt-cache-bytes",
        str(CACHE_BYTES),
        "--max-body-bytes",
        "65536",
    )
    try:
        yield process
    finally:
        process.stop()


def cli_generate(prompt, *args):
    result = subprocess.run(
        [sys.executable, "-m", "mlx_spec.cli", "generate", prompt, "--json", *args],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert result.returncode == 0, result.stderr
    return json.loads(result.stdout)


def chat(client, content, **kwargs):
    reply = client.chat.completions.create(
        model="SmolLM2-135M-Instruct", messages=[{"role": "user", "content": content}], **kwargs
    )
    return reply


def streamed(client, content, **kwargs):
    chunks = list(
        client.chat.completions.create(
            model="SmolLM2-135M-Instruct",
            messages=[{"role": "user", "content": content}],
            stream=True,
            stream_options={"include_usage": True},
            **kwargs,
        )
    )
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    finish = [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason]
    return text, finish, chunks[-1].usage


def test_outputs_equal_mlx_spec_generate(server):
    """Greedy and seeded sampling, streamed and whole, as `mlx-spec generate` prints them."""
    client = server.client()
    prompt = "Name three rivers in Europe."
    greedy = cli_generate(prompt, "-m", "24", "--draft", "none")
    sampled = cli_generate(prompt, "-m", "24", "--draft", "none", "--temp", "0.8", "--seed", "11")
    whole = chat(client, prompt, max_tokens=24)
    assert whole.choices[0].message.content == greedy["text"]
    assert whole.usage.completion_tokens == greedy["stats"]["generated_tokens"]
    assert whole.usage.model_extra["speculative"]["method"] == "eagle"
    assert whole.usage.model_extra["speculative"]["seed"] is None  # greedy: no seed to repeat
    text, finish, usage = streamed(client, prompt, max_tokens=24)
    assert text == greedy["text"] and finish == [whole.choices[0].finish_reason]
    assert usage.prompt_tokens == greedy["stats"]["prompt_tokens"]
    seeded = chat(client, prompt, max_tokens=24, temperature=0.8, seed=11)
    assert seeded.choices[0].message.content == sampled["text"]
    assert seeded.usage.model_extra["speculative"]["seed"] == 11
    assert streamed(client, prompt, max_tokens=24, temperature=0.8, seed=11)[0] == sampled["text"]
    completion = client.completions.create(
        model="SmolLM2-135M-Instruct", prompt="The capital of France is", max_tokens=12
    )
    raw = cli_generate("The capital of France is", "-m", "12", "--draft", "none", "--no-chat-template")
    assert completion.choices[0].text == raw["text"]
    pieces = client.completions.create(
        model="SmolLM2-135M-Instruct", prompt="The capital of France is", max_tokens=12, stream=True
    )
    assert "".join(c.choices[0].text for c in pieces if c.choices) == raw["text"]


def test_a_second_turn_reports_cached_tokens(server):
    client = server.client()
    messages = [{"role": "user", "content": "Write a haiku about rain."}]
    first = client.chat.completions.create(model="SmolLM2-135M-Instruct", messages=messages, max_tokens=20)
    messages += [
        {"role": "assistant", "content": first.choices[0].message.content},
        {"role": "user", "content": "Now one about snow."},
    ]
    second = client.chat.completions.create(model="SmolLM2-135M-Instruct", messages=messages, max_tokens=20)
    cached = second.usage.prompt_tokens_details.cached_tokens
    assert first.usage.prompt_tokens < cached < second.usage.prompt_tokens
    assert client.models.list().data[0].id == "SmolLM2-135M-Instruct"


BAD = [
    ({"raw": b"{not json"}, 400, None),
    ({"body": [1, 2]}, 400, None),
    ({"body": {"model": "SmolLM2-135M-Instruct"}}, 400, "messages"),
    ({"body": {"messages": "hi"}}, 400, "messages"),
    ({"body": {"messages": [{"role": "user", "content": "hi"}], "temperature": "hot"}}, 400, "temperature"),
    ({"body": {"messages": [{"role": "user", "content": "hi"}], "temperature": -1}}, 400, "temperature"),
    ({"body": {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 100000}}, 400, "max_tokens"),
    ({"body": {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 0}}, 400, "max_tokens"),
    ({"body": {"messages": [{"role": "user", "content": "hi"}], "n": 2}}, 400, "n"),
    (
        {"body": {"messages": [{"role": "user", "content": "hi"}], "tools": [{"type": "function"}]}},
        400,
        "tools",
    ),
    ({"body": {"messages": [{"role": "user", "content": "hi"}], "frobnicate": 1}}, 400, "frobnicate"),
    ({"body": {"messages": [{"role": "tool", "content": "hi"}]}}, 400, "messages"),
    ({"body": {"messages": [{"role": "user", "content": "hi"}], "logprobs": "yes"}}, 400, "logprobs"),
    (
        {"body": {"messages": [{"role": "user", "content": "hi"}], "logprobs": True, "top_logprobs": 50}},
        400,
        "top_logprobs",
    ),
    (
        {
            "body": {
                "messages": [{"role": "user", "content": "hi"}],
                "response_format": {"type": "json_object"},
            }
        },
        400,
        "response_format",
    ),
    ({"body": {"messages": [{"role": "user", "content": "hi"}], "logit_bias": {"x": 1}}}, 400, "logit_bias"),
    (
        {
            "body": {
                "messages": [{"role": "user", "content": "hi"}],
                "tools": [{"type": "function", "function": {"name": "f", "parameters": {}}}],
            }
        },
        400,
        "tools",
    ),  # the default model's template has no tools
    ({"body": {"messages": [{"role": "user", "content": "x" * 70000}]}}, 413, None),
    (
        {
            "body": {"messages": [{"role": "user", "content": "hi"}]},
            "headers": {"Authorization": "Bearer wrong"},
        },
        401,
        None,
    ),
    ({"body": {"messages": [{"role": "user", "content": "hi"}]}, "path": "/v1/embeddings"}, 404, None),
]


@pytest.mark.parametrize("case,status,param", BAD)
def test_bad_requests_get_openai_errors_and_the_server_keeps_serving(server, case, status, param):
    got, body = server.http(
        "POST",
        case.get("path", "/v1/chat/completions"),
        case.get("body"),
        headers=case.get("headers"),
        raw=case.get("raw"),
    )
    assert got == status, body
    assert set(body) == {"error"} and set(body["error"]) == {"message", "type", "param", "code"}
    assert body["error"]["message"] and "Traceback" not in body["error"]["message"]
    assert body["error"]["param"] == param
    ok, reply = server.http(
        "POST", "/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}
    )
    assert ok == 200 and reply["choices"][0]["message"]["content"]


def test_health_needs_no_key_and_the_api_does(server):
    connection = http.client.HTTPConnection("127.0.0.1", server.port, timeout=30)
    connection.request("GET", "/health")
    assert connection.getresponse().status == 200
    connection.close()
    with pytest.raises(openai.AuthenticationError):
        openai.OpenAI(
            base_url=f"http://127.0.0.1:{server.port}/v1", api_key="nope", max_retries=0
        ).models.list()


LOAD_PROMPTS = [
    "List two colors.",
    "What is 7 times 8?",
    "Say hello in French.",
    "Name a planet.",
    "Give me a synonym of quick.",
    "Count from one to five.",
]
LOAD_CONNECTIONS = 64


def load_requests():
    """64 requests, one connection each: greedy and seeded, streamed and whole, over six prompts
    (12 distinct (prompt, settings) pairs, each run once alone for reference); every eighth
    connection hangs up early instead."""
    requests = []
    for n in range(LOAD_CONNECTIONS):
        settings = {"max_tokens": 12}
        if n % 3 == 1:
            settings.update(temperature=0.9, seed=n % 2)
        requests.append((LOAD_PROMPTS[n % len(LOAD_PROMPTS)], settings, n % 2 == 0, n % 8 == 7))
    return requests


def run_request(client, prompt, settings, stream):
    if stream:
        return streamed(client, prompt, **settings)[0]
    return chat(client, prompt, **settings).choices[0].message.content


def raw_request(server, prompt, settings, stream):
    """The reply's text over one raw HTTP connection, opened as soon as called."""
    connection = http.client.HTTPConnection("127.0.0.1", server.port, timeout=300)
    connection.connect()
    body = {"messages": [{"role": "user", "content": prompt}], "stream": stream, **settings}
    connection.request(
        "POST", "/v1/chat/completions", body=json.dumps(body), headers={"Authorization": f"Bearer {API_KEY}"}
    )
    response = connection.getresponse()
    assert response.status == 200, response.read()
    if not stream:
        text = json.loads(response.read())["choices"][0]["message"]["content"]
    else:
        events = [line[6:] for line in response.read().decode().splitlines() if line.startswith("data: ")]
        assert events[-1] == "[DONE]"
        text = "".join(json.loads(e)["choices"][0]["delta"].get("content") or "" for e in events[:-1])
    connection.close()
    return text


def hang_up(server, n):
    """A client that leaves: before sending (a bare connection), mid-stream, or before its reply."""
    if n % 3 == 0:
        socket.create_connection(("127.0.0.1", server.port), timeout=30).close()
        return
    connection = http.client.HTTPConnection("127.0.0.1", server.port, timeout=120)
    body = {
        "messages": [{"role": "user", "content": "Tell a long story."}],
        "max_tokens": 300,
        "stream": n % 3 == 1,
    }
    connection.request(
        "POST", "/v1/chat/completions", body=json.dumps(body), headers={"Authorization": f"Bearer {API_KEY}"}
    )
    if n % 3 == 1:
        response = connection.getresponse()
        assert response.status == 200
        response.fp.readline()  # the first event, then gone
    connection.close()


def test_a_burst_of_64_connections_gets_every_sequential_output(server):
    """All at once (socketserver's default backlog of 5 reset a third of them: the listening
    socket now holds a burst), streamed and whole, some hanging up early."""
    requests = load_requests()
    key = lambda prompt, settings: (prompt, json.dumps(settings, sort_keys=True))
    reference = {}
    for prompt, settings, _stream, leaves in requests:
        if not leaves and key(prompt, settings) not in reference:
            reference[key(prompt, settings)] = run_request(server.client(), prompt, settings, stream=False)
    rss_before = server.rss_mb()
    results, errors = {}, []
    ready = threading.Barrier(LOAD_CONNECTIONS, timeout=60)

    def connection_thread(n):
        prompt, settings, stream, leaves = requests[n]
        try:
            client = server.client()
            ready.wait()
            if leaves:
                hang_up(server, n)
            elif n % 4 < 2:  # connected at once: the burst the listening socket must hold
                results[n] = raw_request(server, prompt, settings, stream)
            else:
                results[n] = run_request(client, prompt, settings, stream)
        except Exception as e:  # reported below: a thread's exception would be lost
            errors.append(f"{n}: {e!r}")

    threads = [threading.Thread(target=connection_thread, args=(n,)) for n in range(LOAD_CONNECTIONS)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=600)
    assert not errors, errors
    expected = {n: reference[key(p, s)] for n, (p, s, _, leaves) in enumerate(requests) if not leaves}
    assert results == expected
    assert any("client gone: generation stopped" in line for line in server.lines), "".join(server.lines)
    status, health = server.http("GET", "/health")
    assert status == 200 and health["queued"] == 0
    assert 0 < health["prompt_cache"]["bytes"] <= CACHE_BYTES
    # Memory stays bounded: the prompt cache evicts, nothing else piles up (what grows is the
    # working set of a batch of 8: its rows' caches, 8 rows of logits).
    assert server.rss_mb() - rss_before < 300


def test_a_long_prompt_streams_its_progress_as_comments(server):
    """A prompt of more than one prefill chunk (2,048 tokens): an SSE comment per chunk before
    the first token (proxies and clients with read timeouts see progress), which the openai
    client skips; the reply is the same."""
    # 2,168 tokens: a chunk and a little more (each prefill of it takes ~20 s on a 2-core CPU)
    content = " ".join(f"Line {i}: the quick brown fox jumps over the lazy dog." for i in range(140))
    content += "\nWhat does the fox jump over?"
    connection = http.client.HTTPConnection("127.0.0.1", server.port, timeout=300)
    connection.request(
        "POST",
        "/v1/chat/completions",
        headers={"Authorization": f"Bearer {API_KEY}"},
        body=json.dumps(
            {"messages": [{"role": "user", "content": content}], "max_tokens": 4, "stream": True}
        ),
    )
    lines = connection.getresponse().read().decode().split("\n")
    connection.close()
    progress = [re.fullmatch(r": prompt (\d+)/(\d+) tokens", line) for line in lines]
    progress = [(int(m.group(1)), int(m.group(2))) for m in progress if m]
    first_token = next(
        i
        for i, line in enumerate(lines)
        if line.startswith("data:") and '"content": "' in line and '"content": ""' not in line
    )
    assert progress and [done for done, _ in progress] == [2048 * (i + 1) for i in range(len(progress))]
    assert all(lines.index(f": prompt {done}/{total} tokens") < first_token for done, total in progress)
    raw = "".join(
        json.loads(line[6:])["choices"][0]["delta"].get("content") or ""
        for line in lines
        if line.startswith("data: {") and json.loads(line[6:])["choices"]
    )
    text, finish, usage = streamed(server.client(), content, max_tokens=4)
    assert text == raw and finish == ["length"] and usage.prompt_tokens > progress[-1][1]


def test_a_full_queue_answers_503_with_retry_after():
    process = ServerProcess("--draft", "none", "--max-batch", "1", "--max-queued", "1")
    try:
        statuses, lock = [], threading.Lock()

        def one():
            connection = http.client.HTTPConnection("127.0.0.1", process.port, timeout=120)
            connection.request(
                "POST",
                "/v1/chat/completions",
                body=json.dumps(
                    {"messages": [{"role": "user", "content": "Count to ten."}], "max_tokens": 40}
                ),
            )
            response = connection.getresponse()
            body = json.loads(response.read())
            with lock:
                statuses.append((response.status, response.getheader("Retry-After"), body))
            connection.close()

        threads = [threading.Thread(target=one) for _ in range(6)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(timeout=300)
        busy = [(retry, body) for status, retry, body in statuses if status == 503]
        assert len(statuses) == 6 and busy and any(status == 200 for status, _, _ in statuses), statuses
        for retry, body in busy:
            assert (
                retry == "1" and body["error"]["code"] == "server_busy" and "busy" in body["error"]["message"]
            )
        assert process.http("GET", "/health")[0] == 200
    finally:
        process.stop()


def test_sigterm_stops_cleanly():
    """Also: a source of trees is batched drafting its chains, said once."""
    process = ServerProcess("--draft", "eagle", "--tree-budget", "8")
    status, _ = process.http("GET", "/health")
    assert status == 200
    assert any("the batch drafts this source's chains" in line for line in process.lines), "".join(
        process.lines
    )
    assert process.stop(signal.SIGTERM) == 0
    process.reader.join(timeout=10)
    assert "stopped" in process.lines[-1] and not any("Traceback" in line for line in process.lines)
