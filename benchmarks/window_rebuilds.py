"""How often a sliding-window cache has to be rebuilt from the tokens (issue 42, part 4).

mlx-lm's RotatingKVCache rolls back exactly by a slice after a pass over several tokens (its
entries are then in temporal order, cache._rollback_rotating); after a one-token pass past the
window it has rotated over the entries a rollback would need, and the engine rebuilds the cache
from the tokens (exact, a prefill). A rollback always follows a verification pass over several
tokens, so a rebuild should only come where a rollback reaches behind the last pass: a new
prompt that leaves the cached conversation earlier than the window. This counts them, on tiny
random Gemma-3 and gpt-oss shapes (alternating sliding and global layers) and a Llama-4 shape
(chunked attention: a ChunkedKVCache drops the previous chunk, so a rollback across a chunk
boundary rebuilds), windows and chunks of 8 and 32 tokens, 200 generated tokens per turn, three chat turns (each extends the last), then a
prompt that edits an early message; drafting with lookup and with a draft model of the same
shape (rejections at every length).

    .venv/bin/python benchmarks/window_rebuilds.py
"""

import mlx_spec  # noqa: F401  (OpenBLAS before mlx.core)

# isort: split

import mlx.core as mx
from mlx.utils import tree_map

from mlx_spec.drafters.draft_model import DraftModelDrafter
from mlx_spec.drafters.lookup import LookupDrafter
from mlx_spec.engine import Engine
from mlx_spec.events import Step, Token
from mlx_spec.models.target import Target


def shapes(window):
    common = dict(
        hidden_size=64,
        num_hidden_layers=4,
        intermediate_size=128,
        num_attention_heads=4,
        num_key_value_heads=2,
        rms_norm_eps=1e-5,
        vocab_size=32,
        max_position_embeddings=4096,
        rope_theta=10000.0,
        tie_word_embeddings=False,
        head_dim=16,
        sliding_window=window,
    )
    return {
        "gemma3_text": dict(
            common, model_type="gemma3_text", sliding_window_pattern=2, query_pre_attn_scalar=16
        ),
        "gpt_oss": dict(
            common,
            model_type="gpt_oss",
            num_local_experts=4,
            num_experts_per_tok=2,
            layer_types=["sliding_attention", "full_attention"] * 2,
        ),
        # Llama 4: chunked attention (ChunkedKVCache) in three layers of four
        "llama4": dict(
            model_type="llama4",
            text_config=dict(
                common,
                model_type="llama4_text",
                attention_bias=False,
                attention_chunk_size=window,
                interleave_moe_layer_step=2,
                intermediate_size_mlp=128,
                num_experts_per_tok=1,
                num_local_experts=2,
                rope_scaling=None,
                use_qk_norm=True,
            ),
        ),
    }


def tiny(config, seed):
    from mlx_lm.utils import _get_classes

    model_class, args_class = _get_classes(config)
    mx.random.seed(seed)
    model = model_class(args_class.from_dict(config))
    model.update(tree_map(lambda p: p * 3.0 if p.ndim == 2 else p, model.parameters()))
    mx.eval(model.parameters())
    return Target(model, None, config)


class Counting(Engine):
    """Counts rebuilds: resets of a cache that held tokens."""

    rebuilds = 0

    def reset(self):
        if getattr(self, "session", None) is not None and self.cached_tokens:
            self.rebuilds += 1
        super().reset()


def main():
    prompt = [1, 5, 7, 9, 11, 13, 2, 5, 7, 9, 11, 13, 2, 5, 7]
    print("| model | window | drafts | steps | rollbacks | rebuilds |")
    print("|---|---|---|---|---|---|")
    for window in (8, 32):
        for arch, config in shapes(window).items():
            target = tiny(config, 0)
            for name, drafter in (
                ("lookup", LookupDrafter()),
                ("draft model", DraftModelDrafter(tiny(config, 4), 32)),
            ):
                engine = Counting(target, drafter, num_draft_tokens=4, adaptive=False)
                context, steps, rollbacks = list(prompt), 0, 0
                for _turn in range(3):
                    output = []
                    for event in engine.generate(context, max_tokens=200):
                        if isinstance(event, Step):
                            steps += 1
                            rollbacks += event.accepted < event.verified
                        elif isinstance(event, Token):
                            output.append(event.id)
                    context = context + output + [3, 4]
                # An earlier message edited: the new prompt leaves the conversation 10 tokens in,
                # far behind the window (mlx-lm's own prompt cache cannot trim back there either).
                for _ in engine.generate(prompt[:10] + [3, 4], max_tokens=20):
                    pass
                print(
                    f"| {arch} | {window} | {name} | {steps} | {rollbacks} | {engine.rebuilds} |", flush=True
                )


if __name__ == "__main__":
    main()
