"""A run resized while it runs (``rayppo scale``) against an uninterrupted run of the same seed.

Both are ``rayppo train`` on the embedded default (distributed trainer: vLLM generator, reference,
reward, 2 DeepSpeed ZeRO-2 ranks, fp32). The resized run is asked, each time a given number of
iterations is done, for another split (by default: 2 generators, then 1 learner rank, then back to
2 ranks and 1 generator); the driver takes each request after the iteration in flight. Reported per
resize: what changed, after which iteration, seconds from the request to the next completed
iteration, iterations lost; and per iteration the reward of both runs and their largest gap.

    python benchmarks/resize.py --iterations 8 --out runs/resize

Writes ``OUT/resize.json`` and prints it.
"""

from __future__ import annotations

import argparse
import json
import re
import subprocess
import sys
import time
from pathlib import Path

from rayppo.cli import main as rayppo

RESIZES = {1: ["generators.num=2"], 3: ["learner.num_ranks=1"], 5: ["learner.num_ranks=2", "generators.num=1"]}
"""Iterations done -> the split asked for then."""
COMPARED = ("policy/loss", "value/loss", "kl/ref_mean", "policy/approx_kl", "entropy")


def _train(out: Path, iterations: int) -> subprocess.Popen:
    args = [sys.executable, "-m", "rayppo.cli", "train", "--no-progress", f"stop.iterations={iterations}",
            "output.checkpoint_every=0", "output.save_model=false", "output.tensorboard=false", f"output.dir={out}"]
    return subprocess.Popen(args, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def _records(out: Path) -> list[dict[str, float]]:
    path = out / "metrics.jsonl"
    return [json.loads(line) for line in path.read_text().splitlines()] if path.is_file() else []


def _resized(out: Path, iterations: int) -> tuple[list[dict], list[dict]]:
    proc, resizes = _train(out, iterations), []
    for done, overrides in sorted(RESIZES.items()):
        while len(_records(out)) < done and proc.poll() is None:
            time.sleep(0.1)
        asked = time.time()
        rayppo(["scale", str(out), *overrides])
        while len(_records(out)) < done + 2 and proc.poll() is None:  # the iteration in flight, then one more
            time.sleep(0.1)
        resizes.append({"asked_after": done, "overrides": overrides,
                        "seconds_to_next_iteration": round(time.time() - asked, 1)})
    _, stderr = proc.communicate()
    if proc.returncode:
        raise SystemExit(f"the resized run failed:\n{stderr[-3000:]}")
    log = stderr + (out / "logs" / "driver.log").read_text()
    taken = [int(n) for n in re.findall(r"rayppo scale: .* after iteration (\d+)", log)]
    for resize, at in zip(resizes, taken):
        resize["taken_after_iteration"] = at
    return _records(out), resizes


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--iterations", type=int, default=8)
    parser.add_argument("--out", default="runs/resize")
    args = parser.parse_args()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    whole = _train(out / "whole", args.iterations)
    if whole.wait():
        raise SystemExit(f"the uninterrupted run failed:\n{whole.communicate()[1][-3000:]}")
    clean = _records(out / "whole")
    records, resizes = _resized(out / "resized", args.iterations)
    rewards = [[r["reward/mean"] for r in run] for run in (clean, records)]
    result = {
        "iterations": args.iterations, "resizes": resizes,
        "iterations_recorded": [r["iteration"] for r in records],  # each once: none lost, none twice
        "reward_uninterrupted": rewards[0], "reward_resized": rewards[1],
        "max_reward_gap": max(abs(a - b) for a, b in zip(*rewards)),
        # The update's own figures: another learner split sums its gradients in another order.
        "max_relative_gap": {key: max(abs(x[key] - y[key]) / max(abs(x[key]), abs(y[key]), 1e-12)
                                      for x, y in zip(clean, records)) for key in COMPARED},
    }
    (out / "resize.json").write_text(json.dumps(result, indent=1))
    print(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
