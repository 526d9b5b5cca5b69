"""Learner seconds per response token: long-tailed against fixed lengths, per pass layout.

    python benchmarks/learner_layouts.py [--workload small-varlen] [--repeats 3]
        [--layouts padded,right_padded,packed] [--out results.jsonl]

Runs ``learner_step.py`` (one PPO update of 256 rows, timed after a warm-up update) for every
(lengths, ``learner.packing``) pair, interleaved round by round so that a slow spell of a shared
machine hits every pair alike, and prints each pair's median seconds per 1k response tokens and
the long-tail / fixed ratio per layout (issue 26's goal: at most 1.15x). Long-tail lengths are
geometric with mean 34 cut at 128 (8,858 response tokens); fixed is 35 each (8,960).
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
from pathlib import Path

STEP = Path(__file__).resolve().parent / "learner_step.py"


def one_update(workload: str, lengths: str, layout: str) -> dict:
    """One ``learner_step.py`` run in a process of its own: its JSON line."""
    run = subprocess.run([sys.executable, str(STEP), "--workload", workload, "--lengths", lengths,
                          f"learner.packing={layout}"], capture_output=True, text=True, check=False)
    if run.returncode != 0:
        raise SystemExit(f"learner_step.py --lengths {lengths} learner.packing={layout} failed:\n{run.stderr[-2000:]}")
    return json.loads(run.stdout.strip().splitlines()[-1])


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--workload", default="small-varlen")
    parser.add_argument("--repeats", type=int, default=3, help="rounds; every pair runs once per round")
    parser.add_argument("--layouts", default="padded,right_padded,packed",
                        help="learner.packing values, comma-separated (packed: one row, attention per sequence on SDPA)")
    parser.add_argument("--out", type=Path, help="append every run's JSON line here")
    args = parser.parse_args()
    pairs = [(lengths, layout) for layout in args.layouts.split(",") for lengths in ("long-tail", "fixed:35")]
    seconds: dict[tuple[str, str], list[float]] = {pair: [] for pair in pairs}
    for round_ in range(args.repeats):
        for lengths, layout in pairs:
            record = one_update(args.workload, lengths, layout)
            seconds[(lengths, layout)].append(record["s_per_1k_response_tokens"])
            print(f"round {round_ + 1}/{args.repeats}: {lengths:9} {layout:12} {record['s_per_1k_response_tokens']:.2f} "
                  f"s per 1k tokens, {record['passes']} passes, matmul {record['matmul_gflop_per_s']:.0f} GFLOP/s",
                  file=sys.stderr, flush=True)
            if args.out:
                with args.out.open("a") as f:
                    f.write(json.dumps(record | {"round": round_}) + "\n")
    median = {pair: statistics.median(values) for pair, values in seconds.items()}
    summary = {"workload": args.workload, "repeats": args.repeats,
               "s_per_1k_response_tokens": {f"{lengths} {layout}": round(m, 3) for (lengths, layout), m in median.items()},
               "long_tail_over_fixed": {layout: round(median[("long-tail", layout)] / median[("fixed:35", layout)], 3)
                                        for layout in args.layouts.split(",")}}
    print(json.dumps(summary))
    return 0


if __name__ == "__main__":
    sys.exit(main())
