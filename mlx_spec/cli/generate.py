import json
import sys

import click

from ..api import stats_line
from ..engine import UNKNOWN_TOKEN
from .common import GroupedCommand, config_options, draft_label, echo_err, load_engine, reports_errors, stream


def encode_prompt(tokenizer, prompt: str, system, use_chat_template: bool, after_cache: bool = False):
    """The prompt's token ids; after_cache: only what follows the prompt that mlx_lm.cache_prompt
    cached (the chat template's text from the user's message on, as mlx_lm.generate takes it)."""
    if use_chat_template and getattr(tokenizer, "chat_template", None):
        messages = [{"role": "system", "content": system}] if system else []
        messages.append({"role": "user", "content": prompt})
        if not after_cache:
            return tokenizer.apply_chat_template(messages, add_generation_prompt=True)
        text = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
        messages[-1]["content"] = "<query>"
        probe = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
        return tokenizer.encode(text[probe.index("<query>") :], add_special_tokens=False)
    return tokenizer.encode(prompt)


def open_prompt_cache(path, options: dict):
    """The engine of `options`, continuing the prompt cache file at `path` (written by
    mlx_lm.cache_prompt): its model by default, and no other (as mlx_lm.generate)."""
    from pathlib import Path

    from ..cache import prompt_cache_metadata, read_prompt_cache
    from ..errors import MlxSpecError

    made_by = prompt_cache_metadata(path)[0].get("model")
    given = options.get("path_or_hf_repo")
    if given is None and made_by:
        options = dict(options, path_or_hf_repo=made_by)
    elif (
        given is not None
        and made_by
        and given != made_by
        and not (
            Path(given).exists()
            and Path(made_by).exists()
            and Path(given).resolve() == Path(made_by).resolve()
        )
    ):
        raise MlxSpecError(
            f"the prompt cache file {path} was made with the model {made_by}, not {given}: "
            "omit --model or give that one"
        )
    loaded = load_engine(options)
    return loaded, loaded.engine.resume(
        read_prompt_cache(path, loaded.engine.target.model, loaded.engine.target.model_type)
    )


@click.command(
    "generate", cls=GroupedCommand, short_help="Stream a reply to one prompt, then its statistics."
)
@click.argument("prompt_arg", metavar="[PROMPT]", required=False)
@click.option("--prompt", "prompt_opt", default=None, help="The prompt; '-' reads it from stdin.")
@config_options()
@click.option(
    "--max-tokens",
    "-m",
    type=click.IntRange(1),
    default=256,
    show_default=True,
    help="Most tokens generated.",
)
@click.option("--system", default=None, help="System message (with the chat template).")
@click.option("--no-chat-template", is_flag=True, help="Feed the prompt as raw text.")
@click.option("--json", "as_json", is_flag=True, help="Print one JSON object instead of the stream.")
@click.option(
    "--prompt-cache-file",
    default=None,
    help="A prompt cache written by mlx_lm.cache_prompt: the prompt continues it (with its model).",
)
@reports_errors
def generate(
    prompt_arg, prompt_opt, max_tokens, system, no_chat_template, as_json, prompt_cache_file, **options
):
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
    if prompt_cache_file and options["sharding"]:
        raise click.UsageError(
            "--prompt-cache-file holds the whole model's cache, not a rank's shard: it does "
            "not run with --sharding"
        )
    if prompt_cache_file:
        loaded, cached = open_prompt_cache(prompt_cache_file, options)
    else:
        loaded, cached = load_engine(options), 0
    engine = loaded.engine
    if loaded.why and not as_json:
        echo_err(f"mlx-spec: {draft_label(loaded)}")
    tokens = [UNKNOWN_TOKEN] * cached + encode_prompt(
        engine.target.tokenizer, prompt, system, not no_chat_template, after_cache=bool(cached)
    )
    events = engine.generate(tokens, max_tokens=max_tokens)
    if as_json:
        collected = stream(events, out=None)
        chosen = (
            {"draft": loaded.draft, "draft_why": loaded.why} if loaded.why else {}
        )  # what --draft auto chose
        click.echo(
            json.dumps(
                {
                    "text": collected.text,
                    "tokens": collected.tokens,
                    **chosen,
                    "stats": collected.stats.as_dict(),
                }
            )
        )
    else:
        stats = stream(events).stats
        click.echo()
        echo_err(stats_line(stats, engine.speculative, not engine.sampler.greedy))
