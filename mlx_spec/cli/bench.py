import secrets
from pathlib import Path

import click

from ..drafters import DRAFTERS, option_names
from .common import GroupedCommand, config_options, echo_err, reports_errors


@click.command(
    "bench", cls=GroupedCommand, short_help="Time draft methods against plain mlx-lm, per prompt category."
)
@click.option("--prompts", default=None, help='JSONL: {"prompt"} or {"question_id", "category", "turns"}.')
@click.option("--category", "categories", multiple=True, help="Only these categories (repeatable).")
@click.option(
    "--methods",
    default="none,lookup",
    show_default=True,
    help=f"Comma-separated draft methods: auto, {', '.join(DRAFTERS)}.",
)
@click.option(
    "--draft-model",
    "draft_models",
    multiple=True,
    help="METHOD=PATH (or PATH for every method that needs one; a directory or a repo id); repeatable.",
)
@click.option(
    "--max-tokens",
    "-m",
    type=click.IntRange(1),
    default=128,
    show_default=True,
    help="Most tokens generated per prompt (and per turn).",
)
@click.option(
    "--repeats",
    type=click.IntRange(1),
    default=3,
    show_default=True,
    help="Runs of each prompt per method; the table reports medians.",
)
@click.option(
    "--concurrency",
    type=click.IntRange(0),
    default=0,
    show_default=True,
    help="N > 0: every prompt's first turn, N at once (batched), against mlx-lm's batched generation; "
    "aggregate tok/s.",
)
@click.option("--json", "json_path", default=None, help="Write every per-prompt record here.")
@click.option("--markdown", "markdown_path", default=None, help="Write the table as Markdown here.")
@click.option("--plot", "plot_path", default=None, help="Write a PNG plot here (needs matplotlib).")
@config_options(exclude={"draft", "draft_model"})
@reports_errors
def bench(
    prompts,
    categories,
    methods,
    draft_models,
    max_tokens,
    repeats,
    concurrency,
    json_path,
    markdown_path,
    plot_path,
    **options,
):
    """Time draft methods side by side with plain mlx_lm.stream_generate (--concurrency N: several
    prompts at once, batched, against mlx-lm's batched generation; --sharding: over a target
    split across the processes mlx.launch starts, against mlx-lm's decoding of the same split
    target, the two runs of a pair one after the other; rank 0 prints). Every method runs with
    the options given, those it reads (--tree-budget: the sources of trees); --seed, the same
    for every method, makes them print the same text when sampling."""
    from .. import bench as harness
    from ..api import draft_model_path
    from ..api import model_path as resolve_model
    from ..config import EngineConfig, build_engine, engine_settings
    from ..distributed import SplitTarget
    from ..errors import MlxSpecError
    from ..models.target import load_target
    from ..suffix_memory import SuffixMemory, default_path, vocabulary_hash

    # Check what would only fail after the whole run: where the results go, matplotlib.
    for out in (json_path, markdown_path, plot_path):
        if out and not Path(out).resolve().parent.is_dir():
            raise MlxSpecError(f"cannot write {out}: no directory {Path(out).resolve().parent}")
    if plot_path:
        try:
            import matplotlib  # noqa: F401
        except ImportError:
            raise MlxSpecError("--plot needs matplotlib (pip install matplotlib)") from None
    config = EngineConfig.of(**options)
    names = [m.strip() for m in methods.split(",") if m.strip()]
    if not names:
        raise MlxSpecError("--methods names no method")
    paths = {}
    for spec in draft_models:
        method, sep, path = spec.partition("=")
        if sep:
            paths[method] = path
        else:
            paths.update({name: spec for name in names})
    sharding, residual, cache = config.split.sharding, config.sampling.residual_sampling, config.cache
    if sharding and (concurrency or residual):
        raise MlxSpecError(
            "--sharding times one generation at a time, each drawn by the seeded rule: "
            "drop --concurrency and --residual-sampling"
        )
    items = harness.load_prompts(prompts, categories)
    model = resolve_model(config.model.path_or_hf_repo, config.model.revision)
    split = SplitTarget(model, config.model.dtype, sharding, config.split.rank_timeout) if sharding else None
    target = split.target if split else load_target(model, config.model.dtype)
    sampling = config.sampling.params().check(target.vocab_size)
    seed = config.sampling.seed if config.sampling.seed is not None else secrets.randbits(31)
    if split and config.sampling.seed is None:
        seed = split.leaders(seed)  # every rank draws with rank 0's
    cache_flags = (
        dict(
            kv_bits=cache.kv_bits,
            kv_group_size=cache.kv_group_size,
            quantized_kv_start=cache.quantized_kv_start,
        )
        if cache.kv_bits
        else {}
    )
    if cache.max_kv_size:
        cache_flags["max_kv_size"] = cache.max_kv_size
    if cache_flags and concurrency:
        raise MlxSpecError("--concurrency batches plain KV caches: drop --kv-bits and --max-kv-size")
    if split and not split.leader:  # this rank runs rank 0's passes, then ends quietly
        split.follow(
            harness.follow_baseline(target, harness.baseline_sampler(sampling, seed), cache_flags),
            **engine_settings(config),
        )
        return
    # Every repeat sees the memory as it was before the run (read, not fed while timed).
    memory_path = config.draft.suffix_memory
    memory = (
        None
        if memory_path == "off"
        else SuffixMemory(
            Path(memory_path).expanduser() if memory_path else default_path(target),
            vocabulary_hash(target.tokenizer),
            learn_now=False,
        )
    )
    sources = {name: name for name in names}  # what each method runs: auto's choice for auto
    built = {}  # drafters already built: auto's, checked to fit
    if "auto" in names:
        from ..auto import SOURCE_OPTIONS, choose

        choice = choose(target, config.with_draft("auto", **{option: None for option in SOURCE_OPTIONS}))
        sources["auto"], paths["auto"], built["auto"] = choice.draft, choice.draft_model, choice.drafter
        echo_err(f"bench: --draft auto runs {choice.draft} ({choice.why})")
    engines = {
        name: build_engine(
            target,
            method_config(
                config, sources[name], draft_model_path(sources[name], paths.get(name)), memory, seed
            ),
            split,
            drafter=built.get(name),
        )
        for name in names
    }

    total = (
        repeats * len(engines) * (len(items) if concurrency else sum(len(item["turns"]) for item in items))
    )
    with click.progressbar(length=total, label="bench", file=click.get_text_stream("stderr")) as bar:
        if concurrency:
            records = harness.run_concurrent(
                target, engines, items, max_tokens, repeats, sampling, seed, concurrency, progress=bar.update
            )
        else:
            records = harness.run_bench(
                target,
                engines,
                items,
                max_tokens,
                repeats,
                sampling,
                seed,
                progress=bar.update,
                residual=residual,
                cache_flags=cache_flags,
                channel=split.channel if split else None,
            )
    if split:
        split.close()
    if memory is not None:
        memory.save()
    rows = harness.summarize(records)
    meta = harness.machine_info(
        target, {name: drafter_used(sources[name], target, paths.get(name)) for name in names}
    )
    meta.update(config.flat())
    meta.update(
        max_tokens=max_tokens,
        repeats=repeats,
        concurrency=concurrency or None,
        ranks=split.channel.group.size() if split else None,
        seed=seed,
        num_draft_tokens={name: engine.num_draft_tokens for name, engine in engines.items()},
        sampling_rule="residual" if residual else "seeded",
        suffix_memory=str(memory.path) if memory is not None else None,
    )
    click.echo(harness.render_table(rows))
    if json_path:
        harness.write_json(json_path, meta, rows, records)
    if markdown_path:
        with open(markdown_path, "w") as f:
            f.write(harness.render_markdown(rows, meta))
    if plot_path:
        harness.plot(rows, plot_path)
    echo_err(
        f"{meta['machine']}; mlx {meta['mlx']}, mlx-lm {meta['mlx-lm']}; {meta['device']}, {meta['dtype']}"
    )
    if repeats == 1:
        echo_err(
            "--repeats 1: one run per prompt, no spread; a speedup within a few percent of 1.00x is "
            "noise here (--repeats 3 gives medians)"
        )


