"""Why speculation over mlx-lm's quantized KV cache (--kv-bits) follows mlx-lm's output only up
to rounding: the log-probabilities of a verification pass (k + 1 positions at once) against
those of mlx-lm's one-token decoding (mlx_lm.generate_step with the same flags), teacher-forced
on mlx-lm's own greedy output, on the default model.

    python benchmarks/kv_quantization_rounding.py [--prompt-tokens 1500] [--max-tokens 60]

A pass over several positions computes each position's K/V with a different matmul shape than
one-token decoding: the same numbers up to the last bits of float32. A float cache keeps that
difference (~1e-5); a quantized cache rounds each K/V to 8 or 4 bits, and a value that lies
within those last bits of a rounding step rounds the other way: the difference becomes a step of
the quantization, and grows through the layers above."""

import mlx_spec  # noqa: F401  (loads OpenBLAS before mlx.core does any work)

# isort: split

import mlx.core as mx
import numpy as np
from mlx_lm.generate import generate_step, maybe_quantize_kv_cache

from kv_cache_memory import setup
from mlx_spec.cache import make_cache


def main():
    opts, target, prompt = setup(__doc__, 60)
    start, n = opts.quantized_kv_start, opts.max_tokens
    print(f"prompt {len(prompt)} tokens, {n} generated (mlx-lm greedy), quantized from position {start}")
    print("| cache | positions per pass | median max abs log-prob difference | largest | argmax differs |")
    print("|---|---|---|---|---|")
    for bits in (None, 8, 4):
        flags = dict(kv_bits=bits, kv_group_size=64, quantized_kv_start=start) if bits else {}
        reference, logprobs = [], []
        for token, lp in generate_step(mx.array(prompt), target.model, max_tokens=n, **flags):
            reference.append(int(token))
            logprobs.append(np.array(lp))
        sequence = prompt + reference
        for width in (1, 4):
            cache = make_cache(target.model)
            target.model(mx.array(prompt[:-1])[None], cache=cache)
            if bits:
                maybe_quantize_kv_cache(cache, start, 64, bits)
            differences, flips = [], 0
            for first in range(0, n, width):  # passes over [last token, next width - 1 tokens]
                chunk = sequence[len(prompt) - 1 + first : len(prompt) - 1 + min(first + width, n)]
                logits = target.model(mx.array(chunk)[None], cache=cache)[0]
                lp = np.array(logits - mx.logsumexp(logits, axis=-1, keepdims=True))
                for j in range(len(chunk)):
                    differences.append(np.abs(lp[j] - logprobs[first + j]).max())
                    flips += int(lp[j].argmax() != reference[first + j])
            differences = np.array(differences)
            print(
                f"| {'float32' if bits is None else f'{bits}-bit'} | {width} | {np.median(differences):.1e} | "
                f"{differences.max():.1e} | {flips} of {n} |",
                flush=True,
            )


if __name__ == "__main__":
    main()
