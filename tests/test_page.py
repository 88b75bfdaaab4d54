"""The chat page of `mlx-spec serve` (GET /) in a real browser: headless Chromium from the
distribution's packages (`make setup` installs it as root: scripts/install-browser.sh) driven by
Playwright, against a server process on loopback with the embedded default model."""

import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest

from test_server import API_KEY, ServerProcess

sync_api = pytest.importorskip("playwright.sync_api")  # a dev extra: `make test` installs it
CHROMIUM = shutil.which("chromium") or shutil.which("chromium-browser")
pytestmark = pytest.mark.skipif(
    CHROMIUM is None, reason="no chromium: `make setup` installs it as root (apt-get install chromium)"
)
PROMPT = "Repeat this sentence twice: the quick brown fox jumps over the lazy dog."
SHOTS = Path(
    os.environ.get("MLX_SPEC_TEST_OUTPUT", Path(__file__).resolve().parent.parent / "work" / "test-output")
)


@pytest.fixture(scope="module")
def server():
    process = ServerProcess("--draft", "lookup", "--api-key", API_KEY)
    yield process
    process.stop()


@pytest.fixture(scope="module")
def browser():
    with sync_api.sync_playwright() as playwright:
        # --no-sandbox: CI runs as root, where Chromium's sandbox refuses to start
        browser = playwright.chromium.launch(executable_path=CHROMIUM, args=["--no-sandbox"])
        yield browser
        browser.close()


def open_page(browser, server):
    page = browser.new_page()
    page.on("dialog", lambda dialog: dialog.accept(API_KEY))  # the page asks for the key once
    page.goto(f"http://127.0.0.1:{server.port}/")
    return page


def ask(page, text, max_tokens):
    page.fill("#max-tokens", str(max_tokens))
    page.fill("#prompt", text)
    page.click("#send")


def last_reply(page, timeout=240_000):
    page.wait_for_selector(".message.assistant[data-done=true]", timeout=timeout)
    return page.evaluate("() => conversation[conversation.length - 1].content")


def test_a_reply_equals_generate_and_drafted_tokens_are_marked(server, browser):
    page = open_page(browser, server)
    assert "lookup" in page.text_content("header")
    ask(page, PROMPT, 40)
    reply = last_reply(page)
    generated = subprocess.run(
        [sys.executable, "-m", "mlx_spec.cli", "generate", PROMPT, "-m", "40", "--draft", "none", "--json"],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert generated.returncode == 0, generated.stderr
    assert reply == json.loads(generated.stdout)["text"]
    # The sentence repeats: lookup's drafts are accepted, and those tokens carry the drafted style.
    assert page.locator(".message.assistant span.drafted").count() > 0
    assert "tokens/step" in page.text_content("#live")
    assert page.locator(".histogram div").count() > 0
    SHOTS.mkdir(parents=True, exist_ok=True)
    page.screenshot(path=str(SHOTS / "chat-page.png"), full_page=True)
    # The toggle hides the speculation: no colouring, no statistics.
    page.uncheck("#show-spec")
    assert page.locator("#main.show-spec").count() == 0
    page.close()


def test_stop_cancels_the_generation(server, browser):
    page = open_page(browser, server)
    before = len(server.lines)
    ask(page, "Write a long story about a lighthouse keeper.", 400)
    page.wait_for_selector(".message.assistant .body span", timeout=240_000)
    page.click("#stop")
    page.wait_for_selector(".message.assistant[data-done=true]", timeout=30_000)
    deadline = time.time() + 30
    while time.time() < deadline and not any("client gone" in line for line in server.lines[before:]):
        time.sleep(0.2)
    assert any("client gone" in line for line in server.lines[before:]), server.lines[before:]
    page.close()


def test_model_output_is_shown_as_text(server, browser):
    """A reply holding markup is shown as text (the page builds text nodes only), code fences
    and inline code rendered: the stream here is the server's format, served by the test."""
    page = open_page(browser, server)
    chunks = [
        {"content": "Here: <script>window.pwned = 1</script> and <b>bold?</b> `x < 1`\n"},
        {"content": '```html\n<img src=x onerror="window.pwned = 2">\n```\n'},
    ]
    body = (
        "".join(
            "data: " + json.dumps({"choices": [{"index": 0, "delta": delta, "finish_reason": None}]}) + "\n\n"
            for delta in chunks
        )
        + "data: [DONE]\n\n"
    )
    page.route(
        "**/v1/chat/completions",
        lambda route: route.fulfill(status=200, headers={"Content-Type": "text/event-stream"}, body=body),
    )
    ask(page, "anything", 8)
    reply = last_reply(page, timeout=30_000)
    assert "<script>" in reply
    shown = page.locator(".message.assistant .body")
    assert "<script>window.pwned = 1</script>" in shown.text_content()
    assert shown.locator("script, img, b").count() == 0
    assert shown.locator("pre code").text_content() == '<img src=x onerror="window.pwned = 2">\n'
    assert shown.locator("code").first.text_content() == "x < 1"
    assert page.evaluate("() => window.pwned") is None
    page.close()


def test_no_ui_serves_no_page(tmp_path):
    process = ServerProcess("--draft", "none", "--no-ui")
    try:
        status, body = process.http("GET", "/")
        assert status == 404 and "no route" in body["error"]["message"]
    finally:
        process.stop()
