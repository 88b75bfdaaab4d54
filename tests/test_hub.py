"""Models named by Hugging Face repo id, read from a hub cache laid out in the test (blobs,
snapshots, refs/main, as huggingface_hub writes them) with HF_HUB_OFFLINE=1: nothing here
reaches the network."""

import hashlib
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from mlx_spec.hub import is_repo_id
from tiny import tiny_chat_model_dir

COMMIT = "0123456789abcdef0123456789abcdef01234567"


def hub_cache(root: Path, repo_id: str, files_dir: Path, commit: str = COMMIT) -> Path:
    """Lay `files_dir` out as the hub cache holds a downloaded repo; returns the cache root."""
    repo = root / ("models--" + repo_id.replace("/", "--"))
    snapshot = repo / "snapshots" / commit
    (repo / "blobs").mkdir(parents=True, exist_ok=True)
    snapshot.mkdir(parents=True, exist_ok=True)
    for f in sorted(files_dir.iterdir()):
        data = f.read_bytes()
        blob = repo / "blobs" / hashlib.sha256(data).hexdigest()
        blob.write_bytes(data)
        (snapshot / f.name).symlink_to(os.path.relpath(blob, snapshot))
    (repo / "refs").mkdir(exist_ok=True)
    (repo / "refs" / "main").write_text(commit)
    return root


@pytest.fixture(scope="module")
def hub(tmp_path_factory):
    root = tmp_path_factory.mktemp("hub")
    model = tiny_chat_model_dir(root / "files")
    return hub_cache(root / "cache", "org/tiny-chat", model), model


@pytest.fixture
def offline(hub, monkeypatch):
    monkeypatch.setenv("HF_HUB_CACHE", str(hub[0]))
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    return hub


def cli(args, env):
    result = subprocess.run(
        [sys.executable, "-m", "mlx_spec.cli", *args], capture_output=True, text=True, timeout=300, env=env
    )
    return result.returncode, result.stdout, result.stderr


def test_repo_ids_and_paths():
    assert is_repo_id("mlx-community/Qwen3-4B-4bit") and is_repo_id("z-lab/Qwen3-8B-DFlash-b16")
    for name in ("./model", "/abs/path", "~/m", "a/b/c", "a/..", "noslash"):
        assert not is_repo_id(name), name


RESOLVE = """
import json, sys
from mlx_spec.errors import MlxSpecError
from mlx_spec.hub import resolve
for name, revision in json.loads(sys.argv[1]):
    try:
        print(json.dumps(["ok", str(resolve(name, revision))]))
    except MlxSpecError as e:
        print(json.dumps(["error", str(e)]))
"""


def resolved(calls, env):
    """resolve() in a fresh process: huggingface_hub reads HF_HUB_CACHE / HF_HUB_OFFLINE when it
    is imported, as it is for a user who sets them before starting mlx-spec."""
    result = subprocess.run(
        [sys.executable, "-c", RESOLVE, json.dumps(calls)],
        capture_output=True,
        text=True,
        timeout=120,
        env=env,
    )
    assert result.returncode == 0, result.stderr
    return [json.loads(line) for line in result.stdout.splitlines()]


def test_resolve_reads_the_cache_offline(offline, tmp_path):
    results = resolved(
        [
            ["org/tiny-chat", None],
            ["org/tiny-chat", COMMIT],
            [str(tmp_path), None],
            ["org/absent", None],
            ["org/tiny-chat", "v9"],
            ["no/such/dir", None],
        ],
        dict(os.environ),
    )
    snapshot = Path(results[0][1])
    assert results[0][0] == "ok" and snapshot.name == COMMIT and (snapshot / "config.json").is_file()
    assert results[1] == results[0]
    assert results[2] == ["ok", str(tmp_path)]  # an existing path wins
    assert (
        results[3][0] == "error"
        and "not in the Hugging Face cache and HF_HUB_OFFLINE is set" in results[3][1]
    )
    assert results[4][0] == "error" and "at revision v9" in results[4][1]
    assert "`hf download org/tiny-chat --revision v9`" in results[4][1]
    assert results[5][0] == "error" and "neither a directory nor a Hugging Face repo id" in results[5][1]


def test_generate_by_repo_id_equals_generate_by_directory(offline):
    env = dict(os.environ)
    args = ["generate", "Hello there", "--max-tokens", "12", "--json", "--draft", "model", "--fixed"]
    code, out, err = cli([*args, "--model", "org/tiny-chat", "--draft-model", "org/tiny-chat"], env)
    assert code == 0, err
    by_id = json.loads(out)
    code, out, err = cli([*args, "--model", str(offline[1]), "--draft-model", str(offline[1])], env)
    assert code == 0, err
    assert by_id["tokens"] == json.loads(out)["tokens"] and by_id["tokens"]
    # every draft of a model drafting for itself is accepted: the draft model was loaded too
    assert by_id["stats"]["acceptance_rate"] == 1.0


def test_unknown_repo_id_is_one_line(offline):
    code, out, err = cli(["generate", "Hi", "--model", "org/absent", "--max-tokens", "2"], dict(os.environ))
    assert code == 1 and len(err.strip().splitlines()) == 1, err
    assert "org/absent is not in the Hugging Face cache and HF_HUB_OFFLINE is set" in err


def test_convert_reads_a_repo_id(offline, tmp_path):
    code, out, err = cli(
        ["convert", "--hf-path", "org/tiny-chat", "--mlx-path", str(tmp_path / "out")], dict(os.environ)
    )
    assert code == 0, err
    assert (tmp_path / "out" / "config.json").is_file()
