"""The adaptive policy's decisions with the engine's clock made deterministic (each reading
10 ms after the last), so that two versions of the code can be compared for the same decisions
without timing noise: run at each commit and diff the outputs.

    .venv/bin/python benchmarks/policy_decisions.py eagle lookup > after.txt

One line per held-out prompt (arithmetic, code, summarize; 64 tokens): method, tokens, steps,
plain steps, drafts verified, accepted, drafted, a hash of the output."""

import itertools
import json
import sys
from pathlib import Path

from mlx_spec import engine as engine_module  # the package loads OpenBLAS before mlx.core
from mlx_spec.api import load
from mlx_spec.events import Collector

ticks = itertools.count()
engine_module.time.perf_counter = lambda: next(ticks) * 0.01
prompts = [json.loads(l) for l in open(Path(__file__).resolve().parent / "heldout_prompts.jsonl")]
texts = [
    p.get("prompt") or p["turns"][0]
    for p in prompts
    if p.get("category") in ("arithmetic", "code", "summarize")
]
for method in sys.argv[1:]:
    engine, tok = load(draft=method, seed=0)
    for t in texts:
        ids = tok.apply_chat_template([{"role": "user", "content": t}], add_generation_prompt=True)
        collected = Collector.of(engine.generate(ids, max_tokens=64))
        out, s = collected.tokens, collected.stats
        print(
            method,
            len(out),
            s.steps,
            s.plain_steps,
            s.verified_drafts,
            s.accepted_drafts,
            s.drafted_tokens,
            hash(tuple(out)) % 10**8,
            flush=True,
        )
