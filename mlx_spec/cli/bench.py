from pathlib import Path

import click

from ..drafters import DRAFTERS
from ..models.target import DTYPES
from .common import GroupedCommand, echo_err, cache_options, reports_errors, sharding_options, source_defaults


@click.command("bench", cls=GroupedCommand, short_help="Time draft methods against plain mlx-lm, per prompt category.")
@click.option("--model", "model_path", default=None,
              help="mlx-lm model: a directory or a Hugging Face repo id (default: the embedded model).")
@click.option("--revision", default=None, help="The model's revision on the Hugging Face hub.")
@click.option("--dtype", default="auto", show_default=True, help=f"{'|'.join(DTYPES)}.")
@click.option("--prompts", default=None, help="JSONL: {\"prompt\"} or {\"question_id\", \"category\", \"turns\"}.")
@click.option("--category", "categories", multiple=True, help="Only these categories (repeatable).")
@click.option("--methods", default="none,lookup", show_default=True,
              help=f"Comma-separated draft methods: {', '.join(DRAFTERS)}.")
@click.option("--draft-model", "draft_models", multiple=True,
              help="METHOD=PATH (or PATH for every method that needs one; a directory or a repo id); "
                   "repeatable.")
@click.option("--num-draft-tokens", type=click.IntRange(0), default=None,
              help="Most drafts per step, for every method (default: each method's own).")
@click.option("--tree-budget", type=click.IntRange(0, 512), default=None,
              help=f"Nodes of a draft tree (0: a chain), for the methods that draft trees: {source_defaults('tree_budget')}.")
@click.option("--tree-topk", type=click.IntRange(1, 64), default=None,
              help=f"Children per expanded node (eagle), candidates per position: {source_defaults('tree_topk')}.")
@click.option("--exit-layer", type=int, default=None,
              help="layerskip: the target's first E layers (then its norm and head) draft.")
@click.option("--suffix-memory", default="off", show_default=True,
              help="suffix and suffix+X: a file of earlier outputs, searched as it was before the run (every "
                   "repeat sees the same memory) and fed the run's outputs at its end; off: no memory.")
@click.option("--max-tokens", "-m", type=click.IntRange(1), default=128, show_default=True,
              help="Most tokens generated per prompt (and per turn).")
@click.option("--repeats", type=click.IntRange(1), default=3, show_default=True,
              help="Runs of each prompt per method; the table reports medians.")
@click.option("--concurrency", type=click.IntRange(0), default=0, show_default=True,
              help="N > 0: every prompt's first turn, N at once (batched), against mlx-lm's batched generation; "
                   "aggregate tok/s.")
@click.option("--temp", type=float, default=0.0, show_default=True, help="Sampling temperature (0: greedy).")
@click.option("--top-p", type=float, default=1.0, show_default=True, help="Nucleus sampling.")
@click.option("--seed", type=int, default=0, show_default=True,
              help="Sampling seed, the same for every method (which then all print the same text).")
@click.option("--stop-early", is_flag=True,
              help="Chain drafters that draft one position at a time stop once the next draft "
                   "would not pay (a sync per draft).")
@click.option("--adaptive/--fixed", default=True, show_default=True,
              help="Let the policy choose how many drafts to verify, or always --num-draft-tokens.")
@click.option("--residual-sampling", "residual", is_flag=True,
              help="Accept sampled drafts by the residual rule (not reproducible across methods).")
