"""The target split over two ranks on 127.0.0.1 (MLX's ring backend, as mlx.launch starts it):
every source rank 0 runs decodes what mlx-lm decodes over the same split target and what one
process decodes; a rank that dies or hangs ends the run in one line. The ranks are started and
stopped here, bounded in time."""

import json
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tiny import plain_greedy, run, tiny_chat_model_dir

HERE = Path(__file__).parent
LAUNCH_TIMEOUT = 240


def free_ports(n):
    sockets = [socket.socket() for _ in range(n)]
    for s in sockets:
        s.bind(("127.0.0.1", 0))
    ports = [s.getsockname()[1] for s in sockets]
    for s in sockets:
        s.close()
    return ports


class Ranks:
    """`command` started as ranks 0 and 1 of a ring on 127.0.0.1 (what mlx.launch does on
    one host); every process is killed on exit."""

    def __init__(self, command, tmp_path, cwd=HERE):
        hostfile = tmp_path / "hosts.json"
        hostfile.write_text(json.dumps([[f"127.0.0.1:{port}"] for port in free_ports(2)]))
        self.procs = []
        for rank in (1, 0):
            # PYTHONFAULTHANDLER: a rank that crashes shows where (in the failing test's message)
            env = dict(
                os.environ,
                MLX_RANK=str(rank),
                MLX_HOSTFILE=str(hostfile),
                HF_HUB_OFFLINE="1",
                PYTHONFAULTHANDLER="1",
            )
            self.procs.insert(
                0,
                subprocess.Popen(
                    command, cwd=cwd, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True
                ),
            )

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        for p in self.procs:
            if p.poll() is None:
                p.kill()
            p.communicate()

    def wait(self, timeout=LAUNCH_TIMEOUT):
        out, err = self.procs[0].communicate(timeout=timeout)
        self.follower_output = self.procs[1].communicate(timeout=30)
        return self.procs[0].returncode, out, err


@pytest.mark.parametrize("arch,sharding", [("qwen3", "tensor"), ("qwen3_next", "pipeline")])
def test_split_target_decodes_exactly(arch, sharding, tmp_path):
    """Greedy: each source over the split target = mlx-lm's decoding of the split target = one
    process's, over two turns of a conversation; seeded sampling = --draft none --seed of one
    process. Under pipeline stages rank 0 holds the last layers: EAGLE-3 and DFlash read the
    first ones, which rank 1 sends it after each pass."""
    import distributed_driver as driver
    from mlx_spec.engine import Engine
    from mlx_spec.models.target import Target
    from mlx_spec.sampling import SamplingParams

    out = tmp_path / "out.json"
    with Ranks(
        [sys.executable, "distributed_driver.py", arch, sharding, str(out), str(tmp_path)], tmp_path
    ) as ranks:
        rc, _, err = ranks.wait()
    assert rc == 0, err[-2000:]
    result = json.loads(out.read_text())

    model, config, _ = driver.split_target_of(arch, tmp_path / "alone")
    alone = Target(model, None, config)
    expected = plain_greedy(model, driver.PROMPT, driver.TOKENS)
    assert result["mlx_lm"] == expected
    sampled = run(
        Engine(alone, seed=driver.SEED),
        driver.PROMPT,
        driver.TOKENS,
        sampling=SamplingParams(temp=1.0),
        seed=driver.SEED,
    )[0]
    split_sources = {"none", "lookup", "draft_model", "eagle", "dflash", "medusa"} | (
        {"mtp"} if sharding == "pipeline" else set()
    )
    assert set(result["cases"]) == split_sources
    for name, case in result["cases"].items():
        assert case["first"] == expected, name
        assert case["second"] == plain_greedy(model, case["follow_up"], driver.TOKENS), name
        assert case["sampled"] == sampled, name
        assert name == "none" or case["proposed"] > 0, name
    if sharding == "tensor":  # --kv-bits (--draft none): mlx-lm's tokens over the split target
        assert result["kv_bits"]["mlx_spec"] == result["kv_bits"]["mlx_lm"]
    assert not result["refused"]
    # The feature drafters read the same features as in one process (under pipeline stages,
    # sent by rank 1): they draft the same tokens.
    from mlx_spec.drafters.dflash import DFlashDrafter
    from mlx_spec.drafters.eagle import EagleDrafter
    from test_windowed import random_feature_models

    eagle, dflash = random_feature_models(alone, tmp_path / "alone")
    for name, drafter in (
        ("eagle", EagleDrafter(eagle, alone.vocab_size)),
        ("dflash", DFlashDrafter(alone, dflash)),
    ):
        drafter = driver.recording(drafter)
        run(Engine(alone, drafter, num_draft_tokens=4, adaptive=False), driver.PROMPT, driver.TOKENS)
        assert result["cases"][name]["drafts"] == drafter.proposed, name


