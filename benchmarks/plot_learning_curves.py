"""Learning curves of the drafter training runs logged under benchmarks/training/ (each run's
OUT/train_log.jsonl, copied there when it ends): the training loss (a running mean over
--smooth steps) and, where the run evaluated (`train ... --eval-every N`), the drafter's tau at
4 drafts on the data's held-out prompts. One column per kind of drafter (the file name up to its
first dash). Needs the `plot` extra (matplotlib).

    python benchmarks/plot_learning_curves.py [--out benchmarks/learning_curves.png]"""

import argparse
import json
from pathlib import Path

import numpy as np


def read_log(path: Path):
    steps, losses, dev = [], [], []
    for line in path.read_text().splitlines():
        record = json.loads(line)
        if "dev_tau" in record:
            dev.append((record["step"], record["dev_tau"]))
        elif "loss" in record:
            steps.append(record["step"])
            losses.append(record["loss"])
    return np.array(steps), np.array(losses), dev


def running_mean(values: np.ndarray, window: int) -> np.ndarray:
    if len(values) < window:
        return values
    return np.convolve(values, np.ones(window) / window, mode="valid")


def main():
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    here = Path(__file__).parent
    parser.add_argument("--logs", default=str(here / "training"))
    parser.add_argument("--out", default=str(here / "learning_curves.png"))
    parser.add_argument("--smooth", type=int, default=25)
    opts = parser.parse_args()
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        raise SystemExit("this script needs matplotlib: pip install -e '.[plot]'") from None

    logs = sorted(Path(opts.logs).glob("*.jsonl"))
    kinds = sorted({p.stem.split("-")[0] for p in logs})
    fig, axes = plt.subplots(2, len(kinds), figsize=(4.2 * len(kinds), 6.5), squeeze=False)
    for column, kind in enumerate(kinds):
        loss_ax, tau_ax = axes[0][column], axes[1][column]
        for path in (p for p in logs if p.stem.split("-")[0] == kind):
            steps, losses, dev = read_log(path)
            if len(losses):
                smooth = running_mean(losses, opts.smooth)
                loss_ax.plot(steps[len(steps) - len(smooth) :], smooth, label=path.stem, lw=1)
            if dev:
                tau_ax.plot(*zip(*dev), marker="o", label=path.stem, lw=1)
        loss_ax.set_title(kind)
        loss_ax.set_ylabel(f"training loss (mean of {opts.smooth} steps)")
        tau_ax.set_ylabel("dev tau at 4 drafts")
        tau_ax.set_xlabel("step of the run")
        for ax in (loss_ax, tau_ax):
            if ax.lines:
                ax.legend(fontsize=6)
            ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(opts.out, dpi=110)
    print(f"{len(logs)} runs -> {opts.out}")


if __name__ == "__main__":
    main()
