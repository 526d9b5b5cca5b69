"""The learner step of each estimator on the same rows, side by side: PPO-GAE against the
critic-free estimators (no critic forward, backward or optimiser step; no experience pass).

    python benchmarks/estimator_step.py [--workload small] [--repeats 2] [--estimators gae grpo ...]
        [section.field=value ...]

Each measurement is ``benchmarks/learner_step.py`` in a child process (one DeepSpeed rank, a
warm-up update, then the timed one) on the workload's rows in groups (default: the ``small``
shape as 32 prompts x 8 samples = 256 rows x 128 tokens). The estimators alternate, ``--repeats``
rounds, so that a slow spell of the machine hits each alike; the ratio is of the medians. Writes
``--out`` (JSON) and prints a table.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
GROUPS = ["rollout.batch_size=32", "rollout.samples_per_prompt=8"]


def measure(workload: str, estimator: str, overrides: list[str]) -> dict:
    """One ``learner_step.py`` run of ``estimator``; its JSON line."""
    cmd = [sys.executable, str(HERE / "learner_step.py"), "--workload", workload, *GROUPS, *overrides,
           f"ppo.advantage={estimator}"]
    out = subprocess.run(cmd, capture_output=True, text=True, check=True).stdout
    return json.loads(out.strip().splitlines()[-1])


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--workload", default="small")
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--estimators", nargs="+", default=["gae", "grpo"])
    parser.add_argument("--out", default="runs/estimator_step.json")
    parser.add_argument("overrides", nargs="*", help="section.field=value for every run")
    args = parser.parse_args(argv)
    runs: dict[str, list[dict]] = {e: [] for e in args.estimators}
    for _ in range(args.repeats):
        for estimator in args.estimators:
            runs[estimator].append(measure(args.workload, estimator, args.overrides))
            print(f"{estimator}: {runs[estimator][-1]['learn_s']} s", file=sys.stderr)
    base = statistics.median(r["learn_s"] for r in runs[args.estimators[0]])
    table = {e: {"learn_s": [r["learn_s"] for r in rs], "median_s": statistics.median(r["learn_s"] for r in rs),
                 "ratio": statistics.median(r["learn_s"] for r in rs) / base, "parts_s": rs[-1]["parts_s"],
                 "peak_rss_gib": rs[-1]["peak_rss_gib"], "rows": rs[-1]["rows"]} for e, rs in runs.items()}
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps({"workload": args.workload, "groups": GROUPS, "overrides": args.overrides,
                                          "estimators": table}, indent=1))
    print(f"{'estimator':<24}{'rows':>6}{'median s':>10}{'ratio':>8}{'peak RSS GiB':>14}")
    for e, row in table.items():
        print(f"{e:<24}{row['rows']:>6}{row['median_s']:>10.2f}{row['ratio']:>8.2f}{row['peak_rss_gib']:>14.2f}")


if __name__ == "__main__":
    main()
