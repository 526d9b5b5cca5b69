"""Reward-model training speed, rayppo against TRL's ``RewardTrainer``, on the same pairs.

    python benchmarks/reward_model_speed.py --pairs runs/pairs.jsonl --out runs/rm-speed \\
        model.policy=smollm2-135m-instruct model.dtype=bfloat16 preference.batch_pairs=32

Both sides train the same backbone on the same token sequences (rayppo's tokenisation of the
pair file, its first ``(warmup + steps) x preference.batch_pairs`` pairs in rayppo's epoch order),
one process each on the same cores, one after the other: rayppo's in-process learner rank
(``trainer=reference``: DeepSpeed ZeRO on one rank, as a one-rank group) and TRL 1.16's
``RewardTrainer`` in its own venv (``benchmarks/trl_reward.py``). Writes ``DIR/speed.json``:
each side's median seconds per optimiser step after the warm-up steps, pairs per second, and
rayppo's speed-up (TRL's step time over rayppo's).
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

from bench_trl_venv import TRL_GRPO, choose_trl_venv, ensure_trl_venv  # noqa: E402

from rayppo.config.load import load_config  # noqa: E402
from rayppo.data.pairs import epoch_order  # noqa: E402
from rayppo.models.loading import resolve_model_path  # noqa: E402
from rayppo.models.reward_model import backbone_name  # noqa: E402
from rayppo.run.metrics import read_metrics  # noqa: E402
from rayppo.trainers.reward_model import prepared_pairs, train_reward_model  # noqa: E402


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--pairs", required=True, help="a pair file (rayppo pairs writes one)")
    parser.add_argument("--out", required=True, metavar="DIR")
    parser.add_argument("--warmup", type=int, default=2, help="steps left out of the medians")
    parser.add_argument("--steps", type=int, default=8, help="measured steps")
    parser.add_argument("overrides", nargs="*", help="rayppo config overrides (model, dtype, batch_pairs, lr)")
    args = parser.parse_args()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    steps = args.warmup + args.steps
    base = load_config(None, [f"preference.pairs={args.pairs}", *args.overrides])
    first = steps * base.preference.batch_pairs
    subset = out / "pairs.jsonl"
    lines = Path(args.pairs).read_text(encoding="utf-8").splitlines()[:first]
    if len(lines) < first:
        raise SystemExit(f"{args.pairs} has {len(lines)} pairs; {steps} steps of {base.preference.batch_pairs} need {first}")
    subset.write_text("\n".join(lines) + "\n", encoding="utf-8")
    cfg = load_config(None, [f"preference.pairs={subset}", f"output.dir={out / 'rayppo'}", "output.overwrite=true",
                             "trainer=reference", "learner.num_ranks=1", "preference.held_out=0", "preference.epochs=1",
                             "output.checkpoint_every=0", *args.overrides])
    rayppo_steps = [r["rm/step_s"] for r in read_metrics(_rayppo(cfg) / "metrics.jsonl")][args.warmup:]
    trl_steps = _trl(cfg, out, steps)[args.warmup:]
    pairs = cfg.preference.batch_pairs
    result = {"model": cfg.model.policy, "dtype": cfg.model.dtype, "batch_pairs": pairs, "measured_steps": args.steps,
              "rayppo_step_s": statistics.median(rayppo_steps), "trl_step_s": statistics.median(trl_steps),
              "rayppo_steps_s": rayppo_steps, "trl_steps_s": trl_steps}
    result["rayppo_pairs_per_s"] = pairs / result["rayppo_step_s"]
    result["trl_pairs_per_s"] = pairs / result["trl_step_s"]
    result["speedup_vs_trl"] = result["trl_step_s"] / result["rayppo_step_s"]
    (out / "speed.json").write_text(json.dumps(result, indent=1) + "\n")
    print(f"reward model, {pairs} pairs per step, {cfg.model.dtype}: rayppo {result['rayppo_step_s']:.2f} s/step, "
          f"TRL {result['trl_step_s']:.2f} s/step: {result['speedup_vs_trl']:.2f}x (median of {args.steps} steps)")


def _rayppo(cfg) -> Path:
    train_reward_model(cfg, progress=False)
    return Path(cfg.output.dir)


def _trl(cfg, out: Path, steps: int) -> list[float]:
    """TRL's step times on the pairs rayppo trained on, in the order it trained them."""
    pairs, tokens = prepared_pairs(cfg)
    order = epoch_order(list(range(len(pairs))), 0, cfg.seed)
    spec = {"model": str(resolve_model_path(backbone_name(cfg), cfg.model.cache_dir)),
            "chosen_ids": [tokens.chosen[i] for i in order], "rejected_ids": [tokens.rejected[i] for i in order],
            "batch_pairs": cfg.preference.batch_pairs, "lr": cfg.preference.lr, "steps": steps,
            "max_grad_norm": cfg.ppo.max_grad_norm, "bf16": cfg.model.dtype == "bfloat16", "work_dir": str(out / "trl")}
    (out / "trl_spec.json").write_text(json.dumps(spec))
    python = ensure_trl_venv(choose_trl_venv(TRL_GRPO))
    subprocess.run([str(python), str(HERE / "trl_reward.py"), "--spec", str(out / "trl_spec.json"),
                    "--out", str(out / "trl.json")], check=True)
    return json.loads((out / "trl.json").read_text())["step_s"]


if __name__ == "__main__":
    main()
