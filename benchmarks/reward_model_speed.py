"""Reward-model training speed, rayppo against TRL's ``RewardTrainer``, on the same pairs.

    python benchmarks/reward_model_speed.py [--pairs runs/pairs.jsonl] --out runs/rm-speed \\
        model.policy=smollm2-135m-instruct model.dtype=bfloat16 preference.batch_pairs=32
    rayppo bench --workload smollm2-reward-model-bf16 --compare trl     # the same, as a workload

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
import random
import statistics
import subprocess
import sys
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

from bench_trl_venv import TRL_GRPO, choose_trl_venv, ensure_trl_venv, trl_environment  # noqa: E402

from rayppo.config.load import load_config  # noqa: E402
from rayppo.data.pairs import epoch_order  # noqa: E402
from rayppo.models.loading import resolve_model_path  # noqa: E402
from rayppo.models.reward_model import backbone_name  # noqa: E402
from rayppo.run.metrics import read_metrics  # noqa: E402
from rayppo.trainers.reward_model_trainer import prepared_pairs, train_reward_model  # noqa: E402


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--pairs", help="a pair file (rayppo pairs writes one); default: arithmetic_pairs()")
    parser.add_argument("--out", required=True, metavar="DIR")
    parser.add_argument("--warmup", type=int, default=2, help="steps left out of the medians")
    parser.add_argument("--steps", type=int, default=8, help="measured steps")
    parser.add_argument("--no-trl", action="store_true", help="rayppo's side alone")
    parser.add_argument("overrides", nargs="*", help="rayppo config overrides (model, dtype, batch_pairs, lr)")
    args = parser.parse_args()
    result = compare(Path(args.pairs) if args.pairs else None, Path(args.out), args.warmup, args.steps,
                     args.overrides, trl=not args.no_trl)
    print(summary_line(result))


def arithmetic_pairs(path: Path, n: int, seed: int = 0) -> Path:
    """``n`` pairs of the arithmetic task written to ``path``, without sampling a policy: the
    question as the prompt's text (a chat model reads it as the one user turn, as the task's
    message), chosen the right sum and rejected a wrong one, in the form the recipe's samples take
    ("47 + 38 = 85."). A speed benchmark needs their token shapes only."""
    from rayppo.tasks import arithmetic

    rng = random.Random(seed)
    rows = []
    for a, op, b in arithmetic.problems("train", n, seed):
        messages, columns = arithmetic.row(a, op, b)
        right = int(columns["answer"])
        wrong = right + rng.choice([-10, -2, -1, 1, 2, 10])
        rows.append({"prompt": messages[0]["content"], "chosen": f"{a} {op} {b} = {right}.", "rejected": f"{a} {op} {b} = {wrong}."})
    path.write_text("".join(json.dumps(r) + "\n" for r in rows), encoding="utf-8")
    return path


def compare(pairs: Path | None, out: Path, warmup: int, steps: int, overrides: list[str],
            trl: bool = True) -> dict[str, Any]:
    """rayppo's and (``trl``) TRL's step times on the first ``(warmup + steps) x batch_pairs`` pairs
    of ``pairs`` (None: ``arithmetic_pairs``), written to ``out/speed.json`` and returned."""
    out.mkdir(parents=True, exist_ok=True)
    total = warmup + steps
    batch = load_config(None, overrides).preference.batch_pairs
    subset = out / "pairs.jsonl"
    if pairs is None:
        arithmetic_pairs(subset, total * batch)
    else:
        lines = pairs.read_text(encoding="utf-8").splitlines()[:total * batch]
        if len(lines) < total * batch:
            raise SystemExit(f"{pairs} has {len(lines)} pairs; {total} steps of {batch} need {total * batch}")
        subset.write_text("\n".join(lines) + "\n", encoding="utf-8")
    cfg = load_config(None, [f"preference.pairs={subset}", f"output.dir={out / 'rayppo'}", "output.overwrite=true",
                             "trainer=reference", "learner.num_ranks=1", "preference.held_out=0", "preference.epochs=1",
                             "output.checkpoint_every=0", "output.tensorboard=false", *overrides])
    rayppo_steps = [r["rm/step_s"] for r in read_metrics(_rayppo(cfg) / "metrics.jsonl")][warmup:]
    result: dict[str, Any] = {
        "model": cfg.model.policy, "dtype": cfg.model.dtype, "batch_pairs": batch, "measured_steps": steps,
        "pairs": str(pairs) if pairs else "arithmetic_pairs", "rayppo_step_s": statistics.median(rayppo_steps),
        "rayppo_steps_s": rayppo_steps, "rayppo_pairs_per_s": batch / statistics.median(rayppo_steps)}
    if trl:
        trl_steps = _trl(cfg, out, total)[warmup:]
        result |= {"trl_step_s": statistics.median(trl_steps), "trl_steps_s": trl_steps,
                   "trl_pairs_per_s": batch / statistics.median(trl_steps), "trl_version": TRL_GRPO.trl}
        result["speedup_vs_trl"] = result["trl_step_s"] / result["rayppo_step_s"]
    (out / "speed.json").write_text(json.dumps(result, indent=1) + "\n")
    return result


def summary_line(result: dict[str, Any]) -> str:
    """One line: both sides' median step and the ratio."""
    line = (f"reward model, {result['batch_pairs']} pairs per step, {result['dtype']}: rayppo "
            f"{result['rayppo_step_s']:.2f} s/step ({result['rayppo_pairs_per_s']:.2f} pairs/s)")
    if "trl_step_s" in result:
        line += (f", TRL {result['trl_version']} RewardTrainer {result['trl_step_s']:.2f} s/step: "
                 f"{result['speedup_vs_trl']:.2f}x")
    return line + f" (median of {result['measured_steps']} steps)"


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
                    "--out", str(out / "trl.json")], check=True, env=trl_environment())
    return json.loads((out / "trl.json").read_text())["step_s"]


if __name__ == "__main__":
    main()