@pytest.fixture(scope="module")
def chat_model(tmp_path_factory):
    """A tiny qwen3 with the default model's tokenizer: heads and MLP split in two."""
    return tiny_chat_model_dir(tmp_path_factory.mktemp("split") / "qwen3", arch="qwen3", num_layers=2)


def cli(*args):
    return [sys.executable, "-m", "mlx_spec", *args]


def test_cli_generate_over_two_ranks(chat_model, tmp_path):
    """`mlx-spec generate --sharding tensor` on two ranks prints what one process prints."""
    from click.testing import CliRunner

    from mlx_spec.cli import main as mlx_spec_cli

    args = ["generate", "--model", str(chat_model), "--json", "-m", "40", "Count to ten"]
    alone = CliRunner().invoke(mlx_spec_cli, args + ["--draft", "none"])
    assert alone.exit_code == 0, alone.output
    with Ranks(cli(*args, "--draft", "lookup", "--sharding", "tensor"), tmp_path) as ranks:
        rc, out, err = ranks.wait()
    assert rc == 0, err[-2000:]
    assert json.loads(out)["tokens"] == json.loads(alone.output)["tokens"]
    assert ranks.procs[1].returncode == 0
    assert ranks.follower_output == ("", "")  # only rank 0 prints


@pytest.mark.parametrize("temp", ["0", "1"])
def test_bench_over_two_ranks(temp, chat_model, tmp_path):
    """`mlx-spec bench --sharding tensor`: mlx-lm's decoding of the split target (on both ranks,
    ordered by rank 0) against each source over it; every output identical to it."""
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text(
        "".join(json.dumps({"prompt": p}) + "\n" for p in ["Count to ten", "a b c a b c a b c"])
    )
    out = tmp_path / "bench.json"
    args = cli(
        "bench",
        "--model",
        str(chat_model),
        "--sharding",
        "tensor",
        "--methods",
        "none,lookup",
        "--prompts",
        str(prompts),
        "-m",
        "24",
        "--repeats",
        "1",
        "--temp",
        temp,
        "--json",
        str(out),
    )
    with Ranks(args, tmp_path) as ranks:
        rc, stdout, err = ranks.wait()
    assert rc == 0, err[-2000:]
    assert ranks.procs[1].returncode == 0, ranks.follower_output[1][-2000:]
    assert ranks.follower_output[0] == ""
    result = json.loads(out.read_text())
    records = result["records"]
    assert sorted({r["method"] for r in records}) == ["lookup", "none"]
    assert len(records) == 4 and all(r["identical"] for r in records), records
    assert all(r["generated_tokens"] == r["baseline_tokens"] > 0 for r in records)
    assert result["meta"]["sharding"] == "tensor" and result["meta"]["ranks"] == 2
    assert "lookup" in stdout