def method_config(config, method: str, draft_model, memory, seed):
    """`config` for one of bench's methods: the source's own options where it reads them (the
    others are for other methods), --stop-early where it stops early, one seed for all."""
    from dataclasses import replace

    reads = DRAFTERS[method].options.names()
    given = {
        name: getattr(config.draft, name) if name in reads else None
        for name in option_names()
        if name not in ("draft_model", "suffix_memory")  # set below
    }
    return replace(
        config.with_draft(
            method,
            draft_model=draft_model if "draft_model" in reads else None,
            suffix_memory=(memory or "off") if "suffix_memory" in reads else None,
            stop_early=config.draft.stop_early and DRAFTERS[method].stops_early,
            **given,
        ),
        sampling=replace(config.sampling, seed=seed),
    )


def drafter_used(method: str, target, given):
    """The checkpoint a method drafted with: the one given, the one shipped for the default
    model, or None (lookup, none, layerskip; MTP from the target's own weights)."""
    from ..api import draft_model_path
    from ..models.default import shipped_drafter

    if given:
        return draft_model_path(method, given)
    shipped = DRAFTERS[method].shipped and shipped_drafter(DRAFTERS[method].shipped, target.path)
    return str(shipped) if shipped and "draft_model" in DRAFTERS[method].options.names() else None
