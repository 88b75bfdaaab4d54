"""The memory of the target's KV cache after a long generation with mlx-lm's quantized cache
(--kv-bits 8 and 4) against the float cache, on the default model, decoded by the engine with
--draft none (speculation over a quantized cache is refused: kv_quantization_rounding.py); and
whether each output equals plain mlx-lm's with the same flags (mlx_lm.generate_step).

    python benchmarks/kv_cache_memory.py [--prompt-tokens 1500] [--max-tokens 256]

The prompt is standard-library documentation to summarize;
the cache is quantized from --quantized-kv-start on (default 512, inside the prompt)."""

import argparse
import collections
import functools
import inspect
import json

import mlx_spec  # noqa: F401  (loads OpenBLAS before mlx.core does any work)

# isort: split

import mlx.core as mx
from mlx_lm.generate import generate_step

from mlx_spec.cache import KVQuantization
from mlx_spec.convert.default import default_model_path
from mlx_spec.engine import Engine
from mlx_spec.events import Collector
from mlx_spec.models.target import load_target


def documentation_prompt(tokenizer, tokens: int):
    """A chat prompt asking for a summary of `tokens` tokens of standard-library documentation."""
    doc = "\n\n".join(inspect.getdoc(obj) or "" for obj in (collections, functools, json, inspect))
    body = tokenizer.encode(doc)[:tokens]
    return tokenizer.apply_chat_template(
        [
            {
                "role": "user",
                "content": "Summarize this documentation, quoting its key sentences:\n\n"
                + tokenizer.decode(body),
            }
        ],
        add_generation_prompt=True,
    )


def setup(doc: str, max_tokens: int):
    """(--prompt-tokens, --max-tokens, --quantized-kv-start; the default model in float32; its
    documentation prompt)."""
    parser = argparse.ArgumentParser(description=doc, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--prompt-tokens", type=int, default=1500)
    parser.add_argument("--max-tokens", type=int, default=max_tokens)
    parser.add_argument("--quantized-kv-start", type=int, default=512)
    opts = parser.parse_args()
    target = load_target(default_model_path(), "float32")
    return opts, target, documentation_prompt(target.tokenizer, opts.prompt_tokens)


def main():
    opts, target, prompt = setup(__doc__, 256)
    print(
        f"prompt {len(prompt)} tokens, {opts.max_tokens} generated, quantized from position "
        f"{opts.quantized_kv_start}"
    )
    print("| cache | KV cache MB | tok/s | identical to mlx-lm with the same flags |")
    print("|---|---|---|---|")
    for bits in (None, 8, 4):
        kv = KVQuantization(bits, 64, opts.quantized_kv_start) if bits else None
        engine = Engine(target, kv_quantization=kv)
        collected = Collector.of(engine.generate(prompt, max_tokens=opts.max_tokens))
        tokens, stats = collected.tokens, collected.stats
        flags = (
            dict(kv_bits=bits, kv_group_size=64, quantized_kv_start=opts.quantized_kv_start) if bits else {}
        )
        reference = []
        for token, _ in generate_step(mx.array(prompt), target.model, max_tokens=opts.max_tokens, **flags):
            if int(token) in target.eos_token_ids:
                break
            reference.append(int(token))
        same = [t for t in tokens if t not in target.eos_token_ids] == reference
        mb = sum(c.nbytes for c in engine.cache) / 2**20
        print(
            f"| {'float32' if bits is None else f'{bits}-bit'} | {mb:.1f} | "
            f"{stats.tokens_per_second:.1f} | {'yes' if same else 'NO'} ({len(tokens)} tokens) |",
            flush=True,
        )


if __name__ == "__main__":
    main()
