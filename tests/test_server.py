"""`mlx-spec serve` as a real process on a free loopback port, spoken to by the `openai` client
and by raw HTTP: the embedded default model with its shipped EAGLE-3 drafter."""

import http.client
import json
import re
import signal
import subprocess
import sys
import threading
import time

import pytest

openai = pytest.importorskip("openai")   # a dev extra: `make test` installs it

API_KEY = "sk-test"
CACHE_BYTES = 24 << 20   # a few conversations of the default model: the load test evicts


class ServerProcess:
    def __init__(self, *args):
        self.process = subprocess.Popen([sys.executable, "-m", "mlx_spec.cli", "serve", "--port", "0", *args],
                                        stderr=subprocess.PIPE, text=True)
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
        return openai.OpenAI(base_url=f"http://127.0.0.1:{self.port}/v1", api_key=API_KEY, max_retries=0,
                             timeout=120, **kwargs)

    def http(self, method, path, body=None, headers=None, raw=None):
        """(status, decoded JSON) of one raw request."""
        connection = http.client.HTTPConnection("127.0.0.1", self.port, timeout=120)
        data = raw if raw is not None else (json.dumps(body).encode() if body is not None else None)
        connection.request(method, path, body=data, headers={"Authorization": f"Bearer {API_KEY}", **(headers or {})})
        response = connection.getresponse()
        payload = response.read()
        connection.close()
        return response.status, json.loads(payload)

    def rss_mb(self) -> float:
        with open(f"/proc/{self.process.pid}/status") as f:
            return int(next(line for line in f if line.startswith("VmRSS")).split()[1]) / 1024


@pytest.fixture(scope="module")
def server():
    process = ServerProcess("--draft", "eagle", "--api-key", API_KEY, "--prompt-cache-bytes", str(CACHE_BYTES),
                            "--max-body-bytes", "65536")
    try:
        yield process
    finally:
        process.stop()


def cli_generate(prompt, *args):
    result = subprocess.run([sys.executable, "-m", "mlx_spec.cli", "generate", prompt, "--json", *args],
                            capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr
    return json.loads(result.stdout)


def chat(client, content, **kwargs):
    reply = client.chat.completions.create(model="SmolLM2-135M-Instruct", messages=[{"role": "user", "content": content}],
                                           **kwargs)
    return reply


def streamed(client, content, **kwargs):
    chunks = list(client.chat.completions.create(model="SmolLM2-135M-Instruct",
                                                 messages=[{"role": "user", "content": content}], stream=True,
                                                 stream_options={"include_usage": True}, **kwargs))
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
    assert whole.usage.model_extra["speculative"]["seed"] is None   # greedy: no seed to repeat
    text, finish, usage = streamed(client, prompt, max_tokens=24)
    assert text == greedy["text"] and finish == [whole.choices[0].finish_reason]
    assert usage.prompt_tokens == greedy["stats"]["prompt_tokens"]
    seeded = chat(client, prompt, max_tokens=24, temperature=0.8, seed=11)
    assert seeded.choices[0].message.content == sampled["text"]
    assert seeded.usage.model_extra["speculative"]["seed"] == 11
    assert streamed(client, prompt, max_tokens=24, temperature=0.8, seed=11)[0] == sampled["text"]
    completion = client.completions.create(model="SmolLM2-135M-Instruct", prompt="The capital of France is",
                                           max_tokens=12)
    raw = cli_generate("The capital of France is", "-m", "12", "--draft", "none", "--no-chat-template")
    assert completion.choices[0].text == raw["text"]
    pieces = client.completions.create(model="SmolLM2-135M-Instruct", prompt="The capital of France is",
                                       max_tokens=12, stream=True)
    assert "".join(c.choices[0].text for c in pieces if c.choices) == raw["text"]


def test_a_second_turn_reports_cached_tokens(server):
    client = server.client()
    messages = [{"role": "user", "content": "Write a haiku about rain."}]
    first = client.chat.completions.create(model="SmolLM2-135M-Instruct", messages=messages, max_tokens=20)
    messages += [{"role": "assistant", "content": first.choices[0].message.content},
                 {"role": "user", "content": "Now one about snow."}]
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
    ({"body": {"messages": [{"role": "user", "content": "hi"}], "tools": [{"type": "function"}]}}, 400, "tools"),
    ({"body": {"messages": [{"role": "user", "content": "hi"}], "frobnicate": 1}}, 400, "frobnicate"),
    ({"body": {"messages": [{"role": "tool", "content": "hi"}]}}, 400, "messages"),
    ({"body": {"messages": [{"role": "user", "content": "hi"}], "model": "/etc/passwd"}}, 404, "model"),
    ({"body": {"messages": [{"role": "user", "content": "x" * 70000}]}}, 413, None),
    ({"body": {"messages": [{"role": "user", "content": "hi"}]}, "headers": {"Authorization": "Bearer wrong"}},
     401, None),
    ({"body": {"messages": [{"role": "user", "content": "hi"}]}, "path": "/v1/embeddings"}, 404, None),
]


