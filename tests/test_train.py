"""Drafter training: the training-time graphs equal the inference graphs, a few steps lower the
loss, checkpoints load through the public loaders and draft losslessly, resume is exact."""

import json

import mlx.core as mx
import numpy as np
import pytest
from mlx.utils import tree_map

from mlx_spec.drafters import make_drafter
from mlx_spec.drafters.dflash import DFlashDrafter
from mlx_spec.drafters.eagle import EagleDrafter
from mlx_spec.engine import Engine
from mlx_spec.errors import MlxSpecError
from mlx_spec.models.dflash import DFlashModel, load_dflash
from mlx_spec.models.dflash import ModelArgs as DFlashArgs
from mlx_spec.models.eagle3 import load_eagle3
from mlx_spec.models.target import load_target
from mlx_spec.sampling import SamplingParams
from mlx_spec.train.dflash import (
    DFlashOptions,
    block_mask,
    block_sparse_forward,
    new_dflash_model,
    position_weights,
    sample_anchors,
    train_dflash,
)
from mlx_spec.train.eagle import EagleOptions, draft_vocabulary, new_eagle_model, train_eagle, ttt_forward
from mlx_spec.train.loop import FeatureStore, TrainSequence, batch_indices, load_sequences
from tiny import plain_greedy, run, tiny_chat_model_dir, tiny_target

VOCAB = 48
GREEDY = SamplingParams()


@pytest.fixture(scope="module")
def target():
    # Four layers: EAGLE-3's default fused layers (inputs of 2, N//2, N-3) are distinct taps.
    return tiny_target("llama", vocab_size=VOCAB, seed=3, scale=3.0, num_layers=4, hidden_size=32)


