"""What `generate`, `chat` and `bench` share: options, loading, the stats line."""

import functools
import sys

import click

from ..errors import MlxSpecError


def model_options(f):
    """--model/--dtype and the draft-source options, named as in mlx-lm where it has them."""
    from ..drafters import DEFAULT_DRAFT_TOKENS, DRAFTERS
    from ..models.target import DTYPES

    options = [
        click.option("--model", "model_path", default=None,
                     help="mlx-lm model directory (default: the embedded SmolLM2-135M-Instruct)."),
        click.option("--dtype", default="auto", show_default=True,
                     help=f"{'|'.join(DTYPES)}. auto: quantized weights on a GPU, float32 on the CPU."),
        click.option("--draft", "method", default="lookup", show_default=True,
                     help=f"Source of drafts: {'|'.join(DRAFTERS)}."),
        click.option("--draft-model", default=None, help="Drafter checkpoint or draft model directory."),
        click.option("--num-draft-tokens", type=click.IntRange(0), default=None,
                     help="Most drafts verified per step (default per method: "
                          + ", ".join(f"{m} {k}" for m, k in DEFAULT_DRAFT_TOKENS.items() if k) + ")."),
        click.option("--ngram-max", type=click.IntRange(1), default=3, show_default=True,
                     help="lookup: longest n-gram matched."),
        click.option("--ngram-min", type=click.IntRange(1), default=1, show_default=True,
                     help="lookup: shortest n-gram matched."),
        click.option("--tree-budget", type=click.IntRange(0), default=0, show_default=True,
                     help="eagle: draft a tree of this many nodes (0: a chain of --num-draft-tokens)."),
        click.option("--tree-topk", type=click.IntRange(1), default=8, show_default=True,
                     help="eagle: children per expanded node; --num-draft-tokens is the tree's depth."),
        click.option("--temp", type=float, default=0.0, show_default=True, help="Sampling temperature."),
        click.option("--top-p", type=float, default=1.0, show_default=True, help="Nucleus sampling."),
        click.option("--top-k", type=int, default=0, show_default=True, help="Top-k sampling (0: off)."),
        click.option("--min-p", type=float, default=0.0, show_default=True, help="Min-p sampling."),
        click.option("--seed", type=int, default=0, show_default=True, help="Random seed."),
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


def load_engine(model_path, dtype, method, draft_model, num_draft_tokens, ngram_max, ngram_min,
                tree_budget, tree_topk, temp, top_p, top_k, min_p, seed):
    from ..drafters import draft_tokens, make_drafter
    from ..engine import Engine
    from ..models.target import load_target
    from ..sampling import SamplingParams

    num_draft_tokens = draft_tokens(method, num_draft_tokens)
    if model_path is None:
        from ..models.default import default_model_path

        model_path = default_model_path()
    target = load_target(model_path, dtype)
    sampling = SamplingParams(temp=temp, top_p=top_p, top_k=top_k, min_p=min_p).check(target.vocab_size)
    drafter = make_drafter(method, target, dict(
        draft_model=draft_model, ngram_max=ngram_max, ngram_min=ngram_min,
        num_draft_tokens=num_draft_tokens, dtype=dtype, sampling=sampling, seed=seed,
        tree_budget=tree_budget, tree_topk=tree_topk))
    return Engine(target, drafter, num_draft_tokens=num_draft_tokens, sampling=sampling, seed=seed)


def stats_line(stats) -> str:
    return (f"prompt: {stats.prompt_tokens} tokens, {stats.prompt_tokens_per_second:.1f} tok/s | "
            f"generated: {stats.generated_tokens} tokens in {stats.steps} steps, "
            f"{stats.tokens_per_step:.2f} tokens/step, acceptance {stats.acceptance_rate:.0%}, "
            f"{stats.tokens_per_second:.1f} tok/s")


def echo_err(text: str, **kwargs) -> None:
    click.echo(text, err=True, **kwargs)


def stream(events, out=sys.stdout, pieces=None):
    """Print text as it is committed; return (generated token ids, text, Stats). `pieces`
    collects the text printed so far, which survives an interrupted stream."""
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
        elif event[0] == "done":
            stats = event[1]
    return tokens, "".join(pieces), stats
