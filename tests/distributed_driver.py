"""Runs on every rank of a split target (tests/test_distributed.py starts two on 127.0.0.1):
a tiny random target built alike on each rank and split by mlx-lm's sharding; mlx-lm's own
decoding over the split target, then mlx-spec's with several sources. Rank 0 writes what each
case generated (or why it was refused) as JSON.

    python distributed_driver.py ARCH SHARDING OUT.json WORKDIR"""

import json
import sys
from pathlib import Path

import mlx_spec  # noqa: F401  (first: it loads OpenBLAS before mlx.core does any work)

# isort: split
import mlx.core as mx

from mlx_spec.cache import KVQuantization
from mlx_spec.distributed import STOP, Channel, Follower, Watchdog, init_group, shard_model, split_engine
from mlx_spec.errors import MlxSpecError
from mlx_spec.models.target import Target
from mlx_spec.sampling import SamplingParams
from tiny import run, tiny_config, tiny_model

PROMPT = [1, 5, 7, 9, 5, 7, 2, 3]
TOKENS = 24
SEED = 7
# Small enough to build on every rank; heads, KV heads and MLP width split in two.
EXTRA = {
    "qwen3": dict(num_layers=3, head_dim=32),  # 32: a KV quantization group
    "qwen3_next": dict(
        head_dim=16,
        linear_num_value_heads=2,
        linear_num_key_heads=2,
        linear_key_head_dim=16,
        linear_value_head_dim=16,
        linear_conv_kernel_dim=4,
        num_experts=4,
        num_experts_per_tok=2,
        decoder_sparse_step=1,
        shared_expert_intermediate_size=64,
        mlp_only_layers=[],
        moe_intermediate_size=32,
        partial_rotary_factor=0.25,
        full_attention_interval=2,
        num_hidden_layers=4,
    ),
}


def model_of(arch, seed=0, **overrides):
    config = tiny_config(arch, **{**EXTRA[arch], **overrides})
    return tiny_model(config, seed=seed, scale=6.0), config


def split_target_of(arch, workdir):
    """(model, config, its MTP module's directory or None): qwen3_next as published with an MTP
    module (test_mtp.write_published), which drafts from the last layer's output."""
    if arch != "qwen3_next":
        return (*model_of(arch), None)
    from test_mtp import write_published

    Path(workdir).mkdir(parents=True, exist_ok=True)
    path, target, _, _ = write_published(Path(workdir), arch)
    return target.model, target.config, path


KV_BITS = dict(kv_bits=4, kv_group_size=32, quantized_kv_start=0)


def mlx_lm_greedy(model, prompt, n, **cache_flags):
    from mlx_lm.generate import generate_step, generation_stream

    tokens = [int(t) for t, _ in generate_step(mx.array(prompt), model, max_tokens=n, **cache_flags)]
    # generate_step computes one step ahead, on its own stream: let that pass's collectives end
    # before any other's start.
    mx.synchronize(generation_stream)
    return tokens


def drafters(target, workdir, mtp_path):
    """name -> a function making the drafter (each case gets a fresh one)."""
    from mlx_spec.drafters.draft_model import DraftModelDrafter
    from mlx_spec.drafters.lookup import LookupDrafter
    from mlx_spec.drafters.medusa import MedusaDrafter
    from mlx_spec.models.medusa import load_medusa
    from test_medusa import random_heads, write

    draft_model, draft_config = model_of("qwen3", seed=3, num_layers=1)
    draft = Target(draft_model, None, draft_config)
    cases = {
        "none": lambda: None,
        "lookup": LookupDrafter,
        "draft_model": lambda: DraftModelDrafter(draft, target.vocab_size),
    }
    sys.path.insert(0, str(Path(__file__).parent))
    from mlx_spec.drafters.dflash import DFlashDrafter
    from mlx_spec.drafters.eagle import EagleDrafter
    from test_windowed import random_feature_models

    eagle, dflash = random_feature_models(target, Path(workdir))
    cases["eagle"] = lambda: EagleDrafter(eagle, target.vocab_size)
    cases["dflash"] = lambda: DFlashDrafter(target, dflash)
    medusa = load_medusa(
        write(Path(workdir) / "medusa", random_heads(target.hidden_size, target.vocab_size)), target
    )
    cases["medusa"] = lambda: MedusaDrafter(target, medusa)
    if mtp_path is not None:
        from mlx_spec.models.mtp import load_mtp

        mtp = load_mtp(mtp_path, target)
        cases["mtp"] = lambda: EagleDrafter(mtp, target.vocab_size)
    return cases


def recording(drafter):
    """The drafter, its proposals recorded in drafter.proposed (token lists)."""
    if drafter is None:
        return None
    drafter.proposed, propose = [], drafter.propose

    def record(k):
        draft = propose(k)
        drafter.proposed.append(
            draft.tokens.tolist() if hasattr(draft.tokens, "tolist") else list(draft.tokens)
        )
        return draft

    drafter.propose = record
    return drafter


def main(arch, sharding, out, workdir):
    group = init_group(sharding)
    model, config, mtp_path = split_target_of(arch, Path(workdir) / f"rank{group.rank()}")
    shard_model(model, config, sharding, group)
    mx.eval(model.parameters())
    target = Target(model, None, config)
    # mlx-lm's own decoding of the split target (every rank runs it), the reference.
    reference = mlx_lm_greedy(model, PROMPT, TOKENS)
    quantized = mlx_lm_greedy(model, PROMPT, TOKENS, **KV_BITS) if arch == "qwen3" else None
    kv_quantization = KVQuantization(*KV_BITS.values())
    if group.rank() != 0:
        channel = Channel.connect(group, target)
        Follower(target, channel).follow()
        if quantized is not None:  # the same ranks, a quantized cache (--kv-bits, --draft none)
            Follower(target, channel, kv_quantization=kv_quantization).follow()
        return
    channel = Channel.connect(group, target, Watchdog(60))
    results = {"mlx_lm": reference, "cases": {}, "refused": {}}
    for name, make in drafters(target, workdir, mtp_path).items():
        try:
            engine = split_engine(target, recording(make()), channel, num_draft_tokens=4, adaptive=False)
        except MlxSpecError as e:
            results["refused"][name] = str(e)
            continue
        first, stats = run(engine, PROMPT, TOKENS)
        drafts = list(getattr(engine.drafter, "proposed", []))
        # A second turn: the cache keeps the first, drafts roll back on every rank.
        follow_up = PROMPT + first + [3, 4]
        second, _ = run(engine, follow_up, TOKENS)
        sampled = run(engine, PROMPT, TOKENS, sampling=SamplingParams(temp=1.0), seed=SEED)[0]
        results["cases"][name] = dict(
            first=first,
            second=second,
            follow_up=follow_up,
            sampled=sampled,
            proposed=stats.verified_drafts,
            drafts=drafts,
        )
    channel.send(STOP)
    if quantized is not None:
        engine = split_engine(target, None, channel, kv_quantization=kv_quantization)
        results["kv_bits"] = dict(mlx_lm=quantized, mlx_spec=run(engine, PROMPT, TOKENS)[0])
        channel.send(STOP)
    Path(out).write_text(json.dumps(results))


if __name__ == "__main__":
    main(*sys.argv[1:])