@pytest.fixture(scope="module")
def data(target, tmp_path_factory):
    """The target's own greedy answers to short random prompts, as `train data` writes them."""
    rng = np.random.default_rng(0)
    path = tmp_path_factory.mktemp("data")
    rows = []
    for i in range(8):
        prompt = [int(t) for t in rng.integers(1, VOCAB, size=int(rng.integers(4, 9)))]
        rows.append(
            {
                "id": f"p{i}",
                "prompt_tokens": prompt,
                "response_tokens": plain_greedy(target.model, prompt, 24),
            }
        )
    (path / "train.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    # Two of the training prompts as the dev split: what the layer learns shows in their tau.
    (path / "heldout.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows[:2]))
    return path


# --- pieces ---------------------------------------------------------------------------------------


def test_block_mask_is_block_sparse():
    # Blocks of 3 at anchors 2 and 4 over 5 context positions: context < anchor, own block only.
    mask = block_mask([2, 4], 3, 5)
    ctx_a, ctx_b = [1, 1, 0, 0, 0], [1, 1, 1, 1, 0]
    own_a, own_b = [1, 1, 1, 0, 0, 0], [0, 0, 0, 1, 1, 1]
    expected = np.array([ctx_a + own_a] * 3 + [ctx_b + own_b] * 3, bool)
    assert mask.dtype == bool and (mask == expected).all()
    # a sliding window of 3 also hides context keys 3 or more positions before the query
    windowed = block_mask([4], 2, 5, window=3)
    assert (windowed == np.array([[0, 0, 1, 1, 0, 1, 1], [0, 0, 0, 1, 0, 1, 1]], bool)).all()


def test_early_positions_weigh_more():
    w = position_weights(5, decay=2.0)
    assert np.allclose(w, [0, 1, np.exp(-0.5), np.exp(-1.0), np.exp(-1.5)])
    assert (np.diff(w[1:]) < 0).all()


def test_anchors_start_at_the_last_prompt_token():
    rng = np.random.default_rng(0)
    assert sample_anchors(rng, 5, 9, 10).tolist() == [4, 5, 6, 7]  # all: 4 candidates
    a = sample_anchors(rng, 5, 40, 6)
    assert len(set(a.tolist())) == 6 and a.min() >= 4 and a.max() <= 38 and (np.diff(a) > 0).all()


def test_draft_vocabulary_takes_the_most_frequent_response_tokens():
    seqs = [TrainSequence(0, [9, 9, 9, 5, 5, 7, 5, 3], 3), TrainSequence(1, [1, 7, 2], 1)]
    # responses: 5 5 7 5 3 / 7 2 -> 5 (x3), 7 (x2), then ties by id: 2, 3
    assert draft_vocabulary(seqs, 12, 3).tolist() == [2, 5, 7]
    assert draft_vocabulary(seqs, 12, 12).tolist() == list(range(12))


def test_batches_depend_only_on_seed_and_step():
    steps = [batch_indices(5, 2, s, seed=1) for s in range(5)]
    assert sorted(steps[0] + steps[1] + steps[2][:1]) == [0, 1, 2, 3, 4]  # an epoch: a permutation
    assert batch_indices(5, 2, 3, seed=1) == steps[3] != batch_indices(5, 2, 3, seed=2)


def test_features_of_a_padded_batch_equal_one_sequence_at_a_time():
    # unit-scale weights: the shared fixture's scaled-up ones reach 1e34, where a batched
    # matmul's other summation order is not a small difference
    target = tiny_target("llama", vocab_size=VOCAB, seed=3, num_layers=4, hidden_size=32)
    rng = np.random.default_rng(0)
    seqs = [TrainSequence(i, rng.integers(1, VOCAB, n).tolist(), 3) for i, n in enumerate([5, 17, 9])]
    store = FeatureStore(target, [0, 2])
    batched = store.compute(seqs)
    for seq, features in zip(seqs, batched):
        alone = store.compute([seq])[0]
        assert features.shape == (len(seq.tokens), 2 * target.hidden_size)
        assert float(mx.abs(alone).max()) < 1e3
        np.testing.assert_allclose(np.array(features), np.array(alone), rtol=1e-4, atol=1e-4)


def test_stored_features_are_found_by_their_tokens_whatever_the_order(tmp_path, monkeypatch):
    target = tiny_target("llama", vocab_size=VOCAB, seed=3, num_layers=4, hidden_size=32)
    rng = np.random.default_rng(0)
    tokens = [rng.integers(1, VOCAB, n).tolist() for n in (5, 17, 9)]
    store = FeatureStore(target, [0, 2], tmp_path)
    store.prepare([TrainSequence(i, t, 3) for i, t in enumerate(tokens)])
    expected = [np.array(store.get(TrainSequence(i, t, 3))) for i, t in enumerate(tokens)]
    # The data grew at the front (a merged greedy + sampled set): every index moved.
    moved = [TrainSequence(i + 1, t, 3) for i, t in enumerate(tokens)]
    new = TrainSequence(0, rng.integers(1, VOCAB, 7).tolist(), 3)
    later = FeatureStore(target, [0, 2], tmp_path)
    assert [later.has(s) for s in moved] == [True] * 3 and not later.has(new)
    monkeypatch.setattr(later, "compute", lambda seqs: pytest.fail("recomputed a stored sequence"))
    for seq, features in zip(moved, expected):
        np.testing.assert_array_equal(np.array(later.get(seq)), features)


def test_training_time_test_equals_chained_drafting(target):
    """Step j at row t of the TTT graph = the j-th own step of a chain rooted at row t."""
    mx.random.seed(1)
    model = new_eagle_model(target, np.arange(20))
    n, steps = 9, 4
    tokens = mx.array(np.random.default_rng(1).integers(0, VOCAB, size=(1, n + steps)))
    embeds = target.embed(tokens[:, 1:])  # x_1 ..
    fused = model.fuse(mx.random.normal((1, n, 3 * 32)))
    outputs = ttt_forward(model, embeds, fused, steps)
    for t in (0, 3, n - 1):
        cache = model.make_cache()
        hidden = model(embeds[:, : t + 1], fused[:, : t + 1], cache)[:, -1:]
        assert mx.allclose(hidden[0, 0], outputs[0][0, t], atol=1e-4)
        for j in range(1, steps):
            hidden = model(embeds[:, t + j : t + j + 1], hidden, cache)
            assert mx.allclose(hidden[0, 0], outputs[j][0, t], atol=1e-4), (t, j)


def test_block_sparse_pass_equals_one_block_at_a_time(target):
    """All blocks in one forward = each block drafted alone over the context before its anchor
    (the inference path of models/dflash.py), sliding-window layers included."""
    args = DFlashArgs(
        hidden_size=32,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        intermediate_size=64,
        mask_token_id=0,
        block_size=4,
        target_layer_ids=[0, 2],
        layer_types=["full_attention", "sliding_attention"],
        sliding_window=5,
    )
    mx.random.seed(2)
    model = DFlashModel(args)
    L, anchors = 12, [0, 3, 4, 11]
    features = mx.random.normal((1, L, 64))
    blocks = mx.random.normal((1, 4 * len(anchors), 32))
    masks = [
        mx.array(block_mask(anchors, 4, L, layer.self_attn.sliding_window))[None, None]
        for layer in model.layers
    ]
    hidden = block_sparse_forward(model, features, blocks, mx.array([anchors]), masks)
    for j, a in enumerate(anchors):
        cache = model.make_cache()
        if a:
            model.append_context(features[:, :a], cache)
        alone = model(blocks[:, 4 * j : 4 * j + 4], cache)
        assert mx.allclose(alone, hidden[:, 4 * j : 4 * j + 4], atol=1e-4), a


# --- training -------------------------------------------------------------------------------------


def first_and_last(losses, k=3):
    return float(np.mean(losses[:k])), float(np.mean(losses[-k:]))


def test_dev_prompts_are_distinct_in_merged_data(target, tmp_path):
    """Data merged from a greedy and a sampled run holds each held-out prompt twice: the dev
    evaluation takes each once."""
    from mlx_spec.train.loop import DevEvaluation

    rows = [{"id": f"p{i}", "prompt_tokens": [1, i + 2], "response_tokens": [3]} for i in range(3)]
    (tmp_path / "heldout.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows + rows))
    evaluation = DevEvaluation(target, tmp_path, lambda model: None, prompts=3)
    assert evaluation.prompts == [[1, 2], [1, 3], [1, 4]]


def test_sampled_dev_evaluation_is_reproducible_per_seed(target, data):
    """At temperature > 0 each prompt generates once per seed, with that seed's noise: the same
    seeds give the same tau (a fresh seed per call would not), and greedy runs once."""
    from mlx_spec.train.loop import DevEvaluation

    def evaluate(seeds, temp=1.0):
        return DevEvaluation(
            target,
            data,
            lambda model: make_drafter("lookup", target, {}),
            prompts=2,
            max_tokens=16,
            sampling=SamplingParams(temp=temp),
            seeds=seeds,
        )

    assert evaluate((0, 1), temp=0.0).seeds == [0] and evaluate((0, 1)).seeds == [0, 1]
    taus = {seeds: [evaluate(seeds)(None)["dev_tau"] for _ in range(2)] for seeds in ((0,), (1,), (0, 1))}
    assert all(a == b and 1.0 <= a for a, b in taus.values()), taus
    assert len({t[0] for t in taus.values()}) > 1, taus  # the seeds draw different text


def test_eagle_training_lowers_the_loss_and_drafts_losslessly(target, data, tmp_path):
    options = EagleOptions(
        steps=30,
        batch_size=4,
        lr=3e-3,
        warmup=0,
        ttt_steps=3,
        draft_vocab_size=24,
        save_every=0,
        save_dtype="float16",
        eval_every=20,
        eval_prompts=2,
    )
    result = train_eagle(target, data, tmp_path / "eagle", options, feature_dir=None)
    first, last = first_and_last(result.losses)
    assert result.step == 30 and last < 0.6 * first, result.losses
    log = [json.loads(line) for line in (tmp_path / "eagle" / "train_log.jsonl").read_text().splitlines()]
    dev = [r for r in log if "dev_tau" in r]  # before the first step, every 20 steps, at the end
    assert [r["step"] for r in dev] == [0, 20, 30] and all(r["dev_prompts"] == 2 for r in dev)
    assert 1.0 <= dev[0]["dev_tau"] < dev[-1]["dev_tau"] <= 5.0, dev
    config = json.loads((tmp_path / "eagle" / "config.json").read_text())
    assert config["draft_vocab_size"] == 24 and config["num_hidden_layers"] == 1
    weights = mx.load(str(tmp_path / "eagle" / "model.safetensors"))
    assert weights["fc.weight"].dtype == mx.float16 and weights["d2t"].dtype == mx.int64
    assert weights["t2d"].dtype == mx.bool_ and int(weights["t2d"].sum()) == 24
    assert any(k.startswith("midlayer.self_attn.") for k in weights) and "lm_head.weight" in weights

    model = load_eagle3(tmp_path / "eagle", target)
    prompt = json.loads((data / "train.jsonl").read_text().splitlines()[0])["prompt_tokens"]
    engine = Engine(target, EagleDrafter(model, VOCAB), num_draft_tokens=4, adaptive=False)
    tokens, stats = run(engine, prompt, 24)
    assert tokens == plain_greedy(target.model, prompt, 24)
    assert stats.accepted_drafts > 0  # it learned something of the target's answers


def test_eagle_soft_labels_are_the_targets_distribution_over_the_draft_vocabulary(target, data, tmp_path):
    """--labels soft: the label of step j at row t is the target's distribution at position
    t + 2 + j over the draft vocabulary (its logits at t + 1 + j, renormalized there), every
    response position is trained (also where the data's token lies outside the draft vocabulary),
    and training on them lowers the loss and drafts losslessly."""
    from mlx_lm.models.cache import make_prompt_cache

    from mlx_spec.train.eagle import make_eagle_batch, target_head, target_to_draft

    sequences = load_sequences(data, 1024)[:2]
    model = new_eagle_model(target, draft_vocabulary(sequences, VOCAB, 20), [1, 2, 3])
    ids = np.array(model.draft_ids)
    store = FeatureStore(target, list(model.taps) + [target.num_layers - 1])
    embeds, features, labels, weights = make_eagle_batch(
        target, model, store, sequences, 2, target_to_draft(model), target_head(target, model)
    )
    hard = make_eagle_batch(
        target, model, FeatureStore(target, model.taps), sequences, 2, target_to_draft(model)
    )
    assert mx.array_equal(features, hard[1]) and mx.array_equal(embeds, hard[0])
    assert (np.array(weights) >= np.array(hard[3])).all() and np.array(weights).sum() > np.array(
        hard[3]
    ).sum()
    n = features.shape[1]
    for j in range(2):
        for i, seq in enumerate(sequences):
            logits, _ = target.forward(mx.array(seq.tokens)[None], make_prompt_cache(target.model))
            for t in np.flatnonzero(np.array(weights[j, i])).tolist():
                assert t + 2 + j <= len(seq.tokens) - 1 and t < n
                expected = mx.softmax(logits[0, t + 1 + j][mx.array(ids)])
                assert mx.allclose(labels[j, i, t], expected, atol=1e-5), (j, i, t)
    result = train_eagle(
        target,
        data,
        tmp_path / "soft",
        EagleOptions(
            steps=30,
            batch_size=4,
            lr=3e-3,
            warmup=0,
            ttt_steps=2,
            draft_vocab_size=24,
            save_every=0,
            layer_ids=[1, 2, 3],
            labels="soft",
        ),
        feature_dir=tmp_path / "features",
    )
    first, last = first_and_last(result.losses)
    assert last < first - 0.5, result.losses  # a cross-entropy with soft labels ends at their entropy
    assert (tmp_path / "features" / "taps_0_1_2_3").is_dir()  # the fused taps, then the last layer
    prompt = json.loads((data / "train.jsonl").read_text().splitlines()[0])["prompt_tokens"]
    engine = Engine(
        target,
        EagleDrafter(load_eagle3(tmp_path / "soft", target), VOCAB),
        num_draft_tokens=4,
        adaptive=False,
    )
    tokens, stats = run(engine, prompt, 24)
    assert tokens == plain_greedy(target.model, prompt, 24) and stats.accepted_drafts > 0


def test_mtp_training_time_test_equals_chained_drafting(target):
    """Depth j at row t of the MTP training graph = the j-th own step of a chain at row t."""
    from mlx_spec.train.mtp import new_mtp_model
    from mlx_spec.train.mtp import ttt_forward as mtp_ttt_forward

    model = new_mtp_model(target)
    model.update(
        tree_map(lambda p: p + 0.05 * mx.random.normal(p.shape, key=mx.random.key(2)), model.parameters())
    )
    n, steps = 9, 3
    tokens = mx.array(np.random.default_rng(1).integers(0, VOCAB, size=(1, n + steps)))
    embeds = target.embed(tokens[:, 1:])
    hidden = model.fuse(mx.random.normal((1, n, 32)))
    outputs = mtp_ttt_forward(model, embeds, hidden, steps)
    for t in (0, 4, n - 1):
        cache = model.make_cache()
        out = model(embeds[:, : t + 1], hidden[:, : t + 1], cache)[:, -1:]
        assert mx.allclose(out[0, 0], outputs[0][0, t], atol=1e-4)
        for j in range(1, steps):
            out = model(embeds[:, t + j : t + j + 1], out, cache)
            assert mx.allclose(out[0, 0], outputs[j][0, t], atol=1e-4), (t, j)


@pytest.mark.parametrize("kind", ["mtp", "medusa"])
def test_mtp_and_medusa_training_lower_the_loss_and_draft_losslessly(target, data, tmp_path, kind):
    from mlx_spec.drafters.medusa import MedusaDrafter
    from mlx_spec.models.medusa import load_medusa
    from mlx_spec.models.mtp import load_mtp
    from mlx_spec.train.medusa import MedusaOptions, train_medusa
    from mlx_spec.train.mtp import MTPOptions, train_mtp

    if kind == "mtp":
        result = train_mtp(
            target,
            data,
            tmp_path / kind,
            MTPOptions(steps=40, batch_size=4, lr=3e-3, warmup=0, ttt_steps=2, save_every=0),
            feature_dir=None,
        )
        drafter = EagleDrafter(load_mtp(tmp_path / kind, target), VOCAB)
    else:
        result = train_medusa(
            target,
            data,
            tmp_path / kind,
            MedusaOptions(steps=40, batch_size=4, lr=1e-2, warmup=0, heads=3, rows_per_head=32, save_every=0),
            feature_dir=None,
        )
        drafter = MedusaDrafter(target, load_medusa(tmp_path / kind, target))
    first, last = first_and_last(result.losses)
    assert result.step == 40 and last < 0.7 * first, result.losses
    prompt = json.loads((data / "train.jsonl").read_text().splitlines()[0])["prompt_tokens"]
    tokens, stats = run(Engine(target, drafter, num_draft_tokens=3, adaptive=False), prompt, 24)
    assert tokens == plain_greedy(target.model, prompt, 24)
    assert stats.accepted_drafts > 0


def test_mtp_continued_with_a_reduced_vocabulary_trains_over_it(target, data, tmp_path):
    """--init of a module with a draft vocabulary: labels are its columns (those outside it are
    not trained), and the result keeps the vocabulary."""
    from mlx_spec.models import vocabulary
    from mlx_spec.models.mtp import load_mtp
    from mlx_spec.train.mtp import MTPOptions, draft_index, train_mtp

    options = dict(batch_size=4, lr=3e-3, warmup=0, ttt_steps=2, save_every=0)
    train_mtp(target, data, tmp_path / "a", MTPOptions(steps=20, **options), feature_dir=None)
    answers = [
        json.loads(line)["response_tokens"] for line in (data / "train.jsonl").read_text().splitlines()
    ]
    ids = vocabulary.frequent_ids(answers, VOCAB, 12)
    vocabulary.write(tmp_path / "a", ids)
    model = load_mtp(tmp_path / "a", target)
    index = draft_index(model, VOCAB)
    assert sorted(index[index >= 0]) == list(range(12)) and all(index[ids] == np.arange(12))
    train_mtp(
        target,
        data,
        tmp_path / "b",
        MTPOptions(steps=10, init=str(tmp_path / "a"), **options),
        feature_dir=None,
    )
    (tmp_path / "b" / vocabulary.FILE).unlink()
    # Resumed (the checkpoint has the weights, not the vocabulary): it goes on over the same one.
    result = train_mtp(
        target,
        data,
        tmp_path / "b",
        MTPOptions(steps=20, init=str(tmp_path / "a"), **options),
        feature_dir=None,
        resume=True,
    )
    first, last = first_and_last(result.losses)
    assert result.step == 20 and np.isfinite(result.losses).all() and last < np.log(12) + 1, result.losses
    assert list(vocabulary.read(tmp_path / "b", VOCAB)) == list(ids)
    prompt = json.loads((data / "train.jsonl").read_text().splitlines()[0])["prompt_tokens"]
    drafter = EagleDrafter(load_mtp(tmp_path / "b", target), VOCAB)
    tokens, stats = run(Engine(target, drafter, num_draft_tokens=3, adaptive=False), prompt, 24)
    assert tokens == plain_greedy(target.model, prompt, 24) and stats.accepted_drafts > 0


def test_mtp_soft_labels_are_the_targets_distribution_and_train(target, data, tmp_path):
    """--labels soft: the label of step j at row t is the target's distribution at position
    t + 2 + j (its logits at t + 1 + j); training on them lowers the loss and drafts."""
    from mlx_lm.models.cache import make_prompt_cache

    from mlx_spec.models.mtp import load_mtp
    from mlx_spec.train.loop import FeatureStore, load_sequences
    from mlx_spec.train.mtp import MTPOptions, make_mtp_batch, new_mtp_model, target_head, train_mtp

    model = new_mtp_model(target)
    sequences = load_sequences(data, 1024)[:2]
    _, _, rows, labels = make_mtp_batch(
        target, model, FeatureStore(target, model.taps), sequences, 2, target_head(target, model)
    )
    n = max(len(s.tokens) for s in sequences) - 1
    for j in range(2):
        for k, flat in enumerate(rows[j].tolist()):
            i, t = divmod(flat, n)
            logits, _ = target.forward(mx.array(sequences[i].tokens)[None], make_prompt_cache(target.model))
            assert mx.allclose(labels[j][k], mx.softmax(logits[0, t + 1 + j]), atol=1e-5), (j, k)
    result = train_mtp(
        target,
        data,
        tmp_path / "soft",
        MTPOptions(steps=40, batch_size=4, lr=3e-3, warmup=0, ttt_steps=2, save_every=0, labels="soft"),
        feature_dir=None,
    )
    first, last = first_and_last(result.losses)
    assert last < first - 0.5, result.losses  # a cross-entropy with soft labels ends at their entropy
    prompt = json.loads((data / "train.jsonl").read_text().splitlines()[0])["prompt_tokens"]
    drafter = EagleDrafter(load_mtp(tmp_path / "soft", target), VOCAB)
    tokens, stats = run(Engine(target, drafter, num_draft_tokens=3, adaptive=False), prompt, 24)
    assert tokens == plain_greedy(target.model, prompt, 24) and stats.accepted_drafts > 0


def test_dflash_training_lowers_the_loss_and_drafts_losslessly(target, data, tmp_path):
    options = DFlashOptions(
        steps=60,
        batch_size=2,
        lr=3e-3,
        warmup=0,
        layers=2,
        block_size=4,
        target_layers=[0, 2],
        blocks_per_sequence=8,
        save_every=0,
    )
    result = train_dflash(target, data, tmp_path / "dflash", options, feature_dir=tmp_path / "features")
    first, last = first_and_last(result.losses)
    assert result.step == 60 and last < 0.6 * first, result.losses
    config = json.loads((tmp_path / "dflash" / "config.json").read_text())
    assert config["architectures"] == ["DFlashDraftModel"] and config["block_size"] == 4
    assert config["dflash_config"] == {"mask_token_id": VOCAB - 1, "target_layer_ids": [0, 2]}
    assert (tmp_path / "features" / "taps_0_2").is_dir()

    model = load_dflash(tmp_path / "dflash", target)
    prompt = json.loads((data / "train.jsonl").read_text().splitlines()[1])["prompt_tokens"]
    engine = Engine(target, DFlashDrafter(target, model), num_draft_tokens=3, adaptive=False)
    tokens, stats = run(engine, prompt, 24)
    assert tokens == plain_greedy(target.model, prompt, 24)
    assert stats.accepted_drafts > 0


@pytest.mark.parametrize("kind", ["eagle", "dflash"])
def test_resume_continues_as_an_uninterrupted_run(target, data, tmp_path, kind):
    if kind == "eagle":
        train, make = (
            train_eagle,
            lambda steps, every: EagleOptions(
                steps=steps,
                batch_size=3,
                lr=3e-3,
                warmup=2,
                ttt_steps=2,
                draft_vocab_size=20,
                save_every=every,
            ),
        )
    else:
        train, make = (
            train_dflash,
            lambda steps, every: DFlashOptions(
                steps=steps,
                batch_size=3,
                lr=3e-3,
                warmup=2,
                layers=1,
                block_size=4,
                blocks_per_sequence=4,
                save_every=every,
            ),
        )
    straight = train(target, data, tmp_path / "straight", make(6, 0), feature_dir=None)
    losses = []

    def interrupt_at_step_5(record):
        if record["step"] == 5:
            raise KeyboardInterrupt
        losses.append(record["loss"])

    with pytest.raises(KeyboardInterrupt):  # checkpoints every 2 steps: step 5 is lost
        train(target, data, tmp_path / "split", make(6, 2), feature_dir=None, progress=interrupt_at_step_5)
    with pytest.raises(MlxSpecError, match="--resume"):
        train(target, data, tmp_path / "split", make(6, 2), feature_dir=None)
    state = json.loads((tmp_path / "split" / "checkpoint" / "state.json").read_text())
    assert state["step"] == 4
    resumed = train(target, data, tmp_path / "split", make(6, 2), resume=True, feature_dir=None)
    assert resumed.step == 6 and len(resumed.losses) == 2
    assert np.allclose(losses[:4] + resumed.losses, straight.losses, rtol=1e-5)
    a = mx.load(str(tmp_path / "straight" / "model.safetensors"))
    b = mx.load(str(tmp_path / "split" / "model.safetensors"))
    assert a.keys() == b.keys() and all(mx.allclose(a[k], b[k], atol=1e-6) for k in a)


def test_resume_refuses_another_architecture(target, data, tmp_path):
    options = DFlashOptions(steps=1, layers=1, block_size=4, blocks_per_sequence=2, save_every=0)
    train_dflash(target, data, tmp_path / "d", options, feature_dir=None)
    options.steps, options.block_size = 2, 8
    with pytest.raises(MlxSpecError, match="block_size=4"):
        train_dflash(target, data, tmp_path / "d", options, resume=True, feature_dir=None)


def test_bad_input_is_one_line(target, tmp_path):
    with pytest.raises(MlxSpecError, match="outside this target's layers -1..3"):
        new_dflash_model(target, 2, 16, [0, 4])
    with pytest.raises(MlxSpecError, match="mask token id 48 is outside"):
        new_dflash_model(target, 2, 16, None, mask_token_id=VOCAB)
    shallow = tiny_target("llama", vocab_size=VOCAB, num_layers=2, hidden_size=32)
    with pytest.raises(MlxSpecError, match="must lie in 0..2"):
        new_eagle_model(shallow, np.arange(10))

    with pytest.raises(MlxSpecError, match="not a directory"):
        train_eagle(target, tmp_path / "absent", tmp_path / "out")
    (tmp_path / "empty").mkdir()
    with pytest.raises(MlxSpecError, match="no training data"):
        train_dflash(target, tmp_path / "empty", tmp_path / "out")
    (tmp_path / "empty" / "train.jsonl").write_text(
        json.dumps({"prompt_tokens": [1], "response_tokens": []}) + "\n"
    )
    with pytest.raises(MlxSpecError, match="no usable training rows"):
        train_eagle(target, tmp_path / "empty", tmp_path / "out")


# --- the command line -----------------------------------------------------------------------------


def cli(*args):
    """`mlx-spec train ...` in this process (exit code, stderr)."""
    from click.testing import CliRunner

    from mlx_spec.cli import main

    result = CliRunner().invoke(main, ["train", *args])
    return result.exit_code, result.stderr


def test_cli_trains_both_and_reports_bad_input_in_one_line(tmp_path):
    model = tiny_chat_model_dir(tmp_path / "model")
    data = tmp_path / "data"
    data.mkdir()
    rng = np.random.default_rng(0)
    rows = [
        {
            "id": str(i),
            "prompt_tokens": [1] + rng.integers(3, 400, 6).tolist(),
            "response_tokens": rng.integers(3, 400, 12).tolist() + [2],
        }
        for i in range(3)
    ]
    (data / "train.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    common = ["--target", str(model), "--data", str(data), "--steps", "2", "--warmup", "0"]
    code, err = cli(
        "eagle",
        *common,
        "--out",
        str(tmp_path / "e"),
        "--ttt-steps",
        "2",
        "--draft-vocab-size",
        "64",
        "--layer-ids",
        "0,1,2",
    )
    assert code == 0, err
    assert "2 steps, last loss" in err and "loss" in err
    code, err = cli("medusa", *common, "--out", str(tmp_path / "m0"), "--eval-every", "1")
    assert code == 1 and err.count("\n") == 1 and "needs held-out prompts" in err, err
    other = tmp_path / "other"  # the dev prompts of another data set: runs on different data compared
    other.mkdir()
    (other / "heldout.jsonl").write_text(json.dumps(rows[1]) + "\n")
    code, err = cli(
        "medusa",
        *common,
        "--out",
        str(tmp_path / "m1"),
        "--heads",
        "2",
        "--rows-per-head",
        "8",
        "--eval-every",
        "2",
        "--eval-data",
        str(other),
    )
    assert code == 0, err
    assert [
        r["dev_prompts"]
        for r in map(json.loads, (tmp_path / "m1" / "train_log.jsonl").read_text().splitlines())
        if "dev_tau" in r
    ] == [1, 1]
    (data / "heldout.jsonl").write_text(json.dumps(rows[0]) + "\n")
    code, err = cli(
        "dflash",
        *common,
        "--out",
        str(tmp_path / "d"),
        "--layers",
        "1",
        "--block-size",
        "4",
        "--target-layers",
        "0,1",
        "--eval-every",
        "2",
        "--eval-prompts",
        "1",
    )
    assert code == 0, err
    log = [json.loads(line) for line in (tmp_path / "d" / "train_log.jsonl").read_text().splitlines()]
    assert [r["step"] for r in log if "dev_tau" in r] == [0, 2]
    config = json.loads((tmp_path / "d" / "config.json").read_text())
    assert config["dflash_config"]["target_layer_ids"] == [0, 1]
    assert config["dflash_config"]["mask_token_id"] == 0  # SmolLM2's unk: <|endoftext|>

    for kind, extra in (("mtp", ["--ttt-steps", "2"]), ("medusa", ["--heads", "2", "--rows-per-head", "8"])):
        code, err = cli(
            kind, *common, "--out", str(tmp_path / kind), *extra, "--eval-every", "1", "--eval-prompts", "1"
        )
        assert code == 0 and "2 steps, last loss" in err, err
        log = [json.loads(line) for line in (tmp_path / kind / "train_log.jsonl").read_text().splitlines()]
        assert [r["step"] for r in log if "dev_tau" in r] == [0, 1, 2]
        code, err = cli("vocab", "--data", str(data), "--drafter", str(tmp_path / kind), "--size", "16")
        assert code == 0 and "16 of 49152 tokens cover" in err, err
        drafter = make_drafter(kind, load_target(model, "float32"), {"draft_model": str(tmp_path / kind)})
        assert drafter.model.draft_ids.shape == (16,)

    code, err = cli("dflash", *common, "--out", str(tmp_path / "d"))
    assert code == 1 and err.count("\n") == 1 and "pass --resume" in err, err
    code, err = cli(
        "eagle", "--target", str(model), "--data", str(tmp_path / "nowhere"), "--out", str(tmp_path / "x")
    )
    assert (
        code == 1
        and err.strip() == f"Error: training data not found: {tmp_path / 'nowhere'} is not a directory"
    )
