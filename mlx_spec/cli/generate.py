import json
import sys

import click

from ..api import stats_line
from .common import echo_err, load_engine, model_options, reports_errors, stream


def encode_prompt(tokenizer, prompt: str, system, use_chat_template: bool):
    if use_chat_template and getattr(tokenizer, "chat_template", None):
        messages = ([{"role": "system", "content": system}] if system else [])
        messages.append({"role": "user", "content": prompt})
        return tokenizer.apply_chat_template(messages, add_generation_prompt=True)
    return tokenizer.encode(prompt)


@click.command("generate", short_help="Stream a reply to one prompt, then its statistics.")
@click.argument("prompt_arg", metavar="[PROMPT]", required=False)
@click.option("--prompt", "prompt_opt", default=None, help="The prompt; '-' reads it from stdin.")
@model_options
@click.option("--max-tokens", "-m", type=click.IntRange(1), default=256, show_default=True,
              help="Most tokens generated.")
@click.option("--system", default=None, help="System message (with the chat template).")
@click.option("--no-chat-template", is_flag=True, help="Feed the prompt as raw text.")
@click.option("--json", "as_json", is_flag=True, help="Print one JSON object instead of the stream.")
@reports_errors
def generate(prompt_arg, prompt_opt, max_tokens, system, no_chat_template, as_json, **options):
    """Generate a reply to PROMPT, streaming it, then one line of statistics."""
    if prompt_opt is not None and prompt_arg is not None:
        raise click.UsageError("give the prompt once: a PROMPT argument or --prompt, not both")
    if system is not None and no_chat_template:
        raise click.UsageError("--system goes into the chat template: drop --no-chat-template or --system")
    prompt = prompt_opt if prompt_opt is not None else prompt_arg
    if prompt is None:
        raise click.UsageError("give a PROMPT, or --prompt - to read it from stdin")
    if prompt == "-":
        prompt = sys.stdin.read()
        if not prompt.strip():
            raise click.UsageError("the prompt is empty: nothing came on stdin")
    if not prompt.strip():
        raise click.UsageError("the prompt is empty")
    engine = load_engine(options)
    tokens = encode_prompt(engine.target.tokenizer, prompt, system, not no_chat_template)
    events = engine.generate(tokens, max_tokens=max_tokens)
    if as_json:
        generated, text, stats = stream(events, out=None)
        keys = ("prompt_tokens", "prompt_cached", "generated_tokens", "committed", "steps", "tokens_per_step",
                "proposed", "accepted", "acceptance_rate", "tokens_per_second", "prompt_seconds",
                "generate_seconds", "seed", "mean_draft_length", "plain_steps", "drafted", "finish_reason")
        all_stats = stats.as_dict()
        click.echo(json.dumps({"text": text, "tokens": generated,
                               "stats": {k: all_stats[k] for k in keys}}))
    else:
        _, _, stats = stream(events)
        click.echo()
        echo_err(stats_line(stats, engine.speculative, not engine.sampler.greedy))