def test_serve_over_two_ranks(chat_model, tmp_path):
    """`mlx-spec serve --sharding tensor`: rank 0 serves (one request at a time) what one process
    generates; SIGTERM stops it, and rank 1 ends with it."""
    import urllib.request

    from click.testing import CliRunner

    from mlx_spec.cli import main as mlx_spec_cli

    alone = CliRunner().invoke(
        mlx_spec_cli,
        [
            "generate",
            "--model",
            str(chat_model),
            "--json",
            "-m",
            "30",
            "--draft",
            "none",
            "--no-chat-template",
            "Count to ten",
        ],
    )
    assert alone.exit_code == 0, alone.output
    port = free_ports(1)[0]
    args = cli("serve", "--model", str(chat_model), "--sharding", "tensor", "--port", str(port))
    with Ranks(args, tmp_path) as ranks:
        deadline, err = time.monotonic() + 120, ""
        while "on http://" not in err and time.monotonic() < deadline:
            assert ranks.procs[0].poll() is None, ranks.procs[0].stderr.read()
            err += ranks.procs[0].stderr.readline()
        assert "requests run one at a time" in err
        body = json.dumps({"prompt": "Count to ten", "max_tokens": 30, "temperature": 0}).encode()
        request = urllib.request.Request(
            f"http://127.0.0.1:{port}/v1/completions", body, {"Content-Type": "application/json"}
        )
        for _ in range(2):  # the second reuses the cache on every rank
            reply = json.loads(urllib.request.urlopen(request, timeout=120).read())
            assert reply["choices"][0]["text"] == json.loads(alone.output)["text"]
        ranks.procs[0].send_signal(signal.SIGTERM)
        ranks.procs[0].wait(timeout=30)
        ranks.procs[1].wait(timeout=30)
        assert [p.returncode for p in ranks.procs] == [0, 0], [p.stderr.read()[-3000:] for p in ranks.procs]


def started_streaming(ranks, seconds=120):
    """Wait until rank 0 has printed some of its reply."""
    import select

    deadline = time.monotonic() + seconds
    stdout = ranks.procs[0].stdout
    while time.monotonic() < deadline:
        if select.select([stdout], [], [], 0.1)[0]:
            return True
        assert ranks.procs[0].poll() is None, ranks.procs[0].stderr.read()
    return False


@pytest.mark.parametrize("how", ["killed", "hung"])
def test_a_lost_rank_ends_the_run_in_one_line(how, chat_model, tmp_path):
    """Rank 1 killed (its connection breaks) or stopped (it stays silent) mid-reply: rank 0 ends
    within the timeout with one line, never a traceback or a hang."""
    # A killed rank breaks the connection at once: only a hung one needs the short timeout.
    timeout = "60" if how == "killed" else "4"
    args = cli(
        "generate",
        "--model",
        str(chat_model),
        "--draft",
        "lookup",
        "--sharding",
        "tensor",
        "--rank-timeout",
        timeout,
        "-m",
        "1500",
        "--no-chat-template",
        "a b c a b c",
    )
    with Ranks(args, tmp_path) as ranks:
        assert started_streaming(ranks)
        os.kill(ranks.procs[1].pid, signal.SIGKILL if how == "killed" else signal.SIGSTOP)
        tic = time.monotonic()
        try:
            ranks.procs[0].wait(timeout=30)
        finally:
            ranks.procs[1].kill()
        assert time.monotonic() - tic < 30
        err = ranks.procs[0].stderr.read()
    assert ranks.procs[0].returncode == 1
    assert "Traceback" not in err
    ours = [line for line in err.splitlines() if "rank" in line and not line.startswith("[ring]")]
    assert len(ours) == 1, err
    assert (
        "a rank stopped or cannot be reached" if how == "killed" else "did not answer within 4 s"
    ) in ours[0]


def test_sharding_auto_says_which_and_why():
    """Tensor where the heads split evenly over the ranks, else pipeline stages, else one line."""
    from mlx_spec.distributed import choose_sharding
    from mlx_spec.errors import MlxSpecError
    from tiny import tiny_config, tiny_model

    even = tiny_config("llama", num_attention_heads=8, num_key_value_heads=4, hidden_size=64)
    assert choose_sharding(tiny_model(even), even, 2) == (
        "tensor",
        "its attention heads split evenly over 2 ranks",
    )
    odd = tiny_config("qwen2", num_attention_heads=9, num_key_value_heads=3, hidden_size=72)
    assert choose_sharding(tiny_model(odd), odd, 2) == (
        "pipeline",
        "its num_attention_heads (9) is not a multiple of the 2 ranks",
    )
    odd_llama = dict(odd, model_type="llama")
    with pytest.raises(
        MlxSpecError,
        match="cannot split this llama model: its num_attention_heads .9. is not a "
        "multiple of the 2 ranks, and mlx-lm has no pipeline stages for it",
    ):
        choose_sharding(tiny_model(odd_llama), odd_llama, 2)


