"""Reduced draft vocabularies (models/vocabulary.py) for the drafters that use a whole-vocabulary
head (MTP, Medusa, DFlash, DDTree): the rows match the output layer's (float, tied, quantized),
a drafter with one drafts only inside it, greedy output stays token-identical and sampling exact,
and a bad vocabulary file is one line."""

import mlx.core as mx
import mlx.nn as nn
import numpy as np
import pytest

from exactness import STRICT, VOCAB, repeated_prompt, sampling_pvalue
from mlx_spec.drafters.ddtree import DDTreeDrafter
from mlx_spec.drafters.dflash import DFlashDrafter
from mlx_spec.drafters.eagle import EagleDrafter
from mlx_spec.drafters.medusa import MedusaDrafter
from mlx_spec.engine import Engine
from mlx_spec.errors import MlxSpecError
from mlx_spec.models import vocabulary
from mlx_spec.models.dflash import load_dflash
from mlx_spec.models.medusa import load_medusa
from mlx_spec.models.mtp import load_mtp
from mlx_spec.sampling import SamplingParams
from test_dflash import random_dflash
from test_medusa import random_heads
from test_medusa import write as write_medusa
from test_mtp import write_published
from tiny import plain_greedy, run, tiny_target

PROMPT = [1, 5, 7, 9, 11, 13, 2, 5, 7, 9, 11, 13, 2, 5]


def test_frequent_ids_and_d2t_round_trip(tmp_path):
    ids = vocabulary.frequent_ids([[3, 3, 9, 1], [9, 9, 3, 0]], 12, 3)
    assert ids.tolist() == [0, 3, 9]  # counts 3:3, 9:3, then 0 and 1 tie at 1: lower id
    vocabulary.write(tmp_path, ids)
    assert vocabulary.read(tmp_path, 12).tolist() == [0, 3, 9]
    assert vocabulary.read(tmp_path / "missing", 12) is None


@pytest.mark.parametrize("layer", ["linear", "embedding", "quantized-linear", "quantized-embedding"])
def test_rows_are_the_output_layers_columns(layer):
    mx.random.seed(0)
    module = nn.Linear(64, 96, bias=False) if "linear" in layer else nn.Embedding(96, 64)
    if "quantized" in layer:
        module = module.to_quantized(group_size=32, bits=4)
    full = module.as_linear if "embedding" in layer else module
    ids = np.array([0, 5, 17, 40, 95])
    x = mx.random.normal((3, 64))
    got = vocabulary.OutputRows([module], ids)(x)
    assert np.allclose(np.array(got), np.array(full(x))[:, ids], atol=1e-4)


def test_a_bad_vocabulary_file_is_one_line(tmp_path):
    (tmp_path / vocabulary.FILE).write_bytes(b"not a safetensors file")
    with pytest.raises(MlxSpecError, match="cannot read"):
        vocabulary.read(tmp_path, 32)
    mx.save_safetensors(str(tmp_path / vocabulary.FILE), {"d2t": mx.array([0, 40], mx.int32)})
    with pytest.raises(MlxSpecError, match=r"ids 0\.\.41 .*not into the target's 0\.\.31"):
        vocabulary.read(tmp_path, 32)
    mx.save_safetensors(str(tmp_path / vocabulary.FILE), {"d2t": mx.array([3, 2], mx.int32)})
    with pytest.raises(MlxSpecError, match="1 distinct"):
        vocabulary.read(tmp_path, 32)


