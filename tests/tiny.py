"""Tiny random models in real formats (mlx-lm config.json + model.safetensors)."""

import json
from pathlib import Path

import mlx.core as mx
import numpy as np
from mlx.utils import tree_flatten, tree_map

import mlx_spec  # noqa: F401  (loads OpenBLAS before mlx.core does any work)
from mlx_spec.drafters.base import Draft, Drafter
from mlx_spec.events import Collector
from mlx_spec.models.target import Target


def tiny_config(arch="llama", vocab_size=32, hidden_size=64, num_layers=2, context=1024, **extra):
    config = dict(
        model_type=arch,
        hidden_size=hidden_size,
        num_hidden_layers=num_layers,
        intermediate_size=2 * hidden_size,
        num_attention_heads=4,
        num_key_value_heads=2,
        rms_norm_eps=1e-5,
        vocab_size=vocab_size,
        max_position_embeddings=context,
        rope_theta=10000.0,
        tie_word_embeddings=False,
    )
    if arch == "qwen3":
        config["head_dim"] = hidden_size // 4
    config.update(extra)
    return config


def tiny_model(config, seed=0, scale=6.0):
    """Random weights, scaled up so that greedy text is varied rather than one repeated token."""
    from mlx_lm.utils import _get_classes

    model_class, args_class = _get_classes(config)
    mx.random.seed(seed)
    model = model_class(args_class.from_dict(config))
    model.update(tree_map(lambda p: p * scale if p.ndim == 2 else p, model.parameters()))
    mx.eval(model.parameters())
    return model


def tiny_target(arch="llama", seed=0, scale=6.0, **kwargs):
    config = tiny_config(arch, **kwargs)
    return Target(tiny_model(config, seed, scale), None, config)


def save_model(model, config, path) -> Path:
    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    (path / "config.json").write_text(json.dumps(config, indent=2))
    mx.save_safetensors(str(path / "model.safetensors"), dict(tree_flatten(model.parameters())))
    return path


def plain_greedy(model, prompt, max_tokens):
    """Reference: mlx-lm's own decoding loop."""
    from mlx_lm.generate import generate_step

    return [int(t) for t, _ in generate_step(mx.array(prompt), model, max_tokens=max_tokens)]


def renormalised(logprobs: mx.array) -> mx.array:
    """mlx-lm's logprobs [V] (logits - mx.logsumexp(logits)) normalised again in float64: MLX's
    CPU log-sum-exp is off by up to 1.3e-4 at the default model's logits, the engine's (numpy's,
    mlx_spec/logprobs.py) by ~1e-6; what both are compared with is the exact value."""
    values = np.asarray(logprobs, dtype=np.float64)
    peak = values.max()
    return mx.array((values - peak - np.log(np.exp(values - peak).sum())).astype(np.float32))


def run(engine, prompt, max_tokens, **kwargs):
    """(generated token ids, Stats) of one engine.generate call."""
    collected = Collector.of(engine.generate(prompt, max_tokens=max_tokens, **kwargs))
    return collected.tokens, collected.stats


def tiny_chat_model_dir(path, seed=0, **config):
    """A tiny random model (config: tiny_config's overrides) with the default model's tokenizer
    and chat template."""
    import shutil

    from mlx_spec.convert.default import default_model_path

    config = tiny_config(**{"vocab_size": 49152, "hidden_size": 64, "context": 2048, **config})
    path = save_model(tiny_model(config, seed=seed, scale=4.0), config, path)
    for name in ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json"):
        shutil.copy(default_model_path() / name, path / name)
    return path


class ScriptedDrafter(Drafter):
    """Drafts the reference continuation with every `wrong_every`-th token corrupted, so that
    each step accepts a known number of drafts (tests the loop, not a drafting strategy)."""

    def __init__(self, reference, wrong_every, vocab):
        self.reference, self.wrong_every, self.vocab = reference, wrong_every, vocab
        self.position = 0
        self.last = []

    def propose(self, k):
        drafts = list(self.reference[self.position : self.position + k])
        for i in range(len(drafts)):
            if (self.position + i) % self.wrong_every == self.wrong_every - 1:
                drafts[i] = (drafts[i] + 1) % self.vocab
        self.last = drafts
        return Draft(tokens=drafts)

    def commit(self, accepted, next_token, taps):
        self.position += len(accepted) + 1
