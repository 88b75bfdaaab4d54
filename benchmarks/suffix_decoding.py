"""Suffix decoding where it is meant to pay, and what its memory is worth, in one run.

The workloads (benchmarks/workloads/*.jsonl, written for mlx-spec): code edited over turns (a
file, then "rename ...", then "add a docstring ..."), JSON of one schema filled with different
data, and an answer re-quoted. Each workload has two sets of prompts of the same kind. The
first set is answered once by --draft suffix with a fresh memory (not timed): that fills the
memory. The second set is then timed by the bench harness (each method paired in turns with
plain mlx-lm, medians of --repeats runs) for: lookup; suffix with that memory (searched as it
was before the timed run, so every repeat sees the same); suffix without a memory; and the peer,
Rapid-MLX's SuffixDecodingDrafter (PyPI rapid-mlx, pure Python: `pip install --no-deps
rapid-mlx`), driven through the same verification loop with every draft verified, as Rapid-MLX
runs it (its own confidence cut is its policy).

  python benchmarks/suffix_decoding.py --markdown out.md --json out.json
"""

import argparse
import json
import sys
import tempfile
from pathlib import Path

WORKLOADS = Path(__file__).resolve().parent / "workloads"


def rapid_mlx_drafter():
    """Rapid-MLX's drafter as an mlx-spec Drafter (a chain; its truncation at min_confidence
    decides the length). ImportError where rapid-mlx is not installed."""
    from rapid_mlx.speculative.suffix_decoding import SuffixDecodingDrafter

    from mlx_spec.drafters.base import Draft, Drafter

    class Peer(Drafter):
        def prefill(self, context, taps, start):
            self.peer = SuffixDecodingDrafter()
            self.peer.add_prompt_tokens(list(context))

        def propose(self, k):
            return Draft(tokens=self.peer.get_draft()[:k])

        def commit(self, accepted, next_token, taps):
            for token in list(accepted) + [next_token]:
                self.peer.add_generated_token(token)

    return Peer()


def answer(engine, tokenizer, turns, max_tokens):
    """Answer a conversation's turns in order (each answer joins the history)."""
    from mlx_spec.events import Collector

    history = []
    for user in turns:
        history.append({"role": "user", "content": user})
        prompt = tokenizer.apply_chat_template(history, add_generation_prompt=True)
        tokens = Collector.of(engine.generate(prompt, max_tokens=max_tokens)).tokens
        history.append({"role": "assistant", "content": tokenizer.decode(tokens)})


def main():
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--workloads", default="edit,structured,requote")
    parser.add_argument("--max-tokens", type=int, default=200)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--temp", type=float, default=0.0)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--json", dest="json_path")
    parser.add_argument("--markdown", dest="markdown_path")
    args = parser.parse_args()

    from mlx_spec import bench as harness
    from mlx_spec.api import model_path
    from mlx_spec.drafters.lookup import LookupDrafter
    from mlx_spec.drafters.suffix import SuffixDrafter
    from mlx_spec.engine import Engine
    from mlx_spec.models.target import load_target
    from mlx_spec.sampling import SamplingParams
    from mlx_spec.suffix_memory import SuffixMemory, vocabulary_hash

    target = load_target(model_path(None, None), "auto")
    sampling = SamplingParams(temp=args.temp).check(target.vocab_size)
    vocabulary = vocabulary_hash(target.tokenizer)
    first, second = [], []
    for name in args.workloads.split(","):
        path = WORKLOADS / f"{name}.jsonl"
        sets = {row["question_id"]: row["set"] for row in map(json.loads, path.read_text().splitlines())}
        for item in harness.load_prompts(path):
            (first if sets[item["question_id"]] == "first" else second).append(item)

    memory_file = Path(tempfile.mkdtemp()) / "memory.npz"
    filler = Engine(
        target,
        SuffixDrafter(16, SuffixMemory(memory_file, vocabulary)),
        num_draft_tokens=12,
        sampling=sampling,
        seed=args.seed,
    )
    for item in first:
        answer(filler, target.tokenizer, item["turns"], args.max_tokens)
    memory = SuffixMemory(memory_file, vocabulary, learn_now=False)
    memory_tokens = len(memory)  # before the timed run, which adds its outputs to the file
    print(
        f"memory after the first set: {memory_tokens} tokens of {len(memory.outputs)} outputs",
        file=sys.stderr,
    )

    drafters = {
        "lookup": (LookupDrafter(), 10, True),
        "suffix": (SuffixDrafter(16, memory), 12, True),
        "suffix, no memory": (SuffixDrafter(16, None), 12, True),
    }
    try:
        drafters["rapid-mlx suffix"] = (rapid_mlx_drafter(), 8, False)
    except ImportError as e:
        print(f"the peer is left out: {e} (pip install --no-deps rapid-mlx)", file=sys.stderr)
    engines = {
        name: Engine(
            target, drafter, num_draft_tokens=k, sampling=sampling, seed=args.seed, adaptive=adaptive
        )
        for name, (drafter, k, adaptive) in drafters.items()
    }
    records = harness.run_bench(target, engines, second, args.max_tokens, args.repeats, sampling, args.seed)
    rows = harness.summarize(records)
    print(harness.render_table(rows))
    meta = harness.machine_info(target, {})
    meta.update(
        max_tokens=args.max_tokens,
        repeats=args.repeats,
        temp=args.temp,
        workloads=args.workloads,
        memory_tokens=memory_tokens,
        peer="rapid-mlx " + _version("rapid-mlx"),
        note="second set of each workload, timed; the first set filled the suffix memory",
    )
    if args.json_path:
        harness.write_json(args.json_path, meta, rows, records)
    if args.markdown_path:
        Path(args.markdown_path).write_text(harness.render_markdown(rows, meta))


def _version(package):
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version(package)
    except PackageNotFoundError:
        return "not installed"


if __name__ == "__main__":
    main()
