"""Suffix decoding: the draft tree from counted continuations, the memory file (bounded, atomic,
never trusted when corrupt or foreign, two writers at once), and exact output whatever it drafts."""

import json
import subprocess
import sys

import numpy as np
import pytest

from mlx_spec.drafters.base import Draft, Drafter
from mlx_spec.drafters.combined import Combined, expected_tokens
from mlx_spec.drafters.suffix import ContextIndex, SuffixDrafter, best_tree
from mlx_spec.engine import Engine
from mlx_spec.suffix_memory import SuffixMemory
from tiny import plain_greedy, run, tiny_target

PROMPT = [1, 5, 7, 9, 11, 13, 2, 5, 7, 9, 11, 13, 2, 5, 7, 9, 4, 6, 5, 7]


def test_the_index_finds_what_followed_the_longest_suffix():
    index = ContextIndex()
    for token in [1, 2, 3, 9, 1, 2, 4, 1, 2]:
        index.append(token)
    n, continuations = index.continuations(depth=3)
    assert n == 2  # "1 2": "9 1 2" and "4 1 2" never occurred before
    assert continuations == [[4, 1, 2], [3, 9, 1]]  # most recent first
    index.append(5)
    assert index.continuations(depth=3) == (0, [])


def test_the_tree_takes_the_most_probable_continuations():
    continuations = [[5, 6], [5, 6], [5, 7], [8], [5, 6]]
    draft, expected = best_tree(continuations, match_length=4, depth=2, budget=16, chain=False)
    # counts / (occurrences + 1/m), m the tokens matched: 5 -> 4/5.25, 8 -> 1/5.25;
    # after 5 (matched over 5 tokens): 6 -> 3/4.2, 7 -> 1/4.2
    assert draft.tokens == [5, 8, 6, 7] and draft.parents == [0, 0, 1, 1]
    assert draft.confidence == pytest.approx([4 / 5.25, 1 / 5.25, 3 / 4.2, 1 / 4.2])
    assert expected == pytest.approx(4 / 5.25 + 1 / 5.25 + 4 / 5.25 * 3 / 4.2 + 4 / 5.25 * 1 / 4.2)
    # one occurrence is rated as prompt lookup rates a match of the same length
    assert best_tree([[5, 6]], match_length=3, depth=2, budget=16, chain=True)[0].confidence == pytest.approx(
        [3 / 4, 4 / 5]
    )
    chain, _ = best_tree(continuations, match_length=4, depth=2, budget=16, chain=True)
    assert chain.tokens == [5, 6] and chain.parents is None
    # a short match drafts at most FACTOR nodes per matched token; the budget and depth bound it too
    assert len(best_tree(continuations, match_length=1, depth=2, budget=16, chain=False)[0]) == 4
    assert len(best_tree(continuations, match_length=4, depth=2, budget=2, chain=False)[0]) == 2
    assert best_tree(continuations, match_length=4, depth=1, budget=16, chain=False)[0].tokens == [5, 8]
    # below MIN_PROBABILITY: a token seen once among many others is not drafted
    rare = [[3]] * 12 + [[4]]
    assert best_tree(rare, match_length=4, depth=1, budget=16, chain=False)[0].tokens == [3]


def memory_at(path, **kwargs):
    return SuffixMemory(path, "vocab-a", **kwargs)


def test_the_memory_persists_and_is_searched(tmp_path):
    path = tmp_path / "m.npz"
    memory = memory_at(path)
    memory.add([10, 11, 12, 13, 14])
    memory.add([20, 11, 12, 15])
    assert memory.continuations([7, 11, 12], depth=2) == (2, [[15], [13, 14]])  # most recent first
    memory.save()
    again = memory_at(path)
    assert again.continuations([10, 11, 12], depth=2) == (3, [[13, 14]])
    assert again.continuations([99], depth=2) == (0, [])
    again.add([30, 10, 11, 12, 16])  # merged into the built index
    assert again.continuations([10, 11, 12], depth=2) == (3, [[16], [13, 14]])


def test_the_memory_is_bounded_oldest_first(tmp_path):
    memory = memory_at(tmp_path / "m.npz", max_tokens=100)
    for i in range(30):
        memory.add([1000 + i] + list(range(i * 10, i * 10 + 9)))
        memory.save()
    assert 75 <= len(memory) <= 100
    reread = memory_at(tmp_path / "m.npz", max_tokens=100)
    assert len(reread) == len(memory)
    assert reread.continuations([1029], depth=1) == (1, [[290]])  # the newest stays
    assert reread.continuations([1000], depth=1) == (0, [])  # the oldest went


def test_a_write_is_atomic(tmp_path, monkeypatch):
    path = tmp_path / "m.npz"
    memory = memory_at(path)
    memory.add([1, 2, 3])
    memory.save()
    before = path.read_bytes()

    def broken(*args, **kwargs):
        raise OSError("disk full")

    memory.add([4, 5, 6])
    monkeypatch.setattr(np, "savez", broken)
    with pytest.raises(OSError):
        memory.save()
    assert path.read_bytes() == before
    assert sorted(p.name for p in tmp_path.iterdir()) == ["m.npz", "m.npz.lock"]