@click.option("--json", "json_path", default=None, help="Write every per-prompt record here.")
@click.option("--markdown", "markdown_path", default=None, help="Write the table as Markdown here.")
@click.option("--plot", "plot_path", default=None, help="Write a PNG plot here (needs matplotlib).")
@cache_options
@sharding_options
@reports_errors
def bench(model_path, revision, dtype, prompts, categories, methods, draft_models, num_draft_tokens,
          tree_budget, tree_topk, exit_layer, suffix_memory, max_tokens, repeats, concurrency, temp, top_p, seed, stop_early, adaptive,
          residual, json_path, markdown_path, plot_path, max_kv_size, kv_bits, kv_group_size, quantized_kv_start,
          sharding, rank_timeout):
    """Time draft methods side by side with plain mlx_lm.stream_generate (--concurrency N: several
    prompts at once, batched, against mlx-lm's batched generation; --sharding: over a target
    split across the processes mlx.launch starts, against mlx-lm's decoding of the same split
    target, the two runs of a pair one after the other; rank 0 prints)."""
    from .. import bench as harness
    from ..cache import KVQuantization
    from ..distributed import SplitTarget
    from ..api import draft_model_path
    from ..api import model_path as resolve_model
    from ..drafters import draft_tokens, make_drafter, source_options
    from ..engine import Engine
    from ..errors import MlxSpecError
    from ..models.target import load_target
    from ..sampling import SamplingParams
    from ..suffix_memory import SuffixMemory, vocabulary_hash

    # Check what would only fail after the whole run: where the results go, matplotlib.
    for out in (json_path, markdown_path, plot_path):
        if out and not Path(out).resolve().parent.is_dir():
            raise MlxSpecError(f"cannot write {out}: no directory {Path(out).resolve().parent}")
    if plot_path:
        try:
            import matplotlib  # noqa: F401
        except ImportError:
            raise MlxSpecError("--plot needs matplotlib (pip install matplotlib)") from None
    names = [m.strip() for m in methods.split(",") if m.strip()]
    paths = {}
    for spec in draft_models:
        method, sep, path = spec.partition("=")
        if sep:
            paths[method] = path
        else:
            paths.update({name: spec for name in names})
    if sharding and (concurrency or residual):
        raise MlxSpecError("--sharding times one generation at a time, each drawn by the seeded rule: "
                           "drop --concurrency and --residual-sampling")
    if rank_timeout is not None and not sharding:
        raise MlxSpecError("--rank-timeout is for a split target: give --sharding too")
    items = harness.load_prompts(prompts, categories)
    split = SplitTarget(resolve_model(model_path, revision), dtype, sharding, rank_timeout) if sharding else None
    target = split.target if split else load_target(resolve_model(model_path, revision), dtype)
    sampling = SamplingParams(temp=temp, top_p=top_p).check(target.vocab_size)
    memory = None if suffix_memory == "off" else SuffixMemory(
        Path(suffix_memory).expanduser(), vocabulary_hash(target.tokenizer), learn_now=False)
    kv_quantization = KVQuantization(kv_bits, kv_group_size, quantized_kv_start) if kv_bits else None
    cache_flags = dict(kv_bits=kv_bits, kv_group_size=kv_group_size, quantized_kv_start=quantized_kv_start) \
        if kv_bits else {}
    if max_kv_size:
        cache_flags["max_kv_size"] = max_kv_size
    if cache_flags and concurrency:
        raise MlxSpecError("--concurrency batches plain KV caches: drop --kv-bits and --max-kv-size")
    if split and not split.leader:   # this rank runs rank 0's passes, then ends quietly
        split.follow(harness.follow_baseline(target, harness.baseline_sampler(sampling, seed), cache_flags),
                     kv_quantization=kv_quantization, max_kv_size=max_kv_size)
        return
    engines, lengths = {}, {}
    for name in names:
        lengths[name] = draft_tokens(name, num_draft_tokens)
        given = dict(tree_budget=tree_budget, tree_topk=tree_topk, exit_layer=exit_layer,   # to the sources that read them
                     suffix_memory=memory if memory is not None else "off")
        drafter = make_drafter(name, target, source_options(
            name, draft_model=draft_model_path(name, paths.get(name)), dtype=dtype,
            **{k: v for k, v in given.items() if k in DRAFTERS[name].options.names()}))
        settings = dict(num_draft_tokens=lengths[name], sampling=sampling, seed=seed, residual=residual,
                        adaptive=adaptive, stop_early=stop_early, kv_quantization=kv_quantization,
                        max_kv_size=max_kv_size)
        engines[name] = split.engine(drafter, **settings) if split else Engine(target, drafter, **settings)
    if not engines:
        raise MlxSpecError("--methods names no method")

    total = repeats * len(engines) * (len(items) if concurrency else sum(len(item["turns"]) for item in items))
    with click.progressbar(length=total, label="bench", file=click.get_text_stream("stderr")) as bar:
        if concurrency:
            records = harness.run_concurrent(target, engines, items, max_tokens, repeats, sampling, seed,
                                             concurrency, progress=bar.update)
        else:
            records = harness.run_bench(target, engines, items, max_tokens, repeats, sampling, seed,
                                        progress=bar.update, residual=residual, cache_flags=cache_flags,
                                        channel=split.channel if split else None)
    if split:
        split.close()
    if memory is not None:
        memory.save()
    rows = harness.summarize(records)
    meta = harness.machine_info(target, {name: drafter_used(name, target, paths.get(name)) for name in names})
    meta.update(max_tokens=max_tokens, repeats=repeats, temp=temp, num_draft_tokens=lengths,
                concurrency=concurrency or None, sharding=sharding,
                ranks=split.channel.group.size() if split else None,
                sampling_rule="residual" if residual else "seeded", adaptive=adaptive, stop_early=stop_early,
                tree_budget=tree_budget, tree_topk=tree_topk, exit_layer=exit_layer,
                suffix_memory=suffix_memory if memory is not None else None, **cache_flags)
    click.echo(harness.render_table(rows))
    if json_path:
        harness.write_json(json_path, meta, rows, records)
    if markdown_path:
        with open(markdown_path, "w") as f:
            f.write(harness.render_markdown(rows, meta))
    if plot_path:
        harness.plot(rows, plot_path)
    echo_err(f"{meta['machine']}; mlx {meta['mlx']}, mlx-lm {meta['mlx-lm']}; {meta['device']}, {meta['dtype']}")
    if repeats == 1:
        echo_err("--repeats 1: one run per prompt, no spread; a speedup within a few percent of 1.00x is "
                 "noise here (--repeats 3 gives medians)")


def drafter_used(method: str, target, given):
    """The checkpoint a method drafted with: the one given, the one shipped for the default
    model, or None (lookup, none, layerskip; MTP from the target's own weights)."""
    from ..api import draft_model_path
    from ..models.default import shipped_drafter

    if given:
        return draft_model_path(method, given)
    shipped = shipped_drafter("dflash" if method == "ddtree" else method, target.path)
    return str(shipped) if shipped and "draft_model" in DRAFTERS[method].options.names() else None