def test_refusals_before_the_first_token(tmp_path):
    """What cannot run split is refused in one line (no ranks needed to tell)."""
    from mlx_spec.distributed import Channel, init_group, shard_model, split_engine
    from mlx_spec.errors import MlxSpecError
    from tiny import tiny_config, tiny_model

    with pytest.raises(MlxSpecError, match="this one is alone"):
        init_group("tensor")

    class TwoRanks:
        def size(self):
            return 2

        def rank(self):
            return 0

    config = tiny_config("llama", num_attention_heads=9, num_key_value_heads=3, hidden_size=72)
    with pytest.raises(MlxSpecError, match=r"num_attention_heads \(9\) is not a multiple of the 2 ranks"):
        shard_model(tiny_model(config), config, "tensor", TwoRanks())
    config = tiny_config("llama")
    with pytest.raises(MlxSpecError, match="no pipeline stages for a llama model: try --sharding tensor"):
        shard_model(tiny_model(config), config, "pipeline", TwoRanks())

    from mlx_spec.drafters.layerskip import LayerSkipDrafter
    from mlx_spec.models.target import Target

    target = Target(tiny_model(config), None, config)
    channel = Channel(TwoRanks(), [range(0, 2), range(0, 2)])
    channel.broken = True  # nothing may be sent: these are refused before any order
    with pytest.raises(MlxSpecError, match="keeps one conversation"):
        split_engine(target, None, channel, sessions=True)
    with pytest.raises(MlxSpecError, match="runs the target's own layers"):
        split_engine(target, LayerSkipDrafter(target, 1), channel)
    engine = split_engine(target, None, channel)
    with pytest.raises(MlxSpecError, match="does not run with --sharding"):
        engine.resume([])
    # A pass interrupted on rank 0 (an error, a second Ctrl-C) leaves the others inside it: fatal,
    # and the engine refuses to go on.
    from mlx_spec.errors import RanksLost

    channel.broken = False
    engine.passes.in_pass = True
    with pytest.raises(RanksLost, match="out of step"):
        engine.reset()
    assert channel.broken
    with pytest.raises(RanksLost, match="lost a rank earlier"):
        list(engine.generate([1, 2, 3], max_tokens=2))
    # ... but a pass that broke because a rank was lost says that, not "interrupted".
    engine.passes.in_pass = True
    engine.reset()

    # bench over a split target times one generation at a time, by the seeded rule.
    from click.testing import CliRunner

    from mlx_spec.cli import main as mlx_spec_cli

    for flags, line in [
        (["--sharding", "tensor", "--concurrency", "2"], "drop --concurrency"),
        (["--sharding", "tensor", "--residual-sampling"], "drop --concurrency and --residual"),
        (["--rank-timeout", "5"], "give --sharding too"),
    ]:
        result = CliRunner().invoke(mlx_spec_cli, ["bench", *flags])
        assert result.exit_code == 1 and line in result.output and "Traceback" not in result.output

    # A follower checks it holds what rank 0's cache holds.
    from mlx_spec.distributed import Follower

    with pytest.raises(
        MlxSpecError, match="rank 0 is out of step with rank 0: its cache holds 0 tokens, rank 0's 5"
    ):
        Follower(target, channel)._in_step(5)

    # MLX's ring sends only to neighbours: a drafter tapping rank 2 of 4 pipeline ranks is refused.
    from mlx_spec.drafters.base import NoDrafter

    class Tapping(NoDrafter):
        taps = [1]

    class FourRanks(TwoRanks):
        def size(self):
            return 4

    far = Channel(FourRanks(), [range(3, 4), range(2, 3), range(1, 2), range(0, 1)])
    far.broken = True
    with pytest.raises(MlxSpecError, match="pipeline rank 2 of 4 holds"):
        split_engine(target, Tapping(), far)

    from click.testing import CliRunner

    from mlx_spec.cli import main

    result = CliRunner().invoke(main, ["serve", "--sharding", "tensor"])
    assert result.exit_code == 1 and "this one is alone" in result.output
    result = CliRunner().invoke(main, ["generate", "--sharding", "tensor", "--prompt-cache-file", "x", "hi"])
    assert result.exit_code == 2 and "does not run with --sharding" in result.output
    result = CliRunner().invoke(main, ["generate", "--rank-timeout", "5", "hi"])
    assert result.exit_code == 1 and "is for a split target" in result.output
