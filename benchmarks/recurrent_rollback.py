"""Cost of rolling back recurrent layers (issue 16), on Qwen3-Next-shaped layers.

Three layers of Gated DeltaNet and one of attention with Qwen3-Next-80B-A3B's widths (hidden
2048, 16 key / 32 value heads of 128 for the linear attention, 16 query / 2 KV heads of 256),
with 8 experts instead of 512 so that it fits; random float32 weights; 512 tokens of context.
For a verification pass of k+1 tokens it times, as medians of several runs:
  pass     the verification pass itself (recording what a Replay needs costs nothing extra);
  replay   cache.Replay.roll_back to m kept tokens: the recurrent layers again over m positions;
  rebuild  what a rollback cost before: the cache from scratch over the context (prefill).
and reports the memory each way holds per step: a Replay keeps the state from before the pass
(references) and the recurrent layers' inputs; a recurrence that emitted its state at every
position (the issue's option (b), not built) would hold k+1 states per layer.

    .venv/bin/python benchmarks/recurrent_rollback.py [--context 512] [--repeats 5]
"""

import argparse
import statistics
import time

import mlx_spec  # noqa: F401  (loads OpenBLAS before mlx.core does any work)

# isort: split

import mlx.core as mx
from mlx.utils import tree_map

from mlx_spec.cache import Replay, rollback_to
from mlx_spec.models.target import Target

CONFIG = dict(
    model_type="qwen3_next",
    hidden_size=2048,
    num_hidden_layers=4,
    intermediate_size=512,
    num_attention_heads=16,
    num_key_value_heads=2,
    head_dim=256,
    rms_norm_eps=1e-6,
    vocab_size=1024,
    max_position_embeddings=4096,
    rope_theta=10000.0,
    tie_word_embeddings=False,
    linear_num_value_heads=32,
    linear_num_key_heads=16,
    linear_key_head_dim=128,
    linear_value_head_dim=128,
    linear_conv_kernel_dim=4,
    num_experts=8,
    num_experts_per_tok=2,
    decoder_sparse_step=1,
    shared_expert_intermediate_size=512,
    mlp_only_layers=[],
    moe_intermediate_size=512,
    partial_rotary_factor=0.25,
    full_attention_interval=4,
)


def median_ms(fn, repeats):
    times = []
    for _ in range(repeats):
        tic = time.perf_counter()
        fn()
        times.append(time.perf_counter() - tic)
    return 1000 * statistics.median(times)


def qwen3_next_shaped() -> Target:
    """CONFIG's model, random float32 weights (matrices scaled to std 0.02)."""
    from mlx_lm.utils import _get_classes

    model_class, args_class = _get_classes(CONFIG)
    mx.random.seed(0)
    model = model_class(args_class.from_dict(CONFIG))
    model.update(
        tree_map(lambda p: p * 0.02 / max(p.std().item(), 1e-6) if p.ndim >= 2 else p, model.parameters())
    )
    mx.eval(model.parameters())
    return Target(model, None, CONFIG)


def setup():
    """(--context and --repeats, the model, a random context of that length)."""
    parser = argparse.ArgumentParser()
    parser.add_argument("--context", type=int, default=512)
    parser.add_argument("--repeats", type=int, default=5)
    args = parser.parse_args()
    return args, qwen3_next_shaped(), mx.random.randint(0, CONFIG["vocab_size"], (1, args.context))


def main():
    args, target, context = setup()
    model = target.model

    def prefilled():
        cache = model.make_cache()
        mx.eval(model(context, cache=cache))
        return cache

    rebuild = median_ms(prefilled, args.repeats)
    print(f"context {args.context}; rebuild (prefill from scratch): {rebuild:.0f} ms")
    print(
        "| k+1 | pass ms | replay m=1 ms | replay m=k/2 ms | replay m=k ms | held by Replay MB | option (b) MB |"
    )
    print("|---|---|---|---|---|---|---|")
    for fed in (2, 5, 9):
        step = mx.random.randint(0, CONFIG["vocab_size"], (1, fed))
        cache = prefilled()
        state_bytes = sum(a.nbytes for c in cache if hasattr(c, "cache") for a in c.cache if a is not None)

        passes, replays = [], {}
        for keep in sorted({1, max(1, (fed - 1) // 2), fed - 1}):
            times = []
            for _ in range(args.repeats):
                tic = time.perf_counter()
                replay = Replay(args.context)
                mx.eval(target.forward(step, cache, replay=replay)[0])
                passes.append(time.perf_counter() - tic)
                tic = time.perf_counter()
                assert rollback_to(cache, args.context + keep, replay)
                times.append(time.perf_counter() - tic)
                assert rollback_to(cache, args.context, replay)  # back to the context
            replays[keep] = 1000 * statistics.median(times)
        inputs = sum(call[1].nbytes for call in replay.calls)
        keeps = sorted(replays)
        print(
            f"| {fed} | {1000 * statistics.median(passes):.0f} | {replays[keeps[0]]:.0f} | "
            f"{replays[keeps[len(keeps) // 2]]:.0f} | {replays[keeps[-1]]:.0f} | "
            f"{(state_bytes + inputs) / 2**20:.1f} | {fed * state_bytes / 2**20:.1f} |"
        )


if __name__ == "__main__":
    main()