@pytest.mark.parametrize("damage", ["garbage", "truncated", "foreign"])
def test_a_corrupt_or_foreign_file_is_rebuilt_with_a_warning(tmp_path, capsys, damage):
    path = tmp_path / "m.npz"
    memory = memory_at(path)
    memory.add([1, 2, 3, 4])
    memory.save()
    if damage == "garbage":
        path.write_bytes(b"not a memory")
    elif damage == "truncated":
        path.write_bytes(path.read_bytes()[:100])
    fresh = SuffixMemory(path, "vocab-b" if damage == "foreign" else "vocab-a")
    assert fresh.continuations([1, 2], depth=2) == (0, [])
    warning = capsys.readouterr().err.strip().splitlines()
    assert len(warning) == 1 and "starting a new one" in warning[0], warning
    fresh.add([7, 8, 9])
    fresh.save()
    assert SuffixMemory(path, fresh.vocabulary).continuations([7, 8], depth=1) == (2, [[9]])


WRITER = """
import sys
from mlx_spec.suffix_memory import SuffixMemory
memory = SuffixMemory(sys.argv[1], "vocab-a")
base = int(sys.argv[2])
for i in range(20):
    memory.add([base + i, base + i + 1, base + i + 2])
    memory.save()
"""


def test_two_processes_writing_at_once_keep_both(tmp_path):
    path = tmp_path / "m.npz"
    writers = [subprocess.Popen([sys.executable, "-c", WRITER, str(path), str(base)]) for base in (100, 200)]
    assert [w.wait(timeout=120) for w in writers] == [0, 0]
    memory = memory_at(path)
    assert len(memory) == 2 * 20 * 3
    for base in (100, 200):
        assert memory.continuations([base + 19, base + 20], depth=1) == (2, [[base + 21]])


def test_greedy_output_is_the_targets_trees_chains_and_memory(tmp_path):
    target = tiny_target("llama", seed=3)
    expected = plain_greedy(target.model, PROMPT, 40)
    memory = memory_at(tmp_path / "m.npz")
    for k in (3, 8):
        for tree_budget in (16, 0):
            drafter = SuffixDrafter(tree_budget, memory)
            tokens, stats = run(Engine(target, drafter, num_draft_tokens=k, adaptive=False), PROMPT, 40)
            assert tokens == expected, (k, tree_budget)
            assert stats.verified_drafts > 0
    # The outputs went to the memory: a fresh drafter, on a prompt that ends where an output
    # began, drafts the rest of that output from it.
    other = PROMPT + expected[:6]
    expected = plain_greedy(target.model, other, 30)
    without = run(Engine(target, SuffixDrafter(16, None), num_draft_tokens=8, adaptive=False), other, 30)
    with_memory = run(
        Engine(target, SuffixDrafter(16, memory), num_draft_tokens=8, adaptive=False), other, 30
    )
    assert without[0] == with_memory[0] == expected
    assert with_memory[1].accepted_drafts >= without[1].accepted_drafts + 20


@pytest.mark.parametrize("arch, tree", [("qwen3_next", True), ("gemma3_text", False)])
def test_trees_where_the_cache_holds_them(arch, tree):
    """Recurrent layers hold trees (one depth at a time); a sliding window does not: chains."""
    from mlx_spec.drafters import make_drafter
    from test_windowed import target_of

    target = target_of(arch)
    drafter = make_drafter("suffix", target, {"suffix_memory": "off"})
    assert drafter.tree == tree
    tokens, stats = run(Engine(target, drafter, num_draft_tokens=4, adaptive=False), PROMPT, 30)
    assert tokens == plain_greedy(target.model, PROMPT, 30) and stats.verified_drafts > 0


class Fixed(Drafter):
    """Proposes the same chain with given confidences; counts its proposals and commits."""

    def __init__(self, tokens, confidence):
        self.draft, self.proposed, self.committed = Draft(tokens=tokens, confidence=confidence), 0, []

    def propose(self, k):
        self.proposed += 1
        return self.draft

    def commit(self, accepted, next_token, taps):
        self.committed.append(list(accepted) + [next_token])


def test_suffix_plus_runs_the_learned_drafter_only_where_the_match_is_weak():
    strong, weak, learned = Fixed([1, 2, 3], [1.0, 1.0, 1.0]), Fixed([1], [0.3]), Fixed([4, 5], [0.9, 0.9])
    assert expected_tokens(learned.draft) == pytest.approx(0.9 + 0.81)
    both = Combined(strong, learned, 4)
    assert both.propose(4) is strong.draft and learned.proposed == 0
    both = Combined(weak, learned, 4)
    assert both.propose(4) is learned.draft and learned.proposed == 1
    both.commit([4], 7, {})  # both members keep step with what was committed
    assert weak.committed == learned.committed == [[4, 7]]


def test_generate_feeds_the_memory_and_prints_the_targets_text(tmp_path):
    from test_cli import assert_one_line_error, cli

    memory = tmp_path / "memory.npz"
    args = ["generate", "Repeat exactly: red, green, blue, red, green, blue.", "--max-tokens", "24", "--json"]
    code, plain, err = cli(args + ["--draft", "none"])
    assert code == 0, err
    tokens = json.loads(plain)["tokens"]
    for _ in range(2):  # the second run drafts from the first one's output too
        code, out, err = cli(args + ["--draft", "suffix", "--suffix-memory", str(memory)])
        assert code == 0, err
        assert json.loads(out)["tokens"] == tokens
    with np.load(memory) as f:
        # each output with the end-of-text token that ended it (what comes after an answer is learnt too)
        assert (
            f["lengths"].tolist() == [len(tokens) + 1] * 2 and f["tokens"][: len(tokens)].tolist() == tokens
        )
    code, _, err = cli(args + ["--draft", "suffix", "--suffix-memory", str(tmp_path)])
    assert_one_line_error(code, err, "--suffix-memory", "a directory")
