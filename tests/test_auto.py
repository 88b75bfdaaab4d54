"""--draft auto: the model's own MTP module, else a drafter published for it (found in a hub cache
laid out here, offline), else suffix decoding; each choice decodes token-identically to plain
decoding, and a registered drafter made for another target is passed over in one line."""

import json
import subprocess
import sys

import pytest

from mlx_spec.api import load_model
from mlx_spec.auto import auto_engine, choose, model_names, published_for
from mlx_spec.config import EngineConfig
from mlx_spec.errors import MlxSpecError
from mlx_spec.models.target import load_target
from test_dflash import dflash_config, random_weights, write_dflash
from test_eagle import random_eagle, save_eagle
from test_hub import hub_cache
from test_mtp import write_published
from tiny import plain_greedy, run, tiny_chat_model_dir

PROMPT = [1, 5, 7, 9, 11, 13, 2, 5, 7, 9, 11, 13, 2, 5, 7]
AUTO = EngineConfig.of(draft="auto", suffix_memory="off")


@pytest.fixture(scope="module")
def hub(tmp_path_factory):
    """A hub cache: Qwen/Qwen3-8B (tiny, qwen3) with z-lab's DFlash drafter for it, and
    mlx-community/Qwen3-8B-4bit (tiny, one layer fewer), and meta-llama/Llama-3.1-8B-Instruct
    (tiny) with a speculators EAGLE-3 whose verifier is another model."""
    root = tmp_path_factory.mktemp("auto")
    qwen = tiny_chat_model_dir(root / "qwen", arch="qwen3", num_layers=4)
    shallower = tiny_chat_model_dir(root / "qwen-3", arch="qwen3", num_layers=3)
    config = dflash_config(64, target_layer_ids=(1, 2), num_target_layers=4)
    dflash = write_dflash(root / "dflash", config, random_weights(config, 2, seed=3))
    llama = tiny_chat_model_dir(root / "llama", hidden_size=32, num_layers=4)
    eagle = save_eagle(
        random_eagle(load_target(llama, "float32")),
        root / "eagle",
        "speculators",
        {
            "speculators_config": {
                "algorithm": "eagle3",
                "verifier": {"name_or_path": "meta-llama/Llama-3.2-1B-Instruct"},
            }
        },
    )
    cache = root / "cache"
    for repo, files in [
        ("Qwen/Qwen3-8B", qwen),
        ("z-lab/Qwen3-8B-DFlash-b16", dflash),
        ("mlx-community/Qwen3-8B-4bit", shallower),
        ("meta-llama/Llama-3.1-8B-Instruct", llama),
        ("RedHatAI/Llama-3.1-8B-Instruct-speculator.eagle3", eagle),
    ]:
        hub_cache(cache, repo, files)
    return cache


@pytest.fixture
def offline(hub, monkeypatch):
    """The laid-out cache, offline: for child processes (the environment) and this one
    (huggingface_hub reads its constants from the environment once, at import)."""
    from huggingface_hub import constants

    monkeypatch.setenv("HF_HUB_CACHE", str(hub))
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(hub))
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", True)
    return hub


def test_names_match_as_dflash_mlx_matches():
    assert model_names("/c/hub/models--mlx-community--Qwen3-8B-4bit/snapshots/abc") == [
        "mlx-community/Qwen3-8B-4bit",
        "abc",
    ]
    for name in ("Qwen/Qwen3-8B", "mlx-community/Qwen3-8B-4bit", "qwen3-8b_mlx"):
        assert published_for([name])[0].repo == "z-lab/Qwen3-8B-DFlash-b16", name
    assert published_for(["mlx-community/Qwen3-8B-Base"])  # a dash after the registered name
    assert not published_for(["Qwen/Qwen3-80B"]) and not published_for(["my-model"])
    # The longest registered name wins: Qwen3.5-9B, not a shorter Qwen3 entry.
    assert [e.repo for e in published_for(["mlx-community/Qwen3.5-9B-MLX-4bit"])] == [
        "z-lab/Qwen3.5-9B-DFlash"
    ]


