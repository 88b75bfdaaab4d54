"""What `generate`, `chat` and `bench` share: options, loading, the stats line."""

import functools
import sys

import click

from ..errors import MlxSpecError


def model_options(f):
    """--model/--dtype and the draft-source options, named as in mlx-lm where it has them."""
    from ..drafters import DRAFTERS
    from ..models.target import DTYPES

    options = [
        click.option("--model", "model_path", default=None,
                     help="mlx-lm model: a directory or a Hugging Face repo id (default: the embedded "
                          "SmolLM2-135M-Instruct)."),
        click.option("--revision", default=None,
                     help="The model's revision on the Hugging Face hub (branch, tag or commit)."),
        click.option("--dtype", default="auto", show_default=True,
                     help=f"{'|'.join(DTYPES)}. auto: quantized weights on a GPU, float32 on the CPU."),
        click.option("--draft", "method", default="lookup", show_default=True,
                     help=f"Source of drafts: {'|'.join(DRAFTERS)}."),
        click.option("--draft-model", default=None,
                     help="Drafter checkpoint or draft model: a directory or a Hugging Face repo id."),
        click.option("--num-draft-tokens", type=click.IntRange(0), default=None,
                     help="Most drafts per step (default per method: "
                          + ", ".join(f"{m} {s.default_draft_tokens}" for m, s in DRAFTERS.items()
                                      if s.default_draft_tokens) + ")."),
        click.option("--adaptive/--fixed", default=True, show_default=True,
                     help="adaptive: verify only the drafts that pay, from their confidence and the "
                          "costs measured while running (none when drafting does not pay); fixed: "
                          "always --num-draft-tokens."),
        click.option("--stop-early", is_flag=True,
                     help="model, eagle (chain): stop drafting once the next draft would not pay "
                          "(a sync per draft)."),
        click.option("--ngram-max", type=click.IntRange(1), default=3, show_default=True,
                     help="lookup: longest n-gram matched."),
        click.option("--ngram-min", type=click.IntRange(1), default=1, show_default=True,
                     help="lookup: shortest n-gram matched."),
        click.option("--tree-budget", type=click.IntRange(0, 512), default=0, show_default=True,
                     help="eagle: draft a tree of this many nodes (0: a chain of --num-draft-tokens); "
                          "ddtree: the most nodes (0: 16)."),
        click.option("--tree-topk", type=click.IntRange(1, 64), default=None,
                     help="eagle: children per expanded node [8]; ddtree: candidates per position [4]. "
                          "--num-draft-tokens is the tree's depth."),
        click.option("--exit-layer", type=int, default=None,
                     help="layerskip: the target's first E layers (then its norm and head) draft."),
        click.option("--temp", type=float, default=0.0, show_default=True, help="Sampling temperature."),
        click.option("--top-p", type=float, default=1.0, show_default=True, help="Nucleus sampling."),
        click.option("--top-k", type=int, default=0, show_default=True, help="Top-k sampling (0: off)."),
        click.option("--min-p", type=float, default=0.0, show_default=True, help="Min-p sampling."),
        click.option("--seed", type=int, default=None,
                     help="Random seed: the same seed gives the same sampled text, whatever --draft "
                          "(default: a fresh one, printed with the statistics when sampling)."),
        click.option("--residual-sampling", "residual", is_flag=True,
                     help="Accept sampled drafts by the residual rule (may accept more; the output for a "
                          "seed then depends on the draft source and timing)."),
    ]
    for option in reversed(options):
        f = option(f)
    return f


def reports_errors(f):
    """Bad input ends in one line on stderr and exit status 1, never a traceback."""

    @functools.wraps(f)
    def wrapper(*args, **kwargs):
        try:
            return f(*args, **kwargs)
        except MlxSpecError as e:
            raise click.ClickException(str(e)) from None

    return wrapper


def check_source_options(method: str) -> None:
    """Refuse, in one line, an option given on the command line that --draft `method` does not read."""
    from ..drafters import DRAFTERS, SOURCE_OPTIONS, check_method, sources_reading

    ctx = click.get_current_context(silent=True)
    if ctx is None:
        return
    used = DRAFTERS[check_method(method)].options
    for name in SOURCE_OPTIONS:
        source = ctx.get_parameter_source(name)
        if source in (click.core.ParameterSource.COMMANDLINE, click.core.ParameterSource.ENVIRONMENT) \
                and name not in used:
            flag = "--" + name.replace("_", "-")
            raise MlxSpecError(f"{flag} is for --draft {sources_reading(name)}, not --draft {method}")


def load_engine(model_path, revision, dtype, method, draft_model, num_draft_tokens, ngram_max, ngram_min,
                tree_budget, tree_topk, exit_layer, temp, top_p, top_k, min_p, seed, residual, adaptive,
                stop_early, sessions=False):
    from ..api import load

    check_source_options(method)
    engine, _ = load(model_path, draft=method, draft_model=draft_model, num_draft_tokens=num_draft_tokens,
                     dtype=dtype, revision=revision, adaptive=adaptive, stop_early=stop_early,
                     residual_sampling=residual, sessions=sessions, ngram_max=ngram_max, ngram_min=ngram_min,
                     tree_budget=tree_budget, tree_topk=tree_topk, exit_layer=exit_layer, temp=temp,
                     top_p=top_p, top_k=top_k, min_p=min_p, seed=seed)
    return engine


def model_label(model_path) -> str:
    """What to call the model the user named: its repo id, its directory's name, or the
    embedded model's name."""
    from pathlib import Path

    from ..models.default import DEFAULT_MODEL_NAME

    if model_path is None:
        return DEFAULT_MODEL_NAME
    return Path(model_path).resolve().name if Path(model_path).exists() else model_path


def echo_err(text: str, **kwargs) -> None:
    click.echo(text, err=True, **kwargs)


def stream(events, out=sys.stdout, pieces=None, stop=None):
    """Print text as it is committed; return (generated token ids, text, Stats). `pieces`
    collects the text printed so far, which survives an interrupted stream; stop() True ends
    the generation at the next event (its stats then say "interrupted")."""
    tokens, stats = [], None
    pieces = [] if pieces is None else pieces
    for event in events:
        if event[0] == "token":
            tokens.append(event[1])
        if event[0] in ("token", "text") and event[-1]:
            pieces.append(event[-1])
            if out is not None:
                out.write(event[-1])
                out.flush()
        elif event[0] in ("prefill", "done"):
            stats = event[1]
        if stop is not None and stop():
            events.close()
            break
    return tokens, "".join(pieces), stats
