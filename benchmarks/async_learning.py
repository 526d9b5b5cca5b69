"""Time to reward, synchronous vs asynchronous: the default task trained to ``stop.iterations``
with ``rollout.max_staleness`` = 0, 1, 2 (V-trace targets, and plain GAE to show what V-trace buys).

    python benchmarks/async_learning.py --out runs/async-learning [--iterations 40] [KEY=VALUE ...]

Each run is a whole ``rayppo train`` (real Ray, vLLM, DeepSpeed), one after another in this
process, with one core for the generator and one for the learner (``generators.threads=1
learner.threads=1 learner.num_ranks=1``), as roles on separate GPUs would have. Writes
``DIR/async_learning.json`` (per run: seconds and iterations to reach the target reward, final
reward) and ``DIR/async_learning.png`` (reward against wall-clock seconds); prints a table.
"""

from __future__ import annotations

import argparse
import json
import re
import sys
from pathlib import Path
from typing import Any

RUNS = {
    "sync (k=0)": ["rollout.max_staleness=0"],
    "k=1, V-trace": ["rollout.max_staleness=1", "ppo.value_targets=vtrace"],
    "k=2, V-trace": ["rollout.max_staleness=2", "ppo.value_targets=vtrace"],
    "k=1, GAE": ["rollout.max_staleness=1", "ppo.value_targets=gae"],
    "k=2, GAE": ["rollout.max_staleness=2", "ppo.value_targets=gae"],
}
DISAGGREGATED = ["generators.threads=1", "learner.threads=1", "learner.num_ranks=1", "learner.cpus_per_rank=1",
                 "generators.cpus_per_worker=1"]
TARGET = 0.85
"""The reward the synchronous default reaches within 40 iterations (README, quick start)."""
WINDOW = 3
"""Iterations in the moving mean compared with the target (one iteration's mean is noisy)."""


def time_to_target(records: list[dict[str, float]], target: float = TARGET, window: int = WINDOW
                   ) -> tuple[float | None, int | None]:
    """``(seconds, iterations)`` until the moving mean of ``reward/mean`` over ``window``
    iterations first reaches ``target`` (seconds: the iterations' wall clock); None if never."""
    elapsed, rewards = 0.0, []
    for r in records:
        elapsed += r["time/iteration"]
        rewards.append(r["reward/mean"])
        if len(rewards) >= window and sum(rewards[-window:]) / window >= target:
            return elapsed, r["iteration"] + 1
    return None, None


def run_one(name: str, overrides: list[str], out: Path) -> dict[str, Any]:
    from rayppo.cluster.pipeline import distributed_trainer
    from rayppo.config import load_config
    from rayppo.metrics import read_metrics
    from rayppo.train import run

    folder = out / re.sub(r"[^a-z0-9]+", "-", name.lower()).strip("-")  # "k=1, V-trace" -> k-1-v-trace
    cfg = load_config(None, overrides + [f"output.dir={folder}", "output.overwrite=true", "output.save_model=false",
                                         "output.checkpoint_every=0", "eval.every=0", "output.samples_every=0"])
    print(f"{name}: {' '.join(overrides)}", file=sys.stderr)
    run(cfg, distributed_trainer(cfg), progress=False)
    records = read_metrics(folder / "metrics.jsonl")
    seconds, iterations = time_to_target(records)
    return {"name": name, "overrides": overrides, "seconds_to_target": seconds, "iterations_to_target": iterations,
            "total_seconds": sum(r["time/iteration"] for r in records),
            "final_reward": sum(r["reward/mean"] for r in records[-5:]) / len(records[-5:]),
            "staleness_mean": sum(r.get("async/staleness_mean", 0.0) for r in records) / len(records),
            "curve": [(r["iteration"], r["time/iteration"], r["reward/mean"]) for r in records]}


def plot(results: list[dict[str, Any]], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4))
    for r in results:
        elapsed, xs, ys = 0.0, [], []
        for _, seconds, reward in r["curve"]:
            elapsed += seconds
            xs.append(elapsed)
            ys.append(reward)
        ax.plot(xs, ys, label=r["name"], linestyle="-" if "GAE" not in r["name"] else "--")
    ax.axhline(TARGET, color="grey", linewidth=0.8)
    ax.set(title="reward against wall-clock time (default task)", xlabel="seconds (iterations only)",
           ylabel="reward/mean")
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", default="runs/async-learning", help="output folder")
    parser.add_argument("--iterations", type=int, default=40, help="iterations per run (stop.iterations)")
    parser.add_argument("--only", nargs="*", default=None, help="run only these names of RUNS")
    parser.add_argument("overrides", nargs="*", help="KEY=VALUE for every run")
    args = parser.parse_args(argv)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    results = []
    for name, run_overrides in RUNS.items():
        if args.only is None or name in args.only:
            results.append(run_one(name, DISAGGREGATED + [f"stop.iterations={args.iterations}"] + args.overrides
                                   + run_overrides, out))
            (out / "async_learning.json").write_text(json.dumps(results, indent=1))
    plot(results, out / "async_learning.png")
    print(f"\n{'run':<16}{'s to ' + str(TARGET):>10}{'its':>6}{'total s':>10}{'final':>8}{'staleness':>11}")
    for r in results:
        s = f"{r['seconds_to_target']:.1f}" if r["seconds_to_target"] is not None else "never"
        print(f"{r['name']:<16}{s:>10}{r['iterations_to_target'] or '-':>6}{r['total_seconds']:>10.1f}"
              f"{r['final_reward']:>8.3f}{r['staleness_mean']:>11.2f}")


if __name__ == "__main__":
    main()
