"""Sanity figures for the draft-model source on the default model (issue: exact sampling).

tau with a tiny random draft model (expected ~1: its drafts are almost never accepted) and with
the target as its own draft (expected K + 1 at temperature 0: every draft is accepted).

    .venv/bin/python benchmarks/draft_model_sanity.py [--max-tokens 64] [--k 4]
"""

import argparse
import json
import shutil
import tempfile
from pathlib import Path

import mlx_spec  # noqa: F401  (OpenBLAS before mlx.core)

# isort: split
import mlx.core as mx
from mlx.utils import tree_flatten, tree_map
from mlx_lm.utils import _get_classes

from mlx_spec.convert.default import default_model_path
from mlx_spec.drafters.draft_model import DraftModelDrafter, check_same_vocabulary
from mlx_spec.engine import Engine
from mlx_spec.events import Collector
from mlx_spec.models.target import load_target
from mlx_spec.sampling import SamplingParams

PROMPTS = [
    "What are three good habits for better sleep?",
    "Write a Python function that reverses a list.",
    "Summarize: The lighthouse on Brennick Point was built in 1871 after three ships ran aground.",
]


def random_draft_dir(path: Path) -> Path:
    """A 2-layer random Llama with the default model's tokenizer, in the mlx-lm format."""
    config = dict(
        model_type="llama",
        hidden_size=64,
        num_hidden_layers=2,
        intermediate_size=128,
        num_attention_heads=4,
        num_key_value_heads=2,
        rms_norm_eps=1e-5,
        vocab_size=49152,
        max_position_embeddings=8192,
        rope_theta=10000.0,
        tie_word_embeddings=True,
    )
    model_class, args_class = _get_classes(config)
    mx.random.seed(0)
    model = model_class(args_class.from_dict(config))
    model.update(tree_map(lambda p: p * 4 if p.ndim == 2 else p, model.parameters()))
    path.mkdir(parents=True)
    (path / "config.json").write_text(json.dumps(config))
    mx.save_safetensors(str(path / "model.safetensors"), dict(tree_flatten(model.parameters())))
    for name in ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json"):
        shutil.copy(default_model_path() / name, path / name)
    return path


def tau(target, draft, k, temp, max_tokens):
    sampling = SamplingParams(temp=temp)
    committed = steps = 0
    for text in PROMPTS:
        prompt = target.tokenizer.apply_chat_template(
            [{"role": "user", "content": text}], add_generation_prompt=True
        )
        engine = Engine(
            target,
            DraftModelDrafter(draft, target.vocab_size),
            num_draft_tokens=k,
            sampling=sampling,
            seed=0,
            adaptive=False,
        )
        stats = Collector.of(engine.generate(prompt, max_tokens=max_tokens)).stats
        committed, steps = committed + stats.committed_tokens, steps + stats.steps
    return committed / steps


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--k", type=int, default=4)
    args = parser.parse_args()
    target = load_target(default_model_path(), "float32")
    with tempfile.TemporaryDirectory() as tmp:
        random_draft = load_target(random_draft_dir(Path(tmp) / "draft"), "float32")
        check_same_vocabulary(target, random_draft)
        for temp in (0.0, 1.0):
            print(
                f"K={args.k} temp={temp}: tau random draft = {tau(target, random_draft, args.k, temp, args.max_tokens):.2f}, "
                f"tau target as its own draft = {tau(target, target, args.k, temp, args.max_tokens):.2f}"
            )


if __name__ == "__main__":
    main()
