"""The default run over seeds, and the k1 shaping against the task reward that sets its beta.

Runs ``rayppo train seed=S`` (the embedded "say a digit" default) for each seed, with
``eval.samples=16`` so the held-out figure is a mean over 128 answers (sampling noise about
±0.02), and records per seed the training reward (mean of the last 5 iterations), the held-out
reward and the final KL. The first seed also saves its rollouts, from which the k1 shaping is
measured: per sampled response token x = log pi_ref(y_t) - log pi(y_t), so the token's shaped
reward is beta x. On the default task a right digit earns 1/max(L, 4) (1/8 in an 8-digit answer);
the largest x of a wrong digit must keep beta x below that, or the shaped return stops telling
right digits from wrong ones (docs/quickstart.md).

    python benchmarks/default_seeds.py --seeds 0 1 2 3 4 --out benchmarks/results/default_seeds.json

``tests/test_default_run.py`` holds the current defaults to this file: a changed default (beta, the
learning rate, the estimator, ...) fails the test until the seeds are measured again.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow.parquet as pq

from rayppo.config.load import load_config
from rayppo.config.schema import to_dict

DEFAULT_FIELDS = ("ppo.kl_coef", "ppo.kl_estimator", "ppo.kl_mode", "ppo.lr", "ppo.critic_lr", "ppo.advantage",
                  "ppo.epochs", "ppo.minibatches", "ppo.whiten_advantages", "ppo.entropy_coef", "ppo.lam",
                  "rollout.batch_size", "rollout.samples_per_prompt", "rollout.temperature", "stop.iterations")
"""The defaults the recorded figures depend on (compared with the current ones by the test)."""


def current_defaults() -> dict[str, Any]:
    """The fields of ``DEFAULT_FIELDS`` in today's default config."""
    config = to_dict(load_config(None, []))
    return {name: config[name.split(".")[0]][name.split(".")[1]] for name in DEFAULT_FIELDS}


def shaping(run: Path, beta: float) -> dict[str, float]:
    """Per-token k1 shaping over every saved iteration: x of the wrong and the right digits."""
    wrong: list[float] = []
    right: list[float] = []
    for path in sorted((run / "rollouts").glob("iter_*.parquet")):
        for row in pq.read_table(path).to_pylist():
            target = row["prompt_text"].split()[1]
            x = np.asarray(row["ref_logprobs"]) - np.asarray(row["logprobs"])
            for token, xt in zip(row["response_text"].split(), x):
                (right if token == target else wrong).append(float(xt))
    right_mean = float(np.mean(right))
    return {"beta": beta, "wrong_x_mean": float(np.mean(wrong)), "wrong_x_max": float(np.max(wrong)),
            "right_x_mean": right_mean,
            # x past which a wrong digit of an 8-digit answer is worth more than a right one
            "wrong_beats_right_past_x": (1 / 8 + beta * right_mean) / beta}


def run_seed(seed: int, out: Path, save_rollouts: bool) -> dict[str, Any]:
    folder = out / f"seed-{seed}"
    args = [sys.executable, "-m", "rayppo.cli", "train", "--no-progress", f"seed={seed}", "eval.samples=16",
            f"output.dir={folder}", "output.overwrite=true", f"output.save_rollouts={str(save_rollouts).lower()}"]
    print(" ".join(args[2:]), file=sys.stderr)
    subprocess.run(args, check=True, stdout=subprocess.DEVNULL)
    rows = [json.loads(line) for line in (folder / "metrics.jsonl").read_text().splitlines()]
    evals = [r["eval/reward/mean"] for r in rows if "eval/reward/mean" in r]
    return {"seed": seed, "reward_last5": float(np.mean([r["reward/mean"] for r in rows[-5:]])),
            "held_out": evals[-1], "kl_final": rows[-1]["kl/ref_mean"]}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2, 3, 4])
    parser.add_argument("--work", type=Path, default=Path("runs/default-seeds"), help="run folders")
    parser.add_argument("--out", type=Path, default=Path("benchmarks/results/default_seeds.json"))
    args = parser.parse_args()
    defaults = current_defaults()
    seeds = [run_seed(s, args.work, save_rollouts=(i == 0)) for i, s in enumerate(args.seeds)]
    result = {"command": "rayppo train seed=S eval.samples=16", "defaults": defaults, "seeds": seeds,
              "held_out_mean": float(np.mean([s["held_out"] for s in seeds])),
              "shaping": shaping(args.work / f"seed-{args.seeds[0]}", defaults["ppo.kl_coef"])}
    args.out.write_text(json.dumps(result, indent=1) + "\n")
    print(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
