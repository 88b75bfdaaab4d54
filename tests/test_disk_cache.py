"""The prompt cache on disk (serve --prompt-cache-dir), through the real `openai` client against
server processes on loopback, on the embedded default model with EAGLE-3 (a drafter that reads
the target's features, which the entries keep too): a restart continues a conversation with its
prompt cached and the tokens mlx-lm gives; what memory evicts goes to disk; corrupt and foreign
entries are passed over with a warning; two servers share one directory."""

import json

import pytest

from mlx_spec.convert.default import default_model_path
from mlx_spec.models.target import load_target
from test_server import ServerProcess

SYSTEM = (
    "You are a careful assistant for a team that keeps a small library of Python tools. Answer in "
    "plain words, give short examples where they help, and say when you are unsure. The team "
    "prefers answers that a new member can follow without reading the code first, and it keeps "
    "its notes in a shared document that everyone edits."
)
FIRST = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": "What is a list in Python?"}]
MAX_TOKENS = 24


def serve(directory, *args) -> ServerProcess:
    return ServerProcess(
        "--draft", "eagle", "--prompt-cache-dir", str(directory), "--max-tokens", str(MAX_TOKENS), *args
    )


def chat(server, messages):
    reply = server.client().chat.completions.create(model="default", messages=messages, max_tokens=MAX_TOKENS)
    return (
        reply.choices[0].message.content,
        reply.usage.prompt_tokens,
        reply.usage.prompt_tokens_details.cached_tokens,
    )


@pytest.fixture(scope="module")
def reference():
    """What mlx-lm writes for a conversation, greedy, on the weights the server runs (the 4-bit
    default dequantized to float32), and how many tokens its prompt has."""
    from mlx_lm import generate

    target = load_target(default_model_path(), "float32")

    def reply(messages):
        prompt = target.tokenizer.apply_chat_template(messages, add_generation_prompt=True)
        return generate(target.model, target.tokenizer, prompt, max_tokens=MAX_TOKENS), len(prompt)

    return reply


def entries(directory):
    return sorted(p for p in directory.rglob("*.json"))


def test_a_restart_continues_the_conversation_from_disk(tmp_path, reference):
    first, n_first = reference(FIRST)
    server = serve(tmp_path)
    try:
        text, _, cached = chat(server, FIRST)
        assert text == first and cached == 0
        assert server.http("GET", "/health")[1]["prompt_cache"]["disk"]["entries"] == 0  # nothing evicted yet
    finally:
        assert server.stop() == 0
    assert len(entries(tmp_path)) == 1  # written at shutdown
    assert not [p for p in tmp_path.rglob(".*") if p.name != ".lock"]  # no temporary file left
    second = FIRST + [{"role": "assistant", "content": first}, {"role": "user", "content": "And a tuple?"}]
    expected, n_second = reference(second)
    server = serve(tmp_path)
    try:
        text, prompt_tokens, cached = chat(server, second)
    finally:
        server.stop()
    assert text == expected and prompt_tokens == n_second
    assert n_first - 1 <= cached < n_second  # the first turn's prompt at least (its last token is recomputed)


def test_memory_evicts_to_disk_and_bad_entries_are_passed_over(tmp_path, reference):
    other = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": "Name three birds."}]
    # one request at a time, memory holding the live conversation alone (the batched server, in
    # the other tests, hands each row's conversation to the store once its request is done)
    server = serve(tmp_path, "--prompt-cache-size", "0", "--max-batch", "1")
    try:
        chat(server, FIRST)
        chat(server, other)  # FIRST's conversation leaves memory: to disk
        assert server.http("GET", "/health")[1]["prompt_cache"]["disk"]["entries"] == 1
    finally:
        server.stop()
    assert len(entries(tmp_path)) == 2
    # One entry's cache corrupted, the other's record made another model's: the first request
    # finds both unusable (one warning each), computes its whole prompt, and writes what mlx-lm does.
    corrupt, foreign = entries(tmp_path)
    corrupt.with_suffix(".safetensors").write_bytes(b"not a safetensors file")
    foreign.write_text(json.dumps({**json.loads(foreign.read_text()), "model": "another-model"}))
    server = serve(tmp_path)
    try:
        text, _, cached = chat(server, FIRST)
        assert text == reference(FIRST)[0] and cached == 0
        assert chat(server, other)[0] == reference(other)[0]
    finally:
        server.stop()
    warnings = [line for line in server.lines if line.startswith("warning: prompt cache entry")]
    assert len(warnings) == 2 and any("another model" in line for line in warnings), server.lines


def test_two_servers_share_one_directory(tmp_path, reference):
    # long enough apart that the second is worth reading from disk with the first in memory
    questions = [
        "What is a set? " + "Explain how adding, removing and testing membership work, and when a set "
        "is a better choice than a list for a program that checks many values.",
        "What is a dict? " + "Explain how keys map to values, what may be a key, how to loop over "
        "the items in order, what happens when a key is missing, and how to merge two of them.",
    ]
    servers = [serve(tmp_path), serve(tmp_path)]
    try:
        for server, question in zip(servers, questions):
            chat(server, FIRST[:1] + [{"role": "user", "content": question}])
    finally:
        for server in servers:
            server.stop()
    assert len(entries(tmp_path)) == 2
    server = serve(tmp_path)
    try:
        for question in questions:
            messages = FIRST[:1] + [{"role": "user", "content": question}]
            text, prompt_tokens, cached = chat(server, messages)
            # all but the last one or two tokens (a drafter that reads features pairs the last with the one before)
            assert text == reference(messages)[0] and prompt_tokens - 2 <= cached < prompt_tokens
    finally:
        server.stop()
