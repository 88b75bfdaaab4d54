"""EAGLE-3: both published layouts load, chain drafts follow the format, output stays lossless."""

import json

import mlx.core as mx
import numpy as np
import pytest
from mlx.utils import tree_flatten, tree_map

from exactness import STRICT, VOCAB, repeated_prompt, sampling_pvalue
from mlx_spec.drafters import make_drafter
from mlx_spec.drafters.eagle import EagleDrafter
from mlx_spec.engine import Engine
from mlx_spec.errors import MlxSpecError
from mlx_spec.events import Step
from mlx_spec.models.eagle3 import Model, ModelArgs, default_layer_ids, load_eagle3
from mlx_spec.models.target import Target
from mlx_spec.sampling import Sampler, SamplingParams
from tiny import plain_greedy, run, tiny_target

GREEDY = SamplingParams()
PROMPT = [1, 5, 7, 9, 11, 13, 2, 5, 7, 9, 11, 13, 2, 5, 7]
DRAFT_VOCAB = 12

# The layer as both layouts configure it; speculators writes only what differs from
# LlamaConfig's defaults (here rope_theta, hidden_act and the context length are left out).
LAYER = dict(
    hidden_size=32,
    intermediate_size=64,
    num_attention_heads=4,
    num_key_value_heads=2,
    rms_norm_eps=1e-5,
    num_hidden_layers=1,
)


def eagle_target(seed=11):
    # EAGLE-3 fuses layers 2, N//2, N-3: four layers give it three distinct taps.
    return tiny_target("llama", vocab_size=VOCAB, seed=seed, scale=2.5, num_layers=4, hidden_size=32)


def random_eagle(target, seed=0, scale=3.0, **overrides):
    """A random EAGLE-3 for `target`: its own weights, a reduced vocabulary mapped by d2t."""
    args = ModelArgs(
        **{
            **LAYER,
            "vocab_size": target.vocab_size,
            "draft_vocab_size": DRAFT_VOCAB,
            "aux_layer_ids": default_layer_ids(target.num_layers),
            **overrides,
        }
    )
    mx.random.seed(seed)
    model = Model(args)
    model.update(tree_map(lambda p: p * scale if p.ndim == 2 else p, model.parameters()))
    targets = np.sort(np.random.default_rng(seed).permutation(target.vocab_size)[: args.draft_vocab_size])
    model.d2t = mx.array(targets - np.arange(args.draft_vocab_size), mx.int32)
    mx.eval(model.parameters())
    return model


def save_eagle(model, path, layout, config_changes=(), extra_weights=()):
    """Write `model` as SafeAILab or vLLM speculators publish EAGLE-3 checkpoints."""
    args = model.args
    weights = dict(tree_flatten(model.parameters()))
    d2t = np.array(weights.pop("d2t"))
    weights["d2t"] = mx.array(d2t.astype(np.int64))
    t2d = np.zeros(args.vocab_size, bool)
    t2d[np.arange(len(d2t)) + d2t] = True
    weights["t2d"] = mx.array(t2d)
    layer = {**LAYER, **{k: getattr(args, k) for k in LAYER}, "vocab_size": args.vocab_size}
    if layout == "safeailab":
        config = dict(
            layer,
            architectures=["LlamaForCausalLMEagle3"],
            model_type="llama",
            hidden_act="silu",
            rope_theta=10000.0,
            max_position_embeddings=1024,
            draft_vocab_size=args.draft_vocab_size,
            tie_word_embeddings=False,
        )
    else:
        weights = {k.replace("midlayer.", "layers.0."): v for k, v in weights.items()}
        config = dict(
            architectures=["Eagle3Speculator"],
            speculators_model_type="eagle3",
            transformer_layer_config=dict(layer, model_type="llama"),
            draft_vocab_size=args.draft_vocab_size,
            norm_before_residual=args.norm_before_residual,
            target_hidden_size=None,
            eagle_aux_hidden_state_layer_ids=args.aux_layer_ids,
            speculators_config=dict(
                algorithm="eagle3",
                default_proposal_method="greedy",
                proposal_methods=[dict(proposal_type="greedy", speculative_tokens=5)],
            ),
        )
    config.update(config_changes)
    weights.update(extra_weights)
    path.mkdir(parents=True, exist_ok=True)
    (path / "config.json").write_text(json.dumps(config))
    mx.save_safetensors(str(path / "model.safetensors"), weights)
    return path


