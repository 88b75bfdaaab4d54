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


class GroupedOption(click.Option):
    """An option listed under a heading of its own in --help (`group`; None: "Options")."""

    def __init__(self, *args, group=None, **kwargs):
        super().__init__(*args, **kwargs)
        self.group = group


class GroupedCommand(click.Command):
    """--help lists the everyday options first ("Options"), then each group under its heading,
    in the order they first appear."""

    def format_options(self, ctx, formatter):
        groups = {"Options": []}
        for param in self.get_params(ctx):
            record = param.get_help_record(ctx) if isinstance(param, click.Option) else None
            if record is not None:
                groups.setdefault(getattr(param, "group", None) or "Options", []).append(record)
        for heading, records in groups.items():
            if records:
                with formatter.section(heading):
                    formatter.write_dl(records)


def option(*decls, group=None, **settings):
    """click.option, listed under `group`'s heading in --help."""
    return click.option(*decls, cls=GroupedOption, group=group, **settings)


def apply(f, options):
    for decorator in reversed(options):
        f = decorator(f)
    return f


def cache_options(f):
    """mlx-lm's KV-cache flags, its names and defaults (api.load's arguments)."""
    options = [
        option("--max-kv-size", type=click.IntRange(8), default=None, group="KV cache",
               help="Bound the KV cache: the first 4 tokens and a window of the latest (mlx-lm's "
                    "RotatingKVCache; models that build their own cache keep it)."),
        option("--kv-bits", type=int, default=None, group="KV cache",
               help="Quantize the KV cache to this many bits (2, 3, 4, 5, 6, 8; default: no quantization), "
                    "with --draft none: speculation over it would not print mlx-lm's tokens."),
        option("--kv-group-size", type=int, default=64, show_default=True, group="KV cache",
               help="Group size of the KV cache quantization (32, 64, 128)."),
        option("--quantized-kv-start", type=click.IntRange(0), default=5000, show_default=True, group="KV cache",
               help="With --kv-bits, quantize the cache once it holds this many tokens."),
    ]
    return apply(f, options)


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
        option("--num-draft-tokens", group="Drafting", type=click.IntRange(0), default=None,
               help="Most drafts per step (default per method: "
                    + ", ".join(f"{m} {s.default_draft_tokens}" for m, s in DRAFTERS.items()
                                if s.default_draft_tokens) + ")."),
        option("--adaptive/--fixed", group="Drafting", default=True, show_default=True,
               help="adaptive: verify only the drafts that pay, from their confidence and the "
                    "costs measured while running (none when drafting does not pay); fixed: "
                    "always --num-draft-tokens."),
        option("--stop-early", group="Drafting", is_flag=True,
               help=f"{sources_reading('stop_early').replace('|', ', ')} (chains): stop drafting once "
                    "the next draft would not pay (a sync per draft)."),
        option("--ngram-max", group="Drafting", type=click.IntRange(1), default=None,
               help=f"Longest n-gram matched: {source_defaults('ngram_max')}."),
        option("--ngram-min", group="Drafting", type=click.IntRange(1), default=None,
               help=f"Shortest n-gram matched: {source_defaults('ngram_min')}."),
        option("--tree-budget", group="Drafting", type=click.IntRange(0, 512), default=None,
               help=f"Nodes of a draft tree (0: a chain of --num-draft-tokens): {source_defaults('tree_budget')}."),
        option("--tree-topk", group="Drafting", type=click.IntRange(1, 64), default=None,
               help=f"Children per expanded node (eagle), candidates per position: "
                    f"{source_defaults('tree_topk')}. --num-draft-tokens is the tree's depth."),
        option("--suffix-memory", group="Drafting", default=None,
               help=f"{sources_reading('suffix_memory').replace('|', ', ')}: the file of earlier outputs "
                    "searched and fed (default: one per model under ~/.cache/mlx-spec/suffix-memory), or off."),
        option("--exit-layer", group="Drafting", type=int, default=None,
               help="layerskip: the target's first E layers (then its norm and head) draft."),
        option("--temp", group="Sampling", type=float, default=0.0, show_default=True, help="Sampling temperature."),
        option("--top-p", group="Sampling", type=float, default=1.0, show_default=True, help="Nucleus sampling."),
        option("--top-k", group="Sampling", type=int, default=0, show_default=True, help="Top-k sampling (0: off)."),
        option("--min-p", group="Sampling", type=float, default=0.0, show_default=True, help="Min-p sampling."),
        option("--seed", group="Sampling", type=int, default=None,
               help="Random seed: the same seed gives the same sampled text, whatever --draft "
                    "(default: a fresh one, printed with the statistics when sampling)."),
        option("--residual-sampling", group="Sampling", is_flag=True,
               help="Accept sampled drafts by the residual rule (may accept more; the output for a "
                    "seed then depends on the draft source and timing)."),
    ]
    # The everyday options first, the KV cache's and the split's last (decorators apply inside out).
    return apply(sharding_options(cache_options(f)), options)


def sharding_options(f):
    """The target split over the processes mlx.launch starts (api.load's argument names)."""
    options = [
        option("--sharding", group="Split target", type=click.Choice(["tensor", "pipeline"]), default=None,
               help="Split the target over the processes mlx.launch starts (mlx-lm's sharding: "
                    "tensor parallel, or pipeline stages); rank 0 drafts and prints."),
        option("--rank-timeout", group="Split target", type=click.FloatRange(min=1), default=None,
               help="With --sharding: seconds a pass (or a prefill chunk) may wait for the other ranks "
                    "before the run ends [120]."),
    ]
    return apply(f, options)


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
