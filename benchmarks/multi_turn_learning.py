"""The embedded multi-turn task (examples/guess.yaml) over several seeds: does RL learn to bisect?

    python benchmarks/multi_turn_learning.py --out runs/guess [--seeds 0 1 ... 7] [--iterations 60] [KEY=VALUE ...]

Each seed is the in-process trainer on the shipped config (``trainer=reference``: the path the
distributed trainer is tested equal to on multi-turn rows). The skill metric is the mean number of
turns an episode takes (``episode/turns_mean``: the warm-up's aimless legal play takes 3.44 on
average, bisection 2.9), with the mean episode reward beside it. Before is the mean of the first 5
iterations, after the mean of the last 10. Writes ``DIR/multi_turn_learning.json`` and
``DIR/multi_turn_learning.png`` (turns and reward against the iteration, mean over the seeds) and
prints the table docs/multi-turn.md shows.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path
from typing import Any

CONFIG = Path(__file__).resolve().parents[1] / "examples" / "guess.yaml"
COMMON = ["trainer=reference", "output.save_model=false", "output.checkpoint_every=0", "output.samples_every=0",
          "output.tensorboard=false", "eval.every=0"]


def run_seed(seed: int, iterations: int, extra: list[str], out: Path) -> dict[str, Any]:
    from rayppo.config.load import load_config
    from rayppo.run.metrics import read_metrics
    from rayppo.train import run
    from rayppo.trainers.inprocess import InProcessTrainer

    folder = out / f"seed{seed}"
    cfg = load_config(CONFIG, COMMON + extra + [f"seed={seed}", f"stop.iterations={iterations}",
                                                f"output.dir={folder}", "output.overwrite=true"])
    run(cfg, InProcessTrainer(cfg), progress=False)
    records = read_metrics(folder / "metrics.jsonl")

    def mean(key: str, part: list[dict]) -> float:
        return sum(r[key] for r in part) / len(part)

    return {"seed": seed, "seconds": sum(r["time/iteration"] for r in records),
            "turns_before": mean("episode/turns_mean", records[:5]), "turns_after": mean("episode/turns_mean", records[-10:]),
            "reward_before": mean("reward/mean", records[:5]), "reward_after": mean("reward/mean", records[-10:]),
            "curve": [(r["iteration"], r["episode/turns_mean"], r["reward/mean"]) for r in records]}


def table(runs: list[dict[str, Any]]) -> str:
    def cell(key: str) -> str:
        values = [r[key] for r in runs]
        return f"{statistics.mean(values):.2f} ± {statistics.stdev(values) if len(values) > 1 else 0.0:.2f}"

    improved = sum(r["turns_after"] < r["turns_before"] for r in runs)
    return ("| seeds | turns before | turns after | reward before | reward after | seeds improved | s per run |\n"
            "|---|---|---|---|---|---|---|\n"
            f"| {len(runs)} | {cell('turns_before')} | {cell('turns_after')} | {cell('reward_before')} | "
            f"{cell('reward_after')} | {improved}/{len(runs)} | {statistics.mean(r['seconds'] for r in runs):.0f} |")


def plot(runs: list[dict[str, Any]], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    length = min(len(r["curve"]) for r in runs)
    fig, (turns, reward) = plt.subplots(1, 2, figsize=(10, 3.6))
    for axis, column, label in ((turns, 1, "turns per episode"), (reward, 2, "episode reward")):
        for r in runs:
            axis.plot([p[0] for p in r["curve"][:length]], [p[column] for p in r["curve"][:length]], color="0.8", lw=0.8)
        axis.plot(range(length), [statistics.mean(r["curve"][i][column] for r in runs) for i in range(length)],
                  color="C0", lw=2, label=f"mean of {len(runs)} seeds")
        axis.set_xlabel("iteration")
        axis.set_ylabel(label)
    turns.axhline(3.44, color="C1", ls="--", lw=1, label="warm-up (aimless), 3.44")
    turns.axhline(2.9, color="C2", ls="--", lw=1, label="bisection, 2.9")
    turns.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--seeds", type=int, nargs="+", default=list(range(8)))
    parser.add_argument("--iterations", type=int, default=60)
    parser.add_argument("overrides", nargs="*", help="extra config overrides, section.field=value")
    args = parser.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    runs = []
    for seed in args.seeds:
        runs.append(run_seed(seed, args.iterations, args.overrides, args.out))
        print(f"seed {seed}: turns {runs[-1]['turns_before']:.2f} -> {runs[-1]['turns_after']:.2f}, reward "
              f"{runs[-1]['reward_before']:.3f} -> {runs[-1]['reward_after']:.3f}", file=sys.stderr, flush=True)
    (args.out / "multi_turn_learning.json").write_text(json.dumps(runs, indent=1))
    plot(runs, args.out / "multi_turn_learning.png")
    print(table(runs))
    return 0


if __name__ == "__main__":
    sys.exit(main())