@pytest.fixture(scope="module")
def target():
    return eagle_target()


@pytest.fixture(scope="module")
def checkpoints(target, tmp_path_factory):
    model = random_eagle(target, seed=3, scale=1.0)  # a seed whose drafts are sometimes accepted
    root = tmp_path_factory.mktemp("eagle")
    return {layout: save_eagle(model, root / layout, layout) for layout in ("safeailab", "speculators")}


def reference_drafts(model, target, context, k):
    """Greedy drafts recomputed from scratch: every target feature of the context, no reuse."""
    from mlx_lm.models.cache import make_prompt_cache

    _, taps = target.forward(mx.array(context[:-1])[None], make_prompt_cache(target.model), model.taps)
    cache = model.make_cache()
    features = model.fuse(mx.concatenate([taps[i] for i in model.taps], axis=-1))
    hidden = model(model.embed(mx.array(context[1:])[None]), features, cache)[:, -1:]
    drafts = []
    for i in range(k):
        if i:
            hidden = model(model.embed(mx.array([[drafts[-1]]])), hidden, cache)
        drafts.append(model.to_target(mx.argmax(model.logits(hidden[0, -1]))).item())
    return drafts


class CheckedDrafter(EagleDrafter):
    """Records its drafts next to a from-scratch recomputation of them."""

    def __init__(self, target, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.target, self.pairs = target, []

    def prefill(self, context, taps, start):
        self.context = list(context)
        super().prefill(context, taps, start)

    def propose(self, k):
        draft = super().propose(k)
        if len(draft):
            self.pairs.append((draft.tokens, reference_drafts(self.model, self.target, self.context, k)))
        return draft

    def commit(self, accepted, next_token, taps):
        self.context += list(accepted) + [next_token]
        super().commit(accepted, next_token, taps)


def test_taps_follow_the_layer_input_convention(target, checkpoints):
    for path in checkpoints.values():
        assert load_eagle3(path, target).taps == [0, 1, 1]  # inputs of layers 1, 2, 2 of 4
    args = ModelArgs.from_config(
        {
            "speculators_model_type": "eagle3",
            "transformer_layer_config": LAYER,
            "eagle_aux_hidden_state_layer_ids": [23, 1, 44],
        }
    )
    assert Model(args).taps == [0, 22, 43]  # collected in layer order
    assert args.norm_before_residual and args.draft_vocab_size == 32000 and args.rope_theta == 10000.0


def test_both_layouts_load_the_same_model(target, checkpoints):
    a, b = (load_eagle3(path, target) for path in checkpoints.values())
    assert not a.args.has_embedding and a.args.target_hidden_size == 32
    flat_a, flat_b = dict(tree_flatten(a.parameters())), dict(tree_flatten(b.parameters()))
    assert flat_a.keys() == flat_b.keys()
    assert all(mx.array_equal(flat_a[k], flat_b[k]) for k in flat_a)
    drafts = []
    for model in (a, b):
        drafter = EagleDrafter(model, target.vocab_size)
        tokens, _ = run(Engine(target, drafter, num_draft_tokens=4, adaptive=False), PROMPT, 12)
        drafts.append((tokens, np.array(drafter.propose(5).tokens).tolist()))
    assert drafts[0] == drafts[1]
    assert set(drafts[0][1]) <= set(np.array(a.to_target(mx.arange(DRAFT_VOCAB))).tolist())


def test_drafts_equal_a_recomputation_from_scratch(target, checkpoints):
    """The cache kept across steps (and across generations) holds exactly the pairs
    (token t+1, target feature t) that a fresh pass over the whole context would."""
    model = load_eagle3(checkpoints["safeailab"], target)
    drafter = CheckedDrafter(target, model, target.vocab_size)
    engine = Engine(target, drafter, num_draft_tokens=3, adaptive=False)
    accepted = [event.accepted for event in engine.generate(PROMPT, max_tokens=60) if isinstance(event, Step)]
    tokens = drafter.context[len(PROMPT) :]
    run(engine, PROMPT + tokens + [3, 4], 10)  # a second turn reuses the session's cache
    assert max(accepted) >= 2 and len(drafter.pairs) > 50
    for drafts, expected in drafter.pairs:
        assert drafts.tolist() == expected


@pytest.mark.parametrize(
    "layout,adaptive", [("safeailab", False), ("speculators", False), ("safeailab", True)]
)
@pytest.mark.parametrize("k", [1, 3, 6])
def test_greedy_is_token_identical(target, checkpoints, layout, adaptive, k):
    """Every draft verified, or those the policy keeps."""
    expected = plain_greedy(target.model, PROMPT, 40)
    engine = Engine(
        target,
        EagleDrafter(load_eagle3(checkpoints[layout], target), target.vocab_size),
        num_draft_tokens=k,
        adaptive=adaptive,
    )
    for prompt in (PROMPT, PROMPT):  # the second run finds its prompt in the session's cache
        tokens, stats = run(engine, prompt, 40)
        assert tokens == expected
        assert adaptive or stats.verified_drafts > 0


def test_own_embedding_and_width(target, tmp_path):
    """A checkpoint with its own embed_tokens may be wider than the target (target_hidden_size)."""
    model = random_eagle(target, hidden_size=48, target_hidden_size=32, has_embedding=True)
    path = save_eagle(model, tmp_path / "wide", "safeailab", {"target_hidden_size": 32})
    loaded = load_eagle3(path, target)
    assert loaded.args.has_embedding and loaded.args.hidden_size == 48
    assert mx.array_equal(loaded.embed(mx.array([3])), model.embed_tokens(mx.array([3])))
    engine = Engine(target, EagleDrafter(loaded, target.vocab_size), num_draft_tokens=3, adaptive=False)
    assert run(engine, PROMPT, 30)[0] == plain_greedy(target.model, PROMPT, 30)


def test_explicit_positions_and_mask_match_the_defaults(target, checkpoints):
    """What a tree drafter passes: positions per row and a mask over cache + block."""
    model = load_eagle3(checkpoints["speculators"], target)
    embeds = model.embed(mx.array([PROMPT]))
    hidden = mx.random.normal((1, len(PROMPT), 32))
    split, n = 6, len(PROMPT) - 6
    outputs = []
    for explicit in (False, True):
        cache = model.make_cache()
        model(embeds[:, :split], hidden[:, :split], cache)
        kwargs = {}
        if explicit:
            rows, cols = mx.arange(split, split + n)[:, None], mx.arange(split + n)[None]
            kwargs = dict(positions=mx.arange(split, split + n), mask=cols <= rows)
        outputs.append(model(embeds[:, split:], hidden[:, split:], cache, **kwargs))
    assert mx.allclose(outputs[0], outputs[1], atol=1e-5)


def test_norm_before_residual_changes_the_layer(target, tmp_path):
    model = random_eagle(target, seed=3)
    embeds, hidden = mx.random.normal((1, 4, 32)), mx.random.normal((1, 4, 32))
    outs = []
    for flag in (False, True):
        path = save_eagle(model, tmp_path / str(flag), "speculators", {"norm_before_residual": flag})
        loaded = load_eagle3(path, target)
        assert loaded.args.norm_before_residual is flag
        outs.append(loaded(embeds, hidden, loaded.make_cache()))
    assert not mx.allclose(outs[0], outs[1])


@pytest.mark.parametrize("top_k", [6, 14])  # 14: more than the draft vocabulary holds
def test_sampled_drafts_come_with_their_filtered_q(target, checkpoints, top_k):
    """q spans the target's vocabulary, zero outside the draft vocabulary's ids, filtered
    like the target's distribution, and every draft lies in its support."""
    from mlx_lm.models.cache import make_prompt_cache

    params = SamplingParams(temp=0.7, top_k=top_k, top_p=0.95)
    drafter = EagleDrafter(load_eagle3(checkpoints["safeailab"], target), VOCAB)
    drafter.sampler = Sampler(params, seed=0, residual=True)  # q is reported for this rule only
    _, taps = target.forward(mx.array(PROMPT[:-1])[None], make_prompt_cache(target.model), drafter.taps)
    drafter.prefill(PROMPT, taps, 0)
    draft = drafter.propose(4)
    q, tokens = np.array(draft.q), np.array(draft.tokens)
    outside = np.setdiff1d(np.arange(VOCAB), np.array(drafter.target_ids))
    assert q.shape == (4, VOCAB) and np.allclose(q.sum(-1), 1, atol=1e-5)
    assert (q[:, outside] == 0).all() and ((q > 0).sum(-1) <= params.top_k).all()
    assert (q[np.arange(4), tokens] > 0).all()


# The tree case is `slow` (~3 min): tests/test_tree.py and the DDTree test check the tree rule
# on one-hot drafts in the default suite.
@pytest.mark.parametrize("tree_budget", [0, pytest.param(6, marks=pytest.mark.slow)], ids=["chain", "tree"])
def test_exact_sampling(tmp_path, tree_budget):
    target, prompt, params = eagle_target(), repeated_prompt(), SamplingParams(temp=1.0)
    path = save_eagle(random_eagle(target, seed=5, scale=2.0), tmp_path / "e", "speculators")
    drafter = EagleDrafter(load_eagle3(path, target), VOCAB, tree_budget=tree_budget, tree_topk=2)
    engine = Engine(target, drafter, num_draft_tokens=3, sampling=params, seed=1, adaptive=False)
    pvalue = sampling_pvalue(engine, prompt, params)
    assert pvalue > STRICT, f"p = {pvalue:.2e}"


def test_registry(target, checkpoints):
    with pytest.raises(MlxSpecError, match="--draft-model"):
        make_drafter("eagle", target, dict(sampling=GREEDY))
    drafter = make_drafter(
        "eagle",
        target,
        dict(draft_model=str(checkpoints["speculators"]), sampling=GREEDY, seed=0, num_draft_tokens=4),
    )
    assert isinstance(drafter, EagleDrafter) and drafter.taps == [0, 1, 1]


def _mismatches(target):
    wide = random_eagle(target, hidden_size=48)
    bad_d2t = np.zeros(DRAFT_VOCAB, np.int64)
    bad_d2t[-1] = VOCAB  # maps draft id 11 to target id 27
    return {
        "hidden size": (wide, {}, {}, "hidden size 48"),
        "fc width": (random_eagle(target), {"target_hidden_size": 64}, {}, "features of width 64"),
        "vocabulary": (
            random_eagle(target),
            {"transformer_layer_config": dict(LAYER, vocab_size=32)},
            {},
            "32-token vocabulary",
        ),
        "d2t range": (random_eagle(target), {}, {"d2t": mx.array(bad_d2t)}, "d2t maps"),
        "layer ids": (
            random_eagle(target),
            {"eagle_aux_hidden_state_layer_ids": [1, 2, 9]},
            {},
            "fuses target layer 9",
        ),
        "draft layers": (
            random_eagle(target),
            {"transformer_layer_config": dict(LAYER, vocab_size=VOCAB, num_hidden_layers=2)},
            {},
            "2 draft layers",
        ),
    }


def test_load_errors(target, tmp_path):
    for name, (model, config, weights, message) in _mismatches(target).items():
        path = save_eagle(model, tmp_path / name.replace(" ", "_"), "speculators", config, weights)
        with pytest.raises(MlxSpecError, match=message):
            load_eagle3(path, target)
    shallow = Target(
        tiny_target("llama", vocab_size=VOCAB, num_layers=2, hidden_size=32).model,
        None,
        dict(vocab_size=VOCAB, hidden_size=32),
    )
    with pytest.raises(MlxSpecError, match="outside this target's 2 layers"):
        load_eagle3(save_eagle(random_eagle(target), tmp_path / "s", "safeailab"), shallow)

    with pytest.raises(MlxSpecError, match="not a directory"):
        load_eagle3(tmp_path / "missing", target)
    (tmp_path / "empty").mkdir()
    with pytest.raises(MlxSpecError, match="no config.json"):
        load_eagle3(tmp_path / "empty", target)
    (tmp_path / "empty" / "config.json").write_text(json.dumps(dict(LAYER, vocab_size=VOCAB)))
    with pytest.raises(MlxSpecError, match="no \\*.safetensors"):
        load_eagle3(tmp_path / "empty", target)
    (tmp_path / "empty" / "pytorch_model.bin").write_bytes(b"not to be unpickled")
    with pytest.raises(MlxSpecError, match="pickled weights only"):
        load_eagle3(tmp_path / "empty", target)


@pytest.mark.parametrize("budget, topk, k", [(4, 2, 3), (12, 3, 4), (30, 4, 6)])
def test_tree_greedy_is_token_identical(target, checkpoints, budget, topk, k):
    model = load_eagle3(checkpoints["safeailab"], target)
    drafter = EagleDrafter(model, target.vocab_size, tree_budget=budget, tree_topk=topk)
    expected = plain_greedy(target.model, PROMPT, 40)
    tokens, stats = run(Engine(target, drafter, num_draft_tokens=k, adaptive=False), PROMPT, 40)
    assert tokens == expected
    assert stats.verified_drafts <= stats.steps * budget


def test_what_is_left_of_a_tree_as_one_chain_is_verified_as_a_chain(target, checkpoints, monkeypatch):
    """Where the policy keeps one path of a tree (a probe, a text where only the best guesses
    pay), the chain verifier runs: no tree mask, no cache compaction."""
    from mlx_spec import engine as engine_module
    from mlx_spec.policy import DraftPlan, DraftPolicy

    class BestPath(DraftPolicy):
        def plan(self, max_k):
            return DraftPlan(max_k)

        def select(self, confidence, parents, drafted, probing=False):
            path, node = [], 0
            while children := [i for i, p in enumerate(parents) if p == node]:
                path.append(children[0])
                node = children[0] + 1
            return path

    def no_tree(*args, **kwargs):
        raise AssertionError("a chain went through the tree verifier")

    monkeypatch.setattr(engine_module, "tree_forward", no_tree)
    drafter = EagleDrafter(
        load_eagle3(checkpoints["safeailab"], target), target.vocab_size, tree_budget=6, tree_topk=2
    )
    tokens, stats = run(Engine(target, drafter, num_draft_tokens=3, policy=BestPath()), PROMPT, 40)
    assert tokens == plain_greedy(target.model, PROMPT, 40)
    assert stats.verified_drafts > stats.steps and stats.accepted_drafts > 0


@pytest.mark.parametrize("tree_budget", [0, 6], ids=["chain", "tree"])
def test_one_token_prompt(target, checkpoints, tree_budget):
    """Nothing to prefill, so no feature yet: the first step is plain, then drafting starts."""
    drafter = EagleDrafter(
        load_eagle3(checkpoints["safeailab"], target), target.vocab_size, tree_budget=tree_budget, tree_topk=2
    )
    tokens, stats = run(Engine(target, drafter, num_draft_tokens=3, adaptive=False), [5], 16)
    assert tokens == plain_greedy(target.model, [5], 16) and stats.verified_drafts > 0
