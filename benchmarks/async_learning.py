"""Time to reward, synchronous vs asynchronous: the default task trained to ``stop.iterations``
with ``rollout.max_staleness`` = 0, 1, 2 (V-trace targets; plain GAE to show what V-trace buys;
the Retrace-style advantages of ``ppo.offpolicy_advantages=retrace`` against the default GAE ones).

    python benchmarks/async_learning.py --out runs/async-learning [--iterations 40] [--seeds 0 1 2]
        [--only NAME ...] [KEY=VALUE ...]

Each run is a whole ``rayppo train`` (real Ray, vLLM, DeepSpeed), one after another in this
process, with one core for the generator and one for the learner, as roles on separate GPUs
would have: one thread each, the learner's rank pinned to the second core and the generator,
reference and reward actors to the first (``<role>.cores``). Writes ``DIR/async_learning.json``
(per run and seed: seconds and iterations to reach the target reward, final reward, the curve)
and ``DIR/async_learning.png`` (reward against wall-clock seconds, mean over the seeds); prints a
table with the mean over the seeds.
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
    "k=1, V-trace + Retrace": ["rollout.max_staleness=1", "ppo.value_targets=vtrace", "ppo.offpolicy_advantages=retrace"],
    "k=1, GAE": ["rollout.max_staleness=1", "ppo.value_targets=gae"],
    "k=2, GAE": ["rollout.max_staleness=2", "ppo.value_targets=gae"],
}
DISAGGREGATED = ["generators.threads=1", "learner.threads=1", "learner.num_ranks=1", "learner.cpus_per_rank=1",
                 "generators.cpus_per_worker=1"]


def pinned_cores() -> list[str]:
    """The learner on this process's second core, the other roles on its first (none on one core)."""
    import os

    cores = sorted(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else []
    if len(cores) < 2:
        return []
    return [f"learner.cores=[{cores[1]}]"] + [f"{role}.cores=[{cores[0]}]" for role in ("generators", "reference",
                                                                                        "reward")]
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
            return elapsed, int(r["iteration"]) + 1
    return None, None


def run_recipe(recipe: str | None, name: str, overrides: list[str], out: Path, seed: int
               ) -> tuple[float, list[dict[str, float]]]:
    """``rayppo train`` of ``recipe`` (None: the defaults) with ``overrides`` and ``seed`` in this
    process, into ``out/<name>-seed<seed>`` (no model saved, no checkpoints); returns the wall
    clock of the whole run and its records."""
    import time

    from rayppo.config.load import load_config
    from rayppo.run.metrics import read_metrics
    from rayppo.train import run
    from rayppo.trainers.choice import make_trainer

    folder = out / f"{re.sub(r'[^a-z0-9]+', '-', name.lower()).strip('-')}-seed{seed}"  # k-1-v-trace-seed0
    cfg = load_config(recipe, overrides + [f"seed={seed}", f"output.dir={folder}", "output.overwrite=true",
                                           "output.save_model=false", "output.checkpoint_every=0"])
    print(f"{name}, seed {seed}: {' '.join(overrides)}", file=sys.stderr)
    start = time.perf_counter()
    run(cfg, make_trainer(cfg), progress=False)
    return time.perf_counter() - start, read_metrics(folder / "metrics.jsonl")


def run_one(name: str, overrides: list[str], out: Path, seed: int) -> dict[str, Any]:
    # beta 0.05: the default when benchmarks/results/async_learning.json was recorded (now 0.02).
    _, records = run_recipe(None, name, overrides + ["eval.every=0", "output.samples_every=0", "ppo.kl_coef=0.05"],
                            out, seed)
    seconds, iterations = time_to_target(records)
    return {"name": name, "seed": seed, "overrides": overrides, "seconds_to_target": seconds, "iterations_to_target": iterations,
            "total_seconds": sum(r["time/iteration"] for r in records),
            "final_reward": sum(r["reward/mean"] for r in records[-5:]) / len(records[-5:]),
            "staleness_mean": sum(r.get("async/staleness_mean", 0.0) for r in records) / len(records),
            "curve": [(r["iteration"], r["time/iteration"], r["reward/mean"]) for r in records]}


def mean_curve(runs: list[dict[str, Any]]) -> tuple[list[float], list[float], list[float]]:
    """``(seconds, reward, spread)`` per iteration over the seeds of one run: the mean of the
    cumulative iteration seconds, the mean ``reward/mean`` and its standard deviation."""
    import statistics

    length = min(len(r["curve"]) for r in runs)
    elapsed = [[0.0] for _ in runs]
    for k, r in enumerate(runs):
        for _, seconds, _ in r["curve"][:length]:
            elapsed[k].append(elapsed[k][-1] + seconds)
    xs = [statistics.fmean(e[i + 1] for e in elapsed) for i in range(length)]
    rewards = [[r["curve"][i][2] for r in runs] for i in range(length)]
    return xs, [statistics.fmean(v) for v in rewards], [statistics.pstdev(v) for v in rewards]


def plot(results: list[dict[str, Any]], path: Path, by_iteration: bool = False, title: str | None = None) -> None:
    """Reward against the iterations' wall clock (or the iteration), one line per run: the mean
    over the seeds, shaded one standard deviation either side."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4))
    seeds = sorted({r["seed"] for r in results})
    for name in dict.fromkeys(r["name"] for r in results):
        xs, ys, spread = mean_curve([r for r in results if r["name"] == name])
        xs = list(range(len(ys))) if by_iteration else xs
        line, = ax.plot(xs, ys, label=name, linestyle="-" if "GAE" not in name else "--")
        ax.fill_between(xs, [y - d for y, d in zip(ys, spread)], [y + d for y, d in zip(ys, spread)],
                        color=line.get_color(), alpha=0.12, linewidth=0)
    ax.axhline(TARGET, color="grey", linewidth=0.8)
    ax.set(title=title or f"reward against wall-clock time (default task, mean of {len(seeds)} seed(s))",
           xlabel="iteration" if by_iteration else "seconds (iterations only)", ylabel="reward/mean")
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


def _mean(xs: list[float]) -> float | None:
    return sum(xs) / len(xs) if xs else None


def summary(results: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Per run name: each seed's seconds to the target (None: never), their mean over the seeds
    that reached it, how many did, mean iterations to it and mean seconds per iteration."""
    rows = []
    for name in dict.fromkeys(r["name"] for r in results):
        runs = [r for r in results if r["name"] == name]
        reached = [r for r in runs if r["seconds_to_target"] is not None]
        rows.append({"name": name, "seconds": [r["seconds_to_target"] for r in runs], "reached": len(reached),
                     "runs": len(runs), "mean_seconds": _mean([r["seconds_to_target"] for r in reached]),
                     "mean_iterations": _mean([r["iterations_to_target"] for r in reached]),
                     "seconds_per_iteration": _mean([r["total_seconds"] / len(r["curve"]) for r in runs])})
    return rows


def learning_args(argv: list[str] | None, doc: str, runs: dict[str, list[str]], out: str, seeds: list[int],
                  iterations: int = 40) -> argparse.Namespace:
    """The command line of a learning comparison: --out, --iterations, --seeds, --only, overrides."""
    parser = argparse.ArgumentParser(description=doc.split("\n\n")[0])
    parser.add_argument("--out", default=out, help="output folder")
    parser.add_argument("--iterations", type=int, default=iterations, help="iterations per run (stop.iterations)")
    parser.add_argument("--seeds", type=int, nargs="+", default=seeds, help="seeds; every run is repeated per seed")
    parser.add_argument("--only", nargs="+", default=None, choices=list(runs), metavar="NAME",
                        help=f"run only these runs (of: {'; '.join(runs)}); put KEY=VALUE overrides before it")
    parser.add_argument("overrides", nargs="*", help="KEY=VALUE for every run")
    return parser.parse_args(argv)


def run_all(args: argparse.Namespace, runs: dict[str, list[str]], base: list[str], run_one, json_name: str
            ) -> list[dict[str, Any]]:
    """Every run of ``runs`` per seed (seeds outermost: a slow spell of the machine hits every run
    alike), ``base`` + the run's overrides; the results so far rewritten to ``json_name`` after each."""
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    results = []
    for seed in args.seeds:
        for name, run_overrides in runs.items():
            if args.only is None or name in args.only:
                results.append(run_one(name, base + [f"stop.iterations={args.iterations}"] + args.overrides
                                       + run_overrides, out, seed))
                (out / json_name).write_text(json.dumps(
                    {"target": TARGET, "summary": summary(results), "runs": results}, indent=1))
    return results


def main(argv: list[str] | None = None) -> None:
    args = learning_args(argv, __doc__, RUNS, "runs/async-learning", [0])
    results = run_all(args, RUNS, DISAGGREGATED + pinned_cores(), run_one, "async_learning.json")
    out = Path(args.out)
    plot(results, out / "async_learning.png")
    print(f"\n{'run':<24}{'reached':>9}{'mean s to ' + str(TARGET):>16}{'its':>7}{'s / it':>8}  seconds per seed")
    for row in summary(results):
        s = f"{row['mean_seconds']:.1f}" if row["mean_seconds"] is not None else "never"
        its = f"{row['mean_iterations']:.1f}" if row["mean_iterations"] is not None else "-"
        seeds = ", ".join("never" if x is None else f"{x:.1f}" for x in row["seconds"])
        print(f"{row['name']:<24}{row['reached']:>5}/{row['runs']:<3}{s:>16}{its:>7}{row['seconds_per_iteration']:>8.3f}"
              f"  {seeds}")


if __name__ == "__main__":
    main()