@pytest.mark.parametrize("case,status,param", BAD)
def test_bad_requests_get_openai_errors_and_the_server_keeps_serving(server, case, status, param):
    got, body = server.http("POST", case.get("path", "/v1/chat/completions"), case.get("body"),
                            headers=case.get("headers"), raw=case.get("raw"))
    assert got == status, body
    assert set(body) == {"error"} and set(body["error"]) == {"message", "type", "param", "code"}
    assert body["error"]["message"] and "Traceback" not in body["error"]["message"]
    assert body["error"]["param"] == param
    ok, reply = server.http("POST", "/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}],
                                                            "max_tokens": 2})
    assert ok == 200 and reply["choices"][0]["message"]["content"]


def test_health_needs_no_key_and_the_api_does(server):
    connection = http.client.HTTPConnection("127.0.0.1", server.port, timeout=30)
    connection.request("GET", "/health")
    assert connection.getresponse().status == 200
    connection.close()
    with pytest.raises(openai.AuthenticationError):
        openai.OpenAI(base_url=f"http://127.0.0.1:{server.port}/v1", api_key="nope", max_retries=0).models.list()


LOAD_PROMPTS = ["List two colors.", "What is 7 times 8?", "Say hello in French.", "Name a planet.",
                "Give me a synonym of quick.", "Count from one to five."]


def load_requests():
    """8 clients x 3 requests: greedy and seeded, streamed and whole, over six prompts."""
    requests = []
    for client in range(8):
        for i in range(3):
            n = 3 * client + i
            settings = {"max_tokens": 12}
            if n % 3 == 1:
                settings.update(temperature=0.9, seed=n)
            requests.append((client, LOAD_PROMPTS[n % len(LOAD_PROMPTS)], settings, n % 2 == 0))
    return requests


def run_request(client, prompt, settings, stream):
    if stream:
        return streamed(client, prompt, **settings)[0]
    return chat(client, prompt, **settings).choices[0].message.content


def test_concurrent_clients_get_their_sequential_outputs(server):
    requests = load_requests()
    sequential = [run_request(server.client(), prompt, settings, stream) for _, prompt, settings, stream in requests]
    rss_before = server.rss_mb()
    results, errors = {}, []

    def client_thread(index):
        client = server.client()
        try:
            if index == 0:   # a client that leaves mid-stream: its generation stops, the others go on
                stream = client.chat.completions.create(
                    model="SmolLM2-135M-Instruct", messages=[{"role": "user", "content": "Tell a long story."}],
                    max_tokens=400, stream=True)
                next(iter(stream))
                stream.close()
            for n, (owner, prompt, settings, stream) in enumerate(requests):
                if owner == index:
                    results[n] = run_request(client, prompt, settings, stream)
        except Exception as e:   # reported below: a thread's exception would be lost
            errors.append(repr(e))

    threads = [threading.Thread(target=client_thread, args=(i,)) for i in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=600)
    assert not errors, errors
    assert [results.get(n) for n in range(len(requests))] == sequential
    assert any("client gone: generation stopped" in line for line in server.lines), "".join(server.lines)
    status, health = server.http("GET", "/health")
    assert status == 200 and health["queued"] == 0
    assert 0 < health["prompt_cache"]["bytes"] <= CACHE_BYTES
    # Memory stays bounded: the prompt cache evicts, nothing else piles up (what grows is the
    # working set of a batch of 8: its rows' caches, 8 rows of logits; in-process it levels off
    # after the second round of the same load).
    assert server.rss_mb() - rss_before < 300


def test_sigterm_stops_cleanly():
    """Also: a source of trees is batched drafting its chains, said once."""
    process = ServerProcess("--draft", "eagle", "--tree-budget", "8")
    status, _ = process.http("GET", "/health")
    assert status == 200
    assert any("the batch drafts this source's chains" in line for line in process.lines), "".join(process.lines)
    assert process.stop(signal.SIGTERM) == 0
    process.reader.join(timeout=10)
    assert "stopped" in process.lines[-1] and not any("Traceback" in line for line in process.lines)
