"""What `generate`, `chat` and `bench` share: options, loading, the stats line."""

import functools
import sys

import click

from ..errors import MlxSpecError


def source_defaults(option: str) -> str:
    """Which sources read `option`, with their defaults, from the registry: "eagle [8], ddtree [4]"."""
    from ..drafters import DRAFTERS

    return ", ".join(f"{name} [{getattr(source.options(), option)}]" for name, source in DRAFTERS.items()
                     if option in source.options.names())


def cache_options(f):
    """mlx-lm's KV-cache flags, its names and defaults (api.load's arguments)."""
    options = [
        click.option("--max-kv-size", type=click.IntRange(8), default=None,
                     help="Bound the KV cache: the first 4 tokens and a window of the latest (mlx-lm's "
                          "RotatingKVCache; models that build their own cache keep it)."),
        click.option("--kv-bits", type=int, default=None,
                     help="Quantize the KV cache to this many bits (2, 3, 4, 5, 6, 8; default: no quantization), "
                          "with --draft none: speculation over it would not print mlx-lm's tokens."),
        click.option("--kv-group-size", type=int, default=64, show_default=True,
                     help="Group size of the KV cache quantization (32, 64, 128)."),
        click.option("--quantized-kv-start", type=click.IntRange(0), default=5000, show_default=True,
                     help="With --kv-bits, quantize the cache once it holds this many tokens."),
    ]
    for option in reversed(options):
        f = option(f)
    return f


def model_options(f):
    """--model/--dtype and the draft-source options, named as in mlx-lm where it has them; their
    destinations are api.load's argument names. A source's own options default to None (not
    given): the registry holds their defaults, which the help shows."""
    from ..drafters import DRAFTERS, sources_reading
    from ..models.target import DTYPES

    options = [
        click.option("--model", "path_or_hf_repo", default=None,
                     help="mlx-lm model: a directory or a Hugging Face repo id (default: the embedded "
                          "SmolLM2-135M-Instruct)."),
        click.option("--revision", default=None,
                     help="The model's revision on the Hugging Face hub (branch, tag or commit)."),
        click.option("--dtype", default="auto", show_default=True,
                     help=f"{'|'.join(DTYPES)}. auto: quantized weights on a GPU, float32 on the CPU."),
        click.option("--draft", default="lookup", show_default=True,
                     help=f"Source of drafts: {'|'.join(DRAFTERS)}."),
        click.option("--draft-model", default=None,
                     help="Drafter checkpoint or draft model: a directory or a Hugging Face repo id "
                          f"({sources_reading('draft_model').replace('|', ', ')})."),
        click.option("--num-draft-tokens", type=click.IntRange(0), default=None,
                     help="Most drafts per step (default per method: "
                          + ", ".join(f"{m} {s.default_draft_tokens}" for m, s in DRAFTERS.items()
                                      if s.default_draft_tokens) + ")."),
        click.option("--adaptive/--fixed", default=True, show_default=True,
                     help="adaptive: verify only the drafts that pay, from their confidence and the "
                          "costs measured while running (none when drafting does not pay); fixed: "
                          "always --num-draft-tokens."),
        click.option("--stop-early", is_flag=True,
                     help=f"{sources_reading('stop_early').replace('|', ', ')} (chains): stop drafting once "
                          "the next draft would not pay (a sync per draft)."),
        click.option("--ngram-max", type=click.IntRange(1), default=None,
                     help=f"Longest n-gram matched: {source_defaults('ngram_max')}."),
        click.option("--ngram-min", type=click.IntRange(1), default=None,
                     help=f"Shortest n-gram matched: {source_defaults('ngram_min')}."),
        click.option("--tree-budget", type=click.IntRange(0, 512), default=None,
                     help=f"Nodes of a draft tree (0: a chain of --num-draft-tokens): {source_defaults('tree_budget')}."),
        click.option("--tree-topk", type=click.IntRange(1, 64), default=None,
                     help=f"Children per expanded node (eagle), candidates per position: "
                          f"{source_defaults('tree_topk')}. --num-draft-tokens is the tree's depth."),
        click.option("--suffix-memory", default=None,
                     help=f"{sources_reading('suffix_memory').replace('|', ', ')}: the file of earlier outputs "
                          "searched and fed (default: one per model under ~/.cache/mlx-spec/suffix-memory), or off."),
        click.option("--exit-layer", type=int, default=None,
                     help="layerskip: the target's first E layers (then its norm and head) draft."),
        click.option("--temp", type=float, default=0.0, show_default=True, help="Sampling temperature."),
        click.option("--top-p", type=float, default=1.0, show_default=True, help="Nucleus sampling."),
        click.option("--top-k", type=int, default=0, show_default=True, help="Top-k sampling (0: off)."),
        click.option("--min-p", type=float, default=0.0, show_default=True, help="Min-p sampling."),
        click.option("--seed", type=int, default=None,
                     help="Random seed: the same seed gives the same sampled text, whatever --draft "
                          "(default: a fresh one, printed with the statistics when sampling)."),
        click.option("--residual-sampling", is_flag=True,
                     help="Accept sampled drafts by the residual rule (may accept more; the output for a "
                          "seed then depends on the draft source and timing)."),
    ]
    for option in reversed(options):
        f = option(f)
    return sharding_options(cache_options(f))


def sharding_options(f):
    """The target split over the processes mlx.launch starts (api.load's argument names)."""
    options = [
        click.option("--sharding", type=click.Choice(["tensor", "pipeline"]), default=None,
                     help="Split the target over the processes mlx.launch starts (mlx-lm's sharding: "
                          "tensor parallel, or pipeline stages); rank 0 drafts and prints."),
        click.option("--rank-timeout", type=click.FloatRange(min=1), default=None,
                     help="With --sharding: seconds a pass (or a prefill chunk) may wait for the other ranks "
                          "before the run ends [120]."),
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


def load_engine(options: dict, sessions: bool = False):
    """The engine of model_options' values (api.load's arguments)."""
    from ..api import load

    return load(**options, sessions=sessions)[0]


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
