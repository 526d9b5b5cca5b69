"""``rayppo bench --workload smollm2-distill [--compare trl]``: on-policy distillation, seconds per
step and learning per step, side by side with TRL's ``DistillationTrainer``.

The workload is the distillation recipe (``examples/distill_arithmetic.yaml``, docs/distillation.md)
with the workload's overrides on top: the student is SmolLM2-135M-Instruct, the teacher the same
model after the GRPO recipe (``examples/arithmetic.yaml``, 20 iterations), trained once into
rayppo's cache unless ``distill.teacher=RUN`` is given. The steps:

1. rayppo: W + M iterations of the distributed system (``stop.iterations`` = W + M, so a decaying
   learning rate ends where TRL's does); each iteration timed from outside, around the trainer's
   ``iteration()`` call; the prompts of every iteration recorded; the student saved.
2. TRL (``--compare trl``): ``trl_distill.py`` in TRL 1.16's environment, one optimiser step per
   rayppo iteration on the same prompts in the same order, the same number of responses,
   learning rate, schedule and temperature; each step timed by a callback; the student saved.
3. Learning per step: the start, the teacher and both students after the same number of steps on
   the same 128 held-out problems, greedy, by one sampler (transformers', ``held_out_pass_rate``),
   so the comparison does not depend on either side's generator.

Writes ``DIR/bench.json`` and prints a table: median and spread of the measured steps' seconds,
generated tokens per step, and the held-out greedy pass rates.
"""

from __future__ import annotations

import dataclasses
import json
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

from bench_child import run_child
from bench_trl_venv import TRL_GRPO, TrlVenv, choose_trl_venv, ensure_trl_venv

from rayppo.config.load import load_config
from rayppo.config.schema import Config
from rayppo.errors import RayppoError
from rayppo.models.paths import cache_root

HERE = Path(__file__).resolve().parent
RECIPE = HERE.parent / "examples" / "distill_arithmetic.yaml"
"""The distillation recipe the workload runs (its overrides on top)."""
TEACHER_RECIPE = HERE.parent / "examples" / "arithmetic.yaml"
"""How the default teacher is made: this GRPO recipe's 20 iterations from the same start."""


def teacher_run(overrides: list[str]) -> tuple[Path, list[str]]:
    """The teacher's run folder and the overrides without it: ``distill.teacher=...`` when given,
    else the GRPO recipe's run in rayppo's cache, trained here the first time (about 8 minutes on
    2 cores; its output in the cache folder's ``train.log``)."""
    from rayppo.console import console

    given = [o for o in overrides if o.startswith("distill.teacher=")]
    rest = [o for o in overrides if not o.startswith("distill.teacher=")]
    if given:
        return Path(given[-1].split("=", 1)[1]), rest
    folder = cache_root() / "bench" / "distill-teacher"
    if not (folder / "policy" / "config.json").is_file():
        log = folder.parent / "distill-teacher-train.log"
        folder.parent.mkdir(parents=True, exist_ok=True)
        console.phase(f"the teacher, once: rayppo train --config {TEACHER_RECIPE.name} into {folder} (its output: {log})")
        with log.open("w") as out:
            done = subprocess.run([sys.executable, "-m", "rayppo.cli", "train", "--no-progress", "--config",
                                   str(TEACHER_RECIPE), f"output.dir={folder}", "output.overwrite=true"],
                                  stdout=out, stderr=subprocess.STDOUT)
        if done.returncode:
            raise RayppoError(f"training the distillation teacher failed (exit {done.returncode}); see {log}")
    return folder, rest


def distill_config(workload_config: dict[str, Any], teacher: Path, out: Path, steps: int, overrides: list[str]) -> Config:
    """The recipe with the workload's and the user's overrides, ``steps`` iterations, no evaluation
    during the timed run (the bench evaluates the saved students itself)."""
    settings = [f"{k}={v}" for k, v in workload_config.items()]
    # stop.iterations last: the steps are --warmup + --iters, the schedule's horizon on both sides.
    return load_config(RECIPE, [f"distill.teacher={teacher}", *settings, "eval.every=0", "output.tensorboard=false",
                                "output.save_model=false", f"output.dir={out / 'rayppo'}", "output.overwrite=true",
                                *overrides, f"stop.iterations={steps}"])


def check_like_for_like(cfg: Config) -> None:
    """Refuse what TRL's side cannot be given the same (``--compare trl``): transformers' schedules
    warm up from 0 (i / w, rayppo (i + 1) / (w + 1)) and decay to 0."""
    p = cfg.ppo
    if p.lr_warmup or p.lr_end:
        raise RayppoError(f"--compare trl: ppo.lr_warmup={p.lr_warmup}, ppo.lr_end={p.lr_end}: TRL's trainer is given "
                          "no warm-up and a decay to 0; set both to 0 to compare like for like")


