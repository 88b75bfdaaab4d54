import re
import signal
import sys

import click

from ..api import stats_line
from ..errors import MlxSpecError, RanksLost
from ..events import Collector
from .common import (
    GroupedCommand,
    config_options,
    draft_label,
    echo_err,
    load_engine,
    model_label,
    reports_errors,
    stream,
)

COMMANDS = {
    "/help": "list these commands",
    "/reset": "start a new conversation (the --system message stays)",
    "/quit": "leave (Ctrl-D too)",
}
GREETING = (
    'Type a message and press Enter; end a line with \\ to go on to the next, or put """ '
    "on lines of their own around several lines. /help lists the commands. Ctrl-C stops a "
    "reply or clears the line; Ctrl-D leaves."
)


def line_editing() -> None:
    """Arrow keys, history and no line-length limit, as in a shell: GNU readline takes over the
    terminal (and with it the kernel's 4095-character line limit) and pastes several lines as
    one message (bracketed paste)."""
    if sys.stdin.isatty():
        try:
            import readline  # noqa: F401  (input() uses it once imported)
        except ImportError:  # Python built without it: plain input()
            pass


def read_message(prompt: str = ">> ", more: str = ".. ") -> str:
    """One message: a line, lines joined by a trailing backslash, or the lines between two
    lines of triple quotes."""
    line = input(prompt)
    if line.strip() == '"""':
        lines = []
        while (line := input(more)).strip() != '"""':
            lines.append(line)
        return "\n".join(lines)
    lines = []
    while line.endswith("\\"):
        lines.append(line[:-1])
        line = input(more)
    return "\n".join(lines + [line])


class CtrlC:
    """During a reply, the first Ctrl-C asks it to stop at its next token, so that the cache
    keeps what was computed and the reply gets its statistics; a second one interrupts at once."""

    def __enter__(self):
        self.pressed = False
        self.previous = signal.signal(signal.SIGINT, self._press)
        return self

    def _press(self, signum, frame):
        if self.pressed:
            raise KeyboardInterrupt
        self.pressed = True

    def __exit__(self, *exc):
        signal.signal(signal.SIGINT, self.previous)


@click.command("chat", cls=GroupedCommand, short_help="Chat in the terminal, with line editing and history.")
@config_options()
@click.option(
    "--max-tokens",
    "-m",
    type=click.IntRange(1),
    default=512,
    show_default=True,
    help="Most tokens per reply (fewer when the conversation nears the context limit).",
)
@click.option("--system", default=None, help="System message.")
@click.option("--show-drafts", is_flag=True, help="Print the tokens that came from accepted drafts in green.")
@reports_errors
def chat(max_tokens, system, show_drafts, **options):
    """Chat in the terminal, with line editing; the cache is kept across turns."""
    loaded = load_engine(options)
    engine = loaded.engine
    tokenizer = engine.target.tokenizer
    limit = engine.target.context_length
    start = [{"role": "system", "content": system}] if system else []
    if limit is not None:
        first = len(
            tokenizer.apply_chat_template(
                start + [{"role": "user", "content": "Hi"}], add_generation_prompt=True
            )
        )
        if first + max_tokens > limit:
            raise MlxSpecError(
                f"--max-tokens {max_tokens} leaves no room for a message in the "
                f"model's context of {limit} tokens"
            )
    messages = list(start)
    line_editing()
    adaptive = "adaptive" if options["adaptive"] else f"{engine.num_draft_tokens} drafts per step"
    echo_err(
        f"mlx-spec chat: {model_label(options['path_or_hf_repo'])}, {draft_label(loaded)}"
        + (f" ({adaptive})" if engine.speculative else "")
        + (f", temperature {options['temp']}" if options["temp"] else "")
    )
    echo_err(GREETING)
    while True:
        try:
            line = read_message()
        except EOFError:
            click.echo()
            return
        except KeyboardInterrupt:  # as in a shell: the line is dropped, the chat goes on
            click.echo()
            continue
        command = line.strip()
        if command == "/quit":
            return
        if command == "/help":
            echo_err("\n".join(f"{name:8} {what}" for name, what in COMMANDS.items()))
            continue
        if command == "/reset":
            messages = list(start)
            engine.reset()
            echo_err("(conversation reset)")
            continue
        if re.fullmatch(r"/[A-Za-z]+", command):  # not "/usr/bin is ...", which is a message
            echo_err(f"unknown command {command}; /help lists the commands")
            continue
        if not command:
            continue
        messages.append({"role": "user", "content": line})
        tokens = tokenizer.apply_chat_template(messages, add_generation_prompt=True)
        room = max_tokens if limit is None else min(max_tokens, limit - len(tokens))
        if room < 1:
            messages.pop()
            echo_err(
                f"the conversation ({len(tokens)} tokens with this message) fills the model's "
                f"context of {limit} tokens: /reset starts a new one"
            )
            continue
        collected = Collector()
        try:
            with CtrlC() as ctrl_c:
                stream(
                    engine.generate(tokens, max_tokens=room),
                    collected=collected,
                    stop=lambda: ctrl_c.pressed,
                    show_drafts=show_drafts,
                )
            reply, stats = collected.text, collected.stats
            click.echo()
            if stats.finish_reason == "interrupted":
                echo_err("(interrupted)")
            echo_err(stats_line(stats, engine.speculative, not engine.sampler.greedy))
        except KeyboardInterrupt:  # a second Ctrl-C: at once (the cache starts over)
            # Keep what was printed: it becomes the assistant's turn in the history.
            reply = collected.text
            click.echo()
            echo_err("(interrupted)")
        except RanksLost:  # a split target that lost a rank: the chat cannot go on
            raise
        except MlxSpecError as e:
            messages.pop()
            echo_err(f"Error: {e}")
            continue
        messages.append({"role": "assistant", "content": reply})
