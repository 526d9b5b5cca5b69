"""The arithmetic recipe synchronous vs asynchronous: held-out greedy pass rate against wall-clock
minutes, several seeds (issue 49, item 5; docs/real-model.md, "Synchronous or asynchronous").

    python benchmarks/arithmetic_async.py --out runs/arithmetic-async [--seeds 0 1 2]
        [--iterations 20] [--only NAME ...] [KEY=VALUE ...]

Each run is ``rayppo train --config examples/arithmetic.yaml`` (SmolLM2-135M-Instruct, GRPO,
bf16, held-out greedy pass rate at the start and every 5 iterations) with the run's overrides,
one after another in this process:

- ``sync``: the recipe as it is. The stages take turns and each uses both cores.
- ``async k=1``: ``rollout.max_staleness=1`` (the generator samples iteration t+1 with the weights
  of t-1 while the learner trains on t; rollout correction from the update's own forward), the
  learner's one rank pinned to the second core and the generator and verifier to the first, so
  the two stages overlap without sharing a core (2 ranks + the generator on 2 cores ran 7% slower).

Writes ``DIR/arithmetic_async.json`` (per run and seed: the wall clock of the whole run, each
evaluation's pass rate and the wall-clock seconds at which it was measured, seconds per iteration,
seconds until the greedy pass rate first reaches ``--target``) and ``DIR/arithmetic_async.png``
(pass rate against minutes and against iterations, the mean over the seeds); prints a table.
"""

from __future__ import annotations

import json
import statistics
import sys
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
from async_learning import learning_args, pinned_cores, run_recipe  # noqa: E402

RECIPE = str(Path(__file__).resolve().parent.parent / "examples" / "arithmetic.yaml")
RUNS = {
    "sync": ["rollout.max_staleness=0"],
    "async k=1": ["rollout.max_staleness=1", "learner.num_ranks=1", "learner.threads=1", "generators.threads=1"],
}
TARGET = 0.5
"""The held-out greedy pass rate issue 49 asks the recipe to reach."""
KEY = "eval/greedy/reward/mean"


def evaluations(records: list[dict[str, float]], startup: float) -> list[dict[str, float]]:
    """Each evaluation's ``(iteration, pass_rate, seconds)``: seconds of wall clock since the run
    began, its start-up plus every iteration and evaluation before and including this one."""
    points, elapsed = [], startup
    for r in records:
        if f"initial/{KEY}" in r:
            elapsed += r["initial/time/eval"]
            points.append({"iteration": 0, "pass_rate": r[f"initial/{KEY}"], "seconds": elapsed})
        elapsed += r["time/iteration"] + r.get("time/eval", 0.0)
        if KEY in r:
            points.append({"iteration": r["iteration"] + 1, "pass_rate": r[KEY], "seconds": elapsed})
    return points


def run_one(name: str, overrides: list[str], out: Path, seed: int) -> dict[str, Any]:
    wall, records = run_recipe(RECIPE, name, overrides, out, seed)
    counted = sum(r["time/iteration"] + r.get("time/eval", 0.0) + r.get("initial/time/eval", 0.0) for r in records)
    points = evaluations(records, startup=wall - counted)
    reached = next((p for p in points if p["pass_rate"] >= TARGET), None)
    return {"name": name, "seed": seed, "overrides": overrides, "wall_s": wall, "startup_s": wall - counted,
            "seconds_per_iteration": statistics.fmean(r["time/iteration"] for r in records),
            "evaluations": points, "seconds_to_target": reached and reached["seconds"],
            "iterations_to_target": reached and reached["iteration"],
            "reward_mean": [r["reward/mean"] for r in records]}


def mean_points(runs: list[dict[str, Any]]) -> tuple[list[int], list[float], list[float], list[float]]:
    """``(iterations, minutes, pass rate, its spread)`` per evaluation, the mean over the seeds."""
    length = min(len(r["evaluations"]) for r in runs)
    at = [[r["evaluations"][i] for r in runs] for i in range(length)]
    return ([p[0]["iteration"] for p in at], [statistics.fmean(q["seconds"] for q in p) / 60 for p in at],
            [statistics.fmean(q["pass_rate"] for q in p) for p in at],
            [statistics.pstdev(q["pass_rate"] for q in p) for p in at])


def plot(results: list[dict[str, Any]], path: Path) -> None:
    """Pass rate against minutes (left) and iterations (right), one line per run, ±1 std shaded."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 2, figsize=(10, 4), sharey=True)
    seeds = len({r["seed"] for r in results})
    for name in dict.fromkeys(r["name"] for r in results):
        its, minutes, rate, spread = mean_points([r for r in results if r["name"] == name])
        for ax, xs in zip(axes, (minutes, its)):
            line, = ax.plot(xs, rate, marker="o", label=name)
            ax.fill_between(xs, [y - d for y, d in zip(rate, spread)], [y + d for y, d in zip(rate, spread)],
                            color=line.get_color(), alpha=0.15, linewidth=0)
    for ax, label in zip(axes, ("minutes (wall clock, start-up and evaluations included)", "iteration")):
        ax.axhline(TARGET, color="grey", linewidth=0.8)
        ax.set(xlabel=label)
    axes[0].set(ylabel="held-out greedy pass rate", title=f"arithmetic recipe, mean of {seeds} seed(s)")
    axes[0].legend()
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


def table(results: list[dict[str, Any]]) -> list[str]:
    """One line per run name: mean wall clock, s/it, final pass rate, seeds reaching the target."""
    lines = [f"{'run':<12}{'wall s':>8}{'s / it':>8}{'final':>8}{'reached ' + str(TARGET):>14}  seconds to it per seed"]
    for name in dict.fromkeys(r["name"] for r in results):
        runs = [r for r in results if r["name"] == name]
        reached = ", ".join("never" if r["seconds_to_target"] is None else f"{r['seconds_to_target']:.0f}" for r in runs)
        lines.append(f"{name:<12}{statistics.fmean(r['wall_s'] for r in runs):>8.0f}"
                     f"{statistics.fmean(r['seconds_per_iteration'] for r in runs):>8.2f}"
                     f"{statistics.fmean(r['evaluations'][-1]['pass_rate'] for r in runs):>8.3f}"
                     f"{sum(r['seconds_to_target'] is not None for r in runs):>10}/{len(runs):<3}  {reached}")
    return lines


def main(argv: list[str] | None = None) -> None:
    args = learning_args(argv, __doc__, RUNS, "runs/arithmetic-async", [0, 1, 2], iterations=20)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    results = []
    for seed in args.seeds:  # seeds outermost: a slow spell of the machine hits both runs alike
        for name, run_overrides in RUNS.items():
            if args.only is None or name in args.only:
                pins = pinned_cores() if "rollout.max_staleness=1" in run_overrides else []
                results.append(run_one(name, [f"stop.iterations={args.iterations}"] + args.overrides + run_overrides
                                       + pins, out, seed))
                (out / "arithmetic_async.json").write_text(json.dumps(
                    {"recipe": "examples/arithmetic.yaml", "target": TARGET, "runs": results}, indent=1))
    plot(results, out / "arithmetic_async.png")
    print("\n".join(table(results)))


if __name__ == "__main__":
    main()