def model_folders(cfg: Config) -> tuple[Path, Path]:
    """``(student, teacher)``: the folders ``model.policy`` and ``distill.teacher`` name (a run's
    folder means its ``policy/``), as the trainers resolve them."""
    from rayppo.models.loading import resolve_model_path
    from rayppo.models.teacher import teacher_folder

    m = cfg.model
    assert cfg.distill.teacher is not None  # distill_config sets it
    return resolve_model_path(m.policy, m.cache_dir), teacher_folder(cfg.distill.teacher, m.cache_dir)


def run_rayppo_distill(cfg: Config, steps: int, student_out: Path) -> tuple[list[dict[str, float]], list[list[str]]]:
    """``steps`` iterations of the distributed system, each timed around ``iteration()``; each
    iteration's wall seconds, stage-timer sum, generated tokens and reverse KL to the teacher, and
    its prompts (one per group). The student is saved to ``student_out/policy``."""
    from tqdm import tqdm

    from rayppo.trainers.choice import make_trainer

    n = cfg.rollout.samples_per_prompt
    trainer = make_trainer(cfg)
    steps_out, batches = [], []
    try:
        for _ in tqdm(range(steps), desc="rayppo distill", unit="it", file=sys.stderr):
            start = time.perf_counter()
            record = trainer.iteration()
            wall = time.perf_counter() - start
            rollout = trainer.last_rollout
            batches.append(rollout.prompt_text[::n])
            steps_out.append({"wall_s": wall, "stage_sum_s": record["time/iteration"],
                              "completion_tokens": float(sum(len(r) for r in rollout.response_ids)),
                              "reverse_kl": record.get("distill/reverse_kl_mean", float("nan"))})
        trainer.save(student_out)
    finally:
        trainer.close()
    return steps_out, batches


def run_trl_distill(cfg: Config, batches: list[list[str]], warmup: int, out: Path, venv: TrlVenv | None = None
                    ) -> dict[str, Any]:
    """``trl_distill.py`` in TRL 1.16's environment on rayppo's prompts (``batches``, in order);
    returns what it wrote (its student is saved to ``DIR/trl_student``)."""
    python = ensure_trl_venv(venv or choose_trl_venv(TRL_GRPO))
    r, p = cfg.rollout, cfg.ppo
    student, teacher = model_folders(cfg)
    spec = {"policy": str(student), "teacher": str(teacher), "prompt_batches": batches,
            "samples_per_prompt": r.samples_per_prompt, "max_new_tokens": r.max_new_tokens,
            "temperature": r.temperature, "ignore_eos": r.ignore_eos, "lr": p.lr, "lr_schedule": p.lr_schedule,
            "weight_decay": p.weight_decay, "max_grad_norm": p.max_grad_norm, "seed": cfg.seed,
            "gradient_checkpointing": cfg.learner.gradient_checkpointing, "bf16": cfg.model.dtype == "bfloat16",
            "warmup": warmup, "iterations": len(batches) - warmup, "output_dir": str(out / "trl_output"),
            "student_out": str(out / "trl_student")}
    (out / "trl_spec.json").write_text(json.dumps(spec))
    run_child("trl", "TRL's DistillationTrainer on the same prompts (trl_distill.py)",
               [str(python), str(HERE / "trl_distill.py"), "--spec", str(out / "trl_spec.json"),
                "--out", str(out / "trl.json")])
    return json.loads((out / "trl.json").read_text())


def held_out_pass_rate(cfg: Config, folder: str | Path) -> float:
    """Greedy pass rate of the model in ``folder`` on the recipe's held-out problems (the embedded
    task's test split), sampled by transformers at the recipe's response length and scored by its
    verifier: the same sampler and seeds for every model compared."""
    from rayppo.actors.generator import GeneratorActor, GeneratorEngine
    from rayppo.actors.reward import RewardEngine
    from rayppo.actors.settings import reward_scorer, sampling_settings
    from rayppo.data.prompts import load_prompt_set
    from rayppo.data.seeds import eval_seed
    from rayppo.models.loading import load_tokenizer
    from rayppo.trainers.evaluation import eval_metrics, eval_plan

    prompts = load_prompt_set(cfg.data.prompts, cfg.data.prompt_column, load_tokenizer(folder), sys.maxsize, "test")
    scorer = reward_scorer(cfg)
    assert scorer is not None, "the distillation recipe keeps its verifier (it measures)"
    sampler = GeneratorEngine(str(folder), sampling_settings(cfg), backend="hf", dtype=cfg.model.dtype,
                              actor=GeneratorActor(seed=cfg.seed))
    rollout = sampler.evaluate(prompts, 0.0, 1, eval_seed(cfg.seed))
    greedy_only = dataclasses.replace(eval_plan(cfg), greedy=True, samples=0)
    return eval_metrics(greedy_only, RewardEngine(scorer).scores(rollout), None)["eval/greedy/pass_rate"]