def half_vocabulary(path, vocab_size, seed=0):
    ids = np.sort(np.random.default_rng(seed).permutation(vocab_size)[: vocab_size // 2])
    vocabulary.write(path, ids)
    return ids


def only_inside(engine, ids, prompt, n):
    """Generate; every proposed token lies in ids (checked on each step's draft)."""
    drafted, propose = [], engine.drafter.propose

    def recording(k):
        draft = propose(k)
        drafted.extend(np.array(draft.tokens).tolist() if draft.tokens is not None else [])
        return draft

    engine.drafter.propose = recording
    tokens, stats = run(engine, prompt, n)
    assert drafted and set(drafted) <= set(ids.tolist())
    return tokens, stats


def test_mtp_drafts_inside_its_vocabulary(tmp_path):
    path, target, _, _ = write_published(tmp_path, "llama")
    full = load_mtp(path, target)
    ids = half_vocabulary(path, target.vocab_size)
    model = load_mtp(path, target)
    assert model.draft_vocab_size == len(ids) and model.draft_ids.tolist() == ids.tolist()
    hidden = mx.random.normal((1, 2, target.hidden_size), key=mx.random.key(3))
    assert np.allclose(np.array(model.logits(hidden)), np.array(full.logits(hidden))[..., ids], atol=1e-4)
    engine = Engine(target, EagleDrafter(model, target.vocab_size), num_draft_tokens=3, adaptive=False)
    assert only_inside(engine, ids, PROMPT, 40)[0] == plain_greedy(target.model, PROMPT, 40)


@pytest.mark.parametrize("compact", [False, True], ids=["own-heads", "compact"])
@pytest.mark.parametrize("tree_budget", [0, 6], ids=["chain", "tree"])
def test_medusa_drafts_inside_its_vocabulary(tmp_path, compact, tree_budget):
    target = tiny_target(scale=3.0)
    path = write_medusa(
        tmp_path / "m", random_heads(64, 32, compact=compact), extra={"medusa_shared_head": compact}
    )
    full = load_medusa(path, target)
    ids = half_vocabulary(path, target.vocab_size, seed=1)
    model = load_medusa(path, target)
    hidden = model.fuse(mx.random.normal((1, 64), key=mx.random.key(1)))
    assert np.allclose(np.array(model(hidden, 4)), np.array(full(hidden, 4))[..., ids], atol=1e-4)
    engine = Engine(
        target,
        MedusaDrafter(target, model, tree_budget=tree_budget, tree_topk=3),
        num_draft_tokens=3,
        adaptive=False,
    )
    assert only_inside(engine, ids, PROMPT, 40)[0] == plain_greedy(target.model, PROMPT, 40)


@pytest.mark.parametrize("tree", [False, True], ids=["dflash", "ddtree"])
def test_dflash_drafts_inside_its_vocabulary(tmp_path, tree):
    target = tiny_target("qwen3", scale=3.0)
    model, _, _ = random_dflash(tmp_path, target)
    ids = half_vocabulary(tmp_path / "dflash-0", target.vocab_size, seed=2)
    model = load_dflash(tmp_path / "dflash-0", target)
    drafter = DDTreeDrafter(target, model, budget=8, topk=3) if tree else DFlashDrafter(target, model)
    engine = Engine(target, drafter, num_draft_tokens=4, adaptive=False)
    assert only_inside(engine, ids, PROMPT, 40)[0] == plain_greedy(target.model, PROMPT, 40)


# Sampling: the residual rule's q is scattered back to the target's vocabulary (a chain), and
# the seeded rule's noise is read at the draft vocabulary's ids (a tree): one run each.
def test_mtp_samples_exactly_with_a_reduced_vocabulary(tmp_path):
    path, target, _, _ = write_published(tmp_path, "llama", seed=2, vocab_size=VOCAB, scale=2.0)
    half_vocabulary(path, VOCAB, seed=3)
    params = SamplingParams(temp=1.0)
    engine = Engine(
        target,
        EagleDrafter(load_mtp(path, target), VOCAB),
        num_draft_tokens=3,
        sampling=params,
        residual=True,
        seed=1,
        adaptive=False,
    )
    pvalue = sampling_pvalue(engine, repeated_prompt(), params)
    assert pvalue > STRICT, f"p = {pvalue:.2e}"


def test_medusa_tree_samples_exactly_with_a_reduced_vocabulary(tmp_path):
    target = tiny_target(vocab_size=VOCAB, scale=2.0, seed=4)
    path = write_medusa(tmp_path / "m", random_heads(64, VOCAB, seed=2))
    half_vocabulary(path, VOCAB, seed=5)
    params = SamplingParams(temp=1.0)
    engine = Engine(
        target,
        MedusaDrafter(target, load_medusa(path, target), tree_budget=6, tree_topk=2),
        num_draft_tokens=3,
        sampling=params,
        seed=1,
        adaptive=False,
    )
    pvalue = sampling_pvalue(engine, repeated_prompt(), params)
    assert pvalue > STRICT, f"p = {pvalue:.2e}"