def test_auto_picks_the_published_dflash_drafter_offline(offline):
    loaded = load_model("Qwen/Qwen3-8B", draft="auto", suffix_memory="off", dtype="float32")
    assert (loaded.draft, loaded.why) == ("dflash", "z-lab/Qwen3-8B-DFlash-b16, published for Qwen/Qwen3-8B")
    plain = load_model("Qwen/Qwen3-8B", draft="none", dtype="float32").engine
    assert run(loaded.engine, PROMPT, 40)[0] == run(plain, PROMPT, 40)[0]


def test_cli_says_what_auto_chose(offline):
    import os

    env = dict(os.environ)
    out = subprocess.run(
        [
            sys.executable,
            "-m",
            "mlx_spec.cli",
            "generate",
            "--model",
            "Qwen/Qwen3-8B",
            "--draft",
            "auto",
            "--suffix-memory",
            "off",
            "-m",
            "12",
            "--json",
            "hello",
        ],
        capture_output=True,
        text=True,
        timeout=300,
        env=env,
    )
    assert out.returncode == 0, out.stderr
    reply = json.loads(out.stdout)
    assert reply["draft"] == "dflash" and "z-lab/Qwen3-8B-DFlash-b16" in reply["draft_why"]
    listed = subprocess.run(
        [sys.executable, "-m", "mlx_spec.cli", "drafters", "mlx-community/Qwen3-8B-4bit"],
        capture_output=True,
        text=True,
        timeout=120,
        env=env,
    )
    assert listed.returncode == 0, listed.stderr
    assert "z-lab/Qwen3-8B-DFlash-b16" in listed.stdout and "in the cache" in listed.stdout
    assert "RedHatAI/Qwen3-8B-speculator.eagle3" in listed.stdout and "not downloaded" in listed.stdout


def test_a_drafter_for_another_target_is_passed_over(offline):
    notes = []
    target = load_target(model_names_dir(offline, "meta-llama/Llama-3.1-8B-Instruct"), "float32")
    choice = choose(target, AUTO, note=notes.append)
    assert choice.draft == "suffix"
    assert any(
        "RedHatAI/Llama-3.1-8B-Instruct-speculator.eagle3" in n
        and "names the target meta-llama/Llama-3.2-1B-Instruct" in n
        for n in notes
    ), notes
    # Offline, the registered drafter not in the cache is said, not fetched.
    assert any("z-lab/LLaMA3.1-8B-Instruct-DFlash-UltraChat" in n and "HF_HUB_OFFLINE" in n for n in notes), (
        notes
    )


def test_a_dflash_drafter_of_another_depth_is_passed_over(offline):
    """z-lab's configs say the depth of the target they were trained on: a Qwen3-8B drafter
    found for a model of another depth does not fit."""
    notes = []
    target = load_target(model_names_dir(offline, "mlx-community/Qwen3-8B-4bit"), "float32")  # 3 layers
    assert choose(target, AUTO, note=notes.append).draft == "suffix"
    assert any("trained on a target of 4 layers; this one has 3" in n for n in notes), notes


def test_an_mtp_checkpoint_picks_its_module(tmp_path):
    _, target, _, _ = write_published(tmp_path, "llama")
    engine, choice = auto_engine(target, AUTO)
    assert (choice.draft, choice.why) == ("mtp", "the model's own MTP module")
    assert run(engine, PROMPT, 30)[0] == plain_greedy(target.model, PROMPT, 30)


def test_an_unknown_model_picks_suffix(tmp_path):
    path = tiny_chat_model_dir(tmp_path / "my-model")
    loaded = load_model(str(path), draft="auto", suffix_memory="off", dtype="float32")
    assert loaded.draft == "suffix" and "no published drafter" in loaded.why
    assert run(loaded.engine, PROMPT, 30)[0] == plain_greedy(loaded.engine.target.model, PROMPT, 30)


def test_auto_refuses_options_of_one_source(tmp_path):
    path = tiny_chat_model_dir(tmp_path / "m")
    with pytest.raises(
        MlxSpecError, match="--draft auto picks the source and its drafter: drop --tree-budget"
    ):
        load_model(str(path), draft="auto", tree_budget=8)
    with pytest.raises(
        MlxSpecError, match="--draft auto picks the source and its drafter: drop --draft-model"
    ):
        load_model(str(path), draft="auto", draft_model=str(path))


def model_names_dir(cache, repo):
    """The snapshot directory of `repo` in the laid-out cache."""
    return next((cache / ("models--" + repo.replace("/", "--")) / "snapshots").iterdir())