def side(steps: list[dict[str, float]], warmup: int, pass_rate: float) -> dict[str, Any]:
    """One side's figures: the median and spread of the steps after the first ``warmup``, their
    tokens, its held-out score."""
    walls = [s["wall_s"] for s in steps[warmup:]]
    return {"seconds_per_step_median": statistics.median(walls), "seconds_per_step_min": min(walls),
            "seconds_per_step_max": max(walls), "completion_tokens_per_step": statistics.mean(
                s["completion_tokens"] for s in steps[warmup:]),
            "held_out_greedy_pass_rate": pass_rate, "steps": steps}


def run(workload: Any, out: Path, compare: str | None, warmup: int, iterations: int, overrides: list[str]
        ) -> dict[str, Any]:
    """The whole comparison (module docstring); writes ``DIR/bench.json``."""
    teacher, overrides = teacher_run(overrides)
    steps = warmup + iterations
    cfg = distill_config(workload.config, teacher, out, steps, overrides)
    if compare == "trl":
        check_like_for_like(cfg)  # before anything runs
    mine, batches = run_rayppo_distill(cfg, steps, out / "rayppo_student")
    trl = run_trl_distill(cfg, batches, warmup, out) if compare == "trl" else None
    student, teacher_policy = model_folders(cfg)
    rates = {"start": held_out_pass_rate(cfg, student), "teacher": held_out_pass_rate(cfg, teacher_policy),
             "rayppo": held_out_pass_rate(cfg, out / "rayppo_student" / "policy")}
    if trl:
        rates["trl"] = held_out_pass_rate(cfg, out / "trl_student")
    summary: dict[str, Any] = {"workload": workload.name, "kind": "distill", "steps": steps, "warmup": warmup,
                               "teacher": str(teacher), "config": dataclasses.asdict(cfg.distill),
                               "start_pass_rate": rates["start"], "teacher_pass_rate": rates["teacher"],
                               "rayppo": side(mine, warmup, rates["rayppo"]), "prompt_batches": batches}
    if trl:
        trl_steps = [{"wall_s": s["wall_s"], "completion_tokens": s["completion_tokens"]} for s in trl["iterations"]]
        summary["trl"] = side(trl_steps, warmup, rates["trl"]) | {
            "trl_version": trl["trl_version"], "trainer": trl["trainer"], "threads": trl["threads"],
            "steps_taken": trl["steps"],
            "mixed_precision": trl["mixed_precision"]}
        summary["speedup_vs_trl"] = (summary["trl"]["seconds_per_step_median"]
                                     / summary["rayppo"]["seconds_per_step_median"])
        gained = {k: rates[k] - rates["start"] for k in ("rayppo", "trl")}
        summary["learning_vs_trl"] = gained["rayppo"] / gained["trl"] if gained["trl"] > 0 else None
    (out / "bench.json").write_text(json.dumps(summary, indent=1))
    print_distill(summary)
    print(f"\nwrote {out / 'bench.json'}")
    return summary


def print_distill(summary: dict[str, Any]) -> None:
    """The comparison as a table: seconds per step (median, range), tokens, held-out pass rates."""
    print(f"\n{summary['workload']}: {summary['steps']} steps ({summary['warmup']} warm-up); held-out greedy pass "
          f"rate: start {summary['start_pass_rate']:.3f}, teacher {summary['teacher_pass_rate']:.3f}")
    print(f"{'':8} {'s/step (median)':>16} {'range':>14} {'tokens/step':>12} {'pass rate after':>16}")
    for name in ("rayppo", "trl"):
        if name in summary:
            s = summary[name]
            print(f"{name:8} {s['seconds_per_step_median']:16.2f} {s['seconds_per_step_min']:6.2f}-"
                  f"{s['seconds_per_step_max']:<7.2f} {s['completion_tokens_per_step']:12.0f} "
                  f"{s['held_out_greedy_pass_rate']:16.3f}")
    if "speedup_vs_trl" in summary:
        learning = summary["learning_vs_trl"]
        print(f"rayppo {summary['speedup_vs_trl']:.2f}x TRL's speed per step; learning per step "
              + (f"{learning:.2f}x TRL's" if learning is not None else "(TRL's student did not improve)"))
