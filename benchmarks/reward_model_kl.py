"""PPO on a learned reward model with and without the KL penalty: proxy (r_φ) and gold (the
verifier) against KL(π‖π_ref), several seeds (issue 51, item 4; docs/reward-models.md, "What the
KL term buys").

    python benchmarks/reward_model_kl.py --reward-model runs/rm/reward_model --out runs/rm-kl \\
        [--seeds 0 1] [--iterations 15] [--only NAME ...] [KEY=VALUE ...]

Each run is the recipe's third command (``rayppo train --config examples/reward-model.yaml
reward.function=null reward.model=RM model.critic=RM``: SmolLM2-135M-Instruct policy and
reference, r_φ served normalised, the critic started from r_φ, the verifier as the gold scorer
beside it) with the run's overrides, one after another in this process:

- ``kl 0.05``: the recipe's penalty, β = 0.05 per token on the reward.
- ``kl 0``: no penalty. The reference still loads, since a gold scorer is set: it measures the KL
  that the figure is drawn against, and nothing trains on it.

Writes ``DIR/reward_model_kl.json`` (per run and seed: each iteration's KL, proxy and gold batch
means, each evaluation's held-out proxy and gold, seconds per iteration) and
``DIR/reward_model_kl.png`` (one panel per run: proxy and gold against KL, one line per seed);
prints a table.
"""

from __future__ import annotations

import json
import statistics
import sys
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
from async_learning import learning_args, run_recipe  # noqa: E402

RECIPE = str(Path(__file__).resolve().parent.parent / "examples" / "reward-model.yaml")
RUNS = {"kl 0.05": ["ppo.kl_coef=0.05"], "kl 0": ["ppo.kl_coef=0"]}
SERIES = ("kl/ref_mean", "reward/mean", "reward/gold_mean")
"""Per iteration: KL(π‖π_ref) per response, the proxy's and the gold scorer's batch means."""
HELD = ("eval/reward/mean", "eval/gold/mean")


def run_one(name: str, overrides: list[str], out: Path, seed: int) -> dict[str, Any]:
    wall, records = run_recipe(RECIPE, name, overrides, out, seed)
    return {"name": name, "seed": seed, "overrides": overrides, "wall_s": wall,
            "seconds_per_iteration": statistics.fmean(r["time/iteration"] for r in records),
            "iterations": [{"iteration": r["iteration"], **{k: r[k] for k in SERIES}} for r in records],
            "evaluations": [{"iteration": r["iteration"], **{k: r[k] for k in HELD}, "kl/ref_mean": r["kl/ref_mean"]}
                            for r in records if all(k in r for k in HELD)]}


def plot(results: list[dict[str, Any]], path: Path) -> None:
    """One panel per run: proxy (left axis) and gold (right axis) against KL, a line per seed."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    names = list(dict.fromkeys(r["name"] for r in results))
    fig, axes = plt.subplots(1, len(names), figsize=(6 * len(names), 4), sharex=True, squeeze=False)
    for ax, name in zip(axes[0], names):
        gold_ax = ax.twinx()
        for r in (r for r in results if r["name"] == name):
            kl = [p["kl/ref_mean"] for p in r["iterations"]]
            ax.plot(kl, [p["reward/mean"] for p in r["iterations"]], ".-", color="tab:blue", alpha=0.7,
                    label=f"proxy r_φ, seed {r['seed']}")
            gold_ax.plot(kl, [p["reward/gold_mean"] for p in r["iterations"]], ".--", color="tab:orange", alpha=0.7,
                         label=f"gold, seed {r['seed']}")
        ax.set(title=f"PPO on r_φ, {name}", xlabel="KL(π‖π_ref), nats per response")
        ax.set_ylabel("proxy: normalised r_φ, batch mean", color="tab:blue")
        gold_ax.set_ylabel("gold: verifier pass rate, batch mean", color="tab:orange")
        ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


def table(results: list[dict[str, Any]]) -> list[str]:
    """Per run and seed: KL, proxy and gold at the first and last iteration, and the held-out pair."""
    lines = [f"{'run':<9}{'seed':>5}{'s / it':>8}   {'KL':>13}   {'proxy':>13}   {'gold':>13}   held-out proxy, gold"]
    for r in results:
        first, last = r["iterations"][0], r["iterations"][-1]
        held = ", ".join(f"{e['eval/reward/mean']:.2f}/{e['eval/gold/mean']:.2f}" for e in r["evaluations"])
        lines.append(f"{r['name']:<9}{r['seed']:>5}{r['seconds_per_iteration']:>8.1f}   "
                     + "   ".join(f"{first[k]:>5.2f} -> {last[k]:>5.2f}" for k in SERIES) + f"   {held}")
    return lines


def main(argv: list[str] | None = None) -> None:
    argv = list(sys.argv[1:] if argv is None else argv)
    if "--reward-model" not in argv:
        raise SystemExit("--reward-model DIR: the folder rayppo reward-model wrote (DIR/reward_model)")
    at = argv.index("--reward-model")
    model = argv[at + 1]
    del argv[at:at + 2]
    args = learning_args(argv, __doc__, RUNS, "runs/rm-kl", [0, 1], iterations=15)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    served = ["reward.function=null", f"reward.model={model}", f"model.critic={model}"]
    results = []
    for seed in args.seeds:  # seeds outermost: a slow spell of the machine hits both runs alike
        for name, run_overrides in RUNS.items():
            if args.only is None or name in args.only:
                results.append(run_one(name, [f"stop.iterations={args.iterations}", *served, *args.overrides,
                                              *run_overrides], out, seed))
                (out / "reward_model_kl.json").write_text(json.dumps(results, indent=1) + "\n")
    plot(results, out / "reward_model_kl.png")
    print("\n".join(table(results)))


if __name__ == "__main__":
    main()
