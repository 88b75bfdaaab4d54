import click

from ..errors import MlxSpecError
from .common import echo_err, load_engine, model_options, reports_errors, stats_line, stream

HELP = "Type a message. /reset starts over, /quit leaves. Ctrl-C stops a reply."


@click.command("chat")
@model_options
@click.option("--max-tokens", "-m", type=click.IntRange(1), default=512, show_default=True,
              help="Most tokens per reply.")
@click.option("--system", default=None, help="System message.")
@reports_errors
def chat(max_tokens, system, **options):
    """Chat with the model in the terminal; the KV cache is kept across turns."""
    engine = load_engine(**options)
    tokenizer = engine.target.tokenizer
    start = [{"role": "system", "content": system}] if system else []
    messages = list(start)
    echo_err(HELP)
    while True:
        try:
            line = input(">> ")
        except (EOFError, KeyboardInterrupt):
            click.echo()
            return
        if line.strip() == "/quit":
            return
        if line.strip() == "/reset":
            messages = list(start)
            engine.reset()
            echo_err("(conversation reset)")
            continue
        if not line.strip():
            continue
        messages.append({"role": "user", "content": line})
        tokens = tokenizer.apply_chat_template(messages, add_generation_prompt=True)
        pieces = []
        try:
            _, reply, stats = stream(engine.generate(tokens, max_tokens=max_tokens), pieces=pieces)
            click.echo()
            echo_err(stats_line(stats))
        except KeyboardInterrupt:
            # Keep what was printed: it becomes the assistant's turn in the history.
            reply = "".join(pieces)
            click.echo()
            echo_err("(interrupted)")
        except MlxSpecError as e:  # e.g. the conversation outgrew the context
            messages.pop()
            echo_err(f"Error: {e}")
            continue
        messages.append({"role": "assistant", "content": reply})
