"""``rayppo bench``: throughput of the real system on a named workload, side by side with TRL.

For a workload of ``benchmarks/workloads.yaml`` it runs W warm-up and M measured iterations of
the distributed system (Ray + vLLM + DeepSpeed), then, in the same invocation:

- each stage alone, in a child process, on the same batch (vLLM generation, one reference pass, one
  reward pass, one learner step): ``overhead_ratio = iteration / (generate + max(reference,
  reward) + learn)``, everything above 1.0 being orchestration, serialization and sync;
- with ``--compare trl``, TRL on the identical workload in its own virtual environment, created on
  first use beside the repository (a repository folder that is not writable puts it in rayppo's
  cache): TRL 1.12's PPO for ``ppo.advantage=gae`` in ``.venv-trl`` (``RAYPPO_TRL_VENV`` names
  another), TRL 1.16's GRPO for ``grpo`` in ``.venv-trl-1.16`` (``RAYPPO_TRL_GRPO_VENV``).

A ``distill`` workload (on-policy distillation against TRL 1.16's ``DistillationTrainer``, seconds
and learning per step) runs ``distill_bench.py`` instead; a ``reward-model`` one
``reward_model_speed.py``.

Writes ``DIR/bench.json``, ``DIR/stages.png`` and, for sweeps, ``DIR/sweep.json`` and
``DIR/sweep.png``; prints a table.
"""

from __future__ import annotations

import hashlib
import itertools
import json
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import yaml

from rayppo.cluster.address import machine_cores
from rayppo.config.derived import has_critic, role_threads, uses_reference
from rayppo.config.load import load_config
from rayppo.config.schema import Config, to_dict
from rayppo.errors import RayppoError
from rayppo.models.paths import cache_root

# The report and TRL's environment are modules beside this one (benchmarks/ is not a package).
sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_child import run_child  # noqa: E402
from bench_report import plot_stages, plot_sweep, print_sweep, print_table, summarize  # noqa: E402
from bench_trl_venv import (  # noqa: E402,F401
    TRL_GRPO,
    TRL_PPO,
    TrlPins,
    TrlVenv,
    choose_trl_venv,
    clear_leftovers,
    ensure_trl_venv,
    install_line,
    trl_environment,
    venv_state,
)

HERE = Path(__file__).resolve().parent
TRL_SCRIPTS: dict[str, tuple[str, TrlPins]] = {"gae": ("trl_ppo.py", TRL_PPO), "grpo": ("trl_grpo.py", TRL_GRPO)}
"""The TRL trainer compared for each ``ppo.advantage`` (``--compare trl``), and the environment it
runs in: PPO in TRL 1.12 (the last release with its value-head ``PPOTrainer``), GRPO in 1.16."""


@dataclass
class Workload:
    name: str
    description: str
    model: str | dict[str, int]
    config: dict[str, Any]
    warmup: int
    iterations: int
    kind: str = "ppo"
    """``ppo``: a PPO/GRPO iteration of the whole system; ``reward-model``: a Bradley–Terry step of
    ``rayppo reward-model`` (``reward_model_speed.py``; warm-up and iterations are its steps);
    ``distill``: an iteration of on-policy distillation against TRL's ``DistillationTrainer``
    (``distill_bench.py``: the recipe with ``config`` on top; ``model`` is the student)."""


def load_workloads(path: Path = HERE / "workloads.yaml") -> dict[str, Workload]:
    raw = yaml.safe_load(path.read_text())
    return {name: Workload(name, w.get("description", ""), w["model"], w.get("config", {}),
                           int(w.get("warmup", 2)), int(w.get("iterations", 5)), w.get("kind", "ppo"))
            for name, w in raw.items()}


# ------------------------------------------------------------------------------------ models
def prepare_models(workload: Workload) -> tuple[Path, Path]:
    """(policy folder, reward-model folder) for a workload, built once and cached."""
    from rayppo.models.embedded import build_random_llama
    from rayppo.models.loading import resolve_model_path
    from rayppo.models.paths import built_on_first_use

    key = hashlib.sha1(json.dumps(workload.model, sort_keys=True).encode()).hexdigest()[:10]
    root = cache_root() / "bench" / f"{workload.name}-{key}"
    model = workload.model
    builtin = isinstance(model, str) and built_on_first_use(model)  # embedded, the real model
    policy = resolve_model_path(model) if isinstance(model, str) and builtin else root / "policy"
    if not builtin and not (policy / "config.json").is_file():
        assert isinstance(model, dict), f"workload {workload.name}: a model not built in is given by its shape"
        shape = dict(model)  # eos_mean_length, eos_length_cap: long-tailed lengths (add_stop_words)
        build_random_llama(policy, shape.pop("vocab_size"), **shape)
    reward_model = root / "reward_model"
    if not (reward_model / "config.json").is_file():
        _build_reward_model(policy, reward_model)
    return policy, reward_model


def _build_reward_model(policy: Path, out: Path) -> None:
    """A random-init one-label model of the policy's shape, with the policy's tokenizer."""
    from transformers import AutoConfig, AutoTokenizer, LlamaForSequenceClassification

    config = AutoConfig.from_pretrained(policy)
    config.num_labels = 1
    torch.manual_seed(1)
    LlamaForSequenceClassification(config).save_pretrained(out)
    AutoTokenizer.from_pretrained(policy).save_pretrained(out)


def workload_config(workload: Workload, policy: Path, reward_model: Path, extra: list[str]) -> Config:
    overrides = [f"{k}={v}" for k, v in workload.config.items()]
    overrides += [f"model.policy={policy}", "reward.function=null", f"reward.model={reward_model}",
                  "output.tensorboard=false", "output.save_model=false"]
    return load_config(None, overrides + extra)


# ------------------------------------------------------------------------------- measurement
def run_rayppo(cfg: Config, warmup: int, iterations: int, label: str = "rayppo"
               ) -> tuple[list[dict[str, float]], dict[str, int], Any]:
    """W warm-up + M measured iterations of the distributed system; also peak memory per role.
    One progress bar for the run (the actors' output is in the run's logs/, as for train)."""
    from tqdm import tqdm

    from rayppo.trainers.choice import make_trainer

    trainer = make_trainer(cfg)
    bar = tqdm(total=warmup + iterations, desc=label, unit="it", file=sys.stderr, dynamic_ncols=True)
    try:
        records = []
        for i in range(warmup + iterations):
            record = trainer.iteration()
            if i >= warmup:
                records.append(record)
            bar.set_postfix({"phase": "warm-up" if i < warmup else "measured",
                             "s/it": f"{record['time/iteration']:.2f}"}, refresh=False)
            bar.update()
        return records, trainer.peak_memory(), trainer.last_rollout
    finally:
        bar.close()
        trainer.close()


def machine_rate(cfg: Config) -> dict[str, Any]:
    """The rate MFU is measured against, at the start (nothing else computing): GFLOP/s of the
    matmul the policy runs most (``rayppo.machine.matmul_rate.peak_rate``'s shape), in the workload's dtype,
    on the learner's threads, or its GPU with ``learner.gpus_per_rank`` > 0."""
    from rayppo.models.shape import read_shape
    from rayppo.run.mfu import probe_tokens

    policy = read_shape(cfg.model.policy)
    lr = cfg.learner
    threads = lr.num_ranks * role_threads(cfg, "learner", machine_cores(cfg.cluster.address))
    device = "cuda" if lr.gpus_per_rank > 0 and torch.cuda.is_available() else "cpu"
    m, k, n = probe_tokens(cfg), policy.hidden, policy.intermediate
    shape = [m, k, n]
    return {"matmul_gflop_per_s": matmul_gflop_per_s(m, k, n, cfg.model.dtype, threads, device=device),
            "matmul_shape": shape, "matmul_threads": threads, "matmul_device": device, "matmul_dtype": cfg.model.dtype}


def learn_arithmetic(cfg: Config, rollout, rate: dict[str, Any]) -> dict[str, Any]:
    """Each stage's useful FLOPs for this rollout (``rayppo.plan.flops``: ``stage_gflop``, the
    learner's also as ``learn_gflop``) beside the measured ``rate`` (``machine_rate``)."""
    from rayppo.models.shape import read_shape
    from rayppo.plan.flops import LearnPasses, learn_flops
    from rayppo.run.mfu import StageCounter, rollout_sequences

    policy = read_shape(cfg.model.policy)
    critic = read_shape(cfg.model.critic or cfg.model.policy) if has_critic(cfg.ppo) else None
    seq = rollout_sequences(rollout)
    # Asynchronous mode's learner also recomputes log pi_prox (one policy forward per row).
    lockstep, proximal = (learn_flops(policy, critic, seq, LearnPasses(cfg.ppo.epochs, cfg.ppo.minibatches, proximal=p,
                                                                       lora=cfg.learner.lora_rank > 0))
                          for p in (False, True))
    stages = StageCounter.of(cfg).flops(seq).as_dict()
    return rate | {"learn_gflop": stages["learn"] / 1e9, "stage_gflop": {k: v / 1e9 for k, v in stages.items()},
                   "proximal_flops_ratio": proximal / lockstep}


def matmul_gflop_per_s(m: int, k: int, n: int, dtype: str, threads: int, device: str = "cpu") -> float:
    """GFLOP/s of an ``[m, k] x [k, n]`` matmul on ``threads`` torch threads
    (``rayppo.machine.matmul_rate.matmul_flops_per_s``: the fastest of timed calls after a warm-up)."""
    from rayppo.machine.matmul_rate import Probe, matmul_flops_per_s

    return matmul_flops_per_s(m, k, n, Probe(dtype, threads, device)) / 1e9


def plan_estimate(cfg: Config, rollout) -> dict[str, int]:
    """``rayppo plan``'s peak-RSS estimate per role, for the longest prompt actually sampled."""
    from rayppo.plan.footprint import estimate_roles

    longest = max(len(p) for p in rollout.prompt_ids)
    return {role: int(e.rss) for role, e in estimate_roles(cfg, prompt_tokens=longest).items()}


def _timed(fn, *args) -> tuple[float, Any]:
    start = time.perf_counter()
    out = fn(*args)
    return time.perf_counter() - start, out


def stages_alone(cfg: Config, rollout) -> dict[str, float]:
    """Each stage once on the measured batch, in a fresh child process.

    A child, because vLLM and DeepSpeed keep their memory until the process exits (~11 GiB on
    ``small``), and TRL runs next on the same machine.
    """
    with tempfile.TemporaryDirectory(prefix="rayppo-alone-") as tmp:
        work = Path(tmp)
        (work / "config.yaml").write_text(yaml.safe_dump(to_dict(cfg)))
        rollout.write_parquet(work / "rollout.parquet")
        run_child("stages-alone", "each stage alone on the measured batch, in a child process",
                   [sys.executable, __file__, "--stages-alone", str(work)])
        return json.loads((work / "alone.json").read_text())


def _stages_alone_here(cfg: Config, rollout) -> dict[str, float]:
    """Each stage once, in this process, with the role's total threads.

    Each engine runs one warm-up call first, as it did in the measured run.
    """
    from rayppo.actors.generator import GeneratorActor, GeneratorEngine
    from rayppo.actors.reference import ReferenceEngine
    from rayppo.actors.reward import RewardEngine
    from rayppo.actors.settings import reward_scorer, sampling_settings
    from rayppo.cluster.learner_group import LearnerGroup
    from rayppo.cluster.roles import vllm_settings
    from rayppo.data.prompts import PromptBatch

    g, m, lr = cfg.generators, cfg.model, cfg.learner
    cores = machine_cores(cfg.cluster.address)  # the threads each role ran on in the run (config.derived.role_threads)
    threads = {"gen": g.num * role_threads(cfg, "generators", cores), "learn": lr.num_ranks * role_threads(cfg, "learner", cores)}
    prompts = PromptBatch(rollout.prompt_text, rollout.prompt_ids)
    out: dict[str, float] = {}
    # The generator goes last: vLLM's CPU worker pins this process's threads and from then on
    # ignores torch.set_num_threads, which gave the reference and reward passes (1 thread each in
    # the run) the generator's 2 threads here and halved their "alone" times.
    torch.set_num_threads(cfg.reference.num * role_threads(cfg, "reference", cores))
    out["reference"] = 0.0  # none at ppo.kl_coef = 0
    if uses_reference(cfg):
        reference = ReferenceEngine(m.reference or m.policy, cfg.rollout.temperature, 64, m.dtype,
                                    micro_batch_tokens=cfg.reference.micro_batch_tokens)
        reference.ref_logprobs(rollout)
        out["reference"], _ = _timed(reference.ref_logprobs, rollout)
        del reference
    torch.set_num_threads(cfg.reward.num * role_threads(cfg, "reward", cores))
    scorer = reward_scorer(cfg)
    assert scorer is not None, "the bench's workloads have a reward function or model"
    reward = RewardEngine(scorer)
    reward.scores(rollout)
    out["reward"], _ = _timed(reward.scores, rollout)
    del reward
    torch.set_num_threads(threads["learn"])
    # The recorded rollout was sampled by the measured run's later policy, not by this fresh
    # learner's weights: only the update's time counts here, so the mismatch limit is lifted.
    cfg.checks.max_logprob_mismatch = cfg.checks.max_logprob_kl = float("inf")
    learner = LearnerGroup(cfg, placement=None)
    rollout.policy_version = [0] * len(rollout)
    learner.train(rollout, cfg.ppo.kl_coef, 0)
    rollout.policy_version = [1] * len(rollout)
    out["learn"], _ = _timed(learner.train, rollout, cfg.ppo.kl_coef, 1)
    del learner
    torch.set_num_threads(threads["gen"])
    generator = GeneratorEngine(m.policy, sampling_settings(cfg), g.backend, m.dtype,
                                actor=GeneratorActor(index=0, seed=cfg.seed, vllm=vllm_settings(cfg)))
    generator.generate(prompts, 0)
    out["generate"], _ = _timed(generator.generate, prompts, 1)
    return out


def run_trl(cfg: Config, rollout, warmup: int, iterations: int, out_dir: Path,
            venv: TrlVenv | None = None) -> dict[str, Any]:
    """TRL on the same workload, timed per iteration, in its own environment (``ensure_trl_venv``):
    TRL 1.12's PPO for ``ppo.advantage=gae`` (``trl_ppo.py``), TRL 1.16's GRPO for ``grpo``
    (``trl_grpo.py``). Returns what the script wrote: ``trl_version`` and the ``iterations``."""
    if cfg.ppo.advantage not in TRL_SCRIPTS:
        raise RayppoError(f"--compare trl: no TRL trainer is compared for ppo.advantage={cfg.ppo.advantage} "
                          f"(compared: {', '.join(TRL_SCRIPTS)})")
    script, pins = TRL_SCRIPTS[cfg.ppo.advantage]
    python = ensure_trl_venv(venv or choose_trl_venv(pins))
    n = cfg.rollout.samples_per_prompt
    spec = {"policy": cfg.model.policy, "reward_model": cfg.reward.model, "prompts": rollout.prompt_text[::n],
            "num_generations": n, "clip_eps": cfg.ppo.clip_eps,
            "batch_size": cfg.rollout.batch_size, "epochs": cfg.ppo.epochs, "minibatches": cfg.ppo.minibatches,
            "max_new_tokens": cfg.rollout.max_new_tokens, "temperature": cfg.rollout.temperature,
            "ignore_eos": cfg.rollout.ignore_eos,
            "lr": cfg.ppo.lr, "kl_coef": cfg.ppo.kl_coef, "warmup": warmup, "iterations": iterations,
            # TRL's PPOConfig turns gradient checkpointing on by default; run both sides alike.
            "gradient_checkpointing": cfg.learner.gradient_checkpointing,
            # bf16 workloads: TRL trains fp32 weights under bf16 autocast, its frozen models in bf16.
            "bf16": cfg.model.dtype == "bfloat16",
            "output_dir": str(out_dir / "trl_output")}
    (out_dir / "trl_spec.json").write_text(json.dumps(spec))
    run_child("trl", f"TRL on the same workload ({script})", [str(python), str(HERE / script), "--spec",
                                                                 str(out_dir / "trl_spec.json"), "--out",
                                                                 str(out_dir / "trl.json")])
    return json.loads((out_dir / "trl.json").read_text())


def sweep_points(specs: list[str]) -> list[dict[str, str]]:
    """``["generators.num=1,2", "learner.num_ranks=1,2"]`` -> the 4 combinations. Keys that move
    together are joined by ``:`` with their values: ``learner.num_ranks:learner.threads=1:2,2:1`` is
    two points (1 rank of 2 threads, 2 ranks of 1), the layouts of a machine's cores."""
    axes = []
    for spec in specs:
        if "=" not in spec:
            raise ValueError(f"--sweep {spec!r}: expected key=v1,v2,... or key1:key2=a1:a2,b1:b2")
        keys, values = spec.split("=", 1)
        names = keys.split(":")
        axis = []
        for value in values.split(","):
            parts = value.split(":")
            if len(parts) != len(names):
                raise ValueError(f"--sweep {spec!r}: {value!r} has {len(parts)} values for {len(names)} keys")
            axis.append(tuple(zip(names, parts)))
        axes.append(axis)
    return [dict(pair for group in combo for pair in group) for combo in itertools.product(*axes)]


def run(workload_name: str, out_dir: str, compare: str | None, warmup: int | None, iterations: int | None,
        sweep: list[str], overrides: list[str], skip_alone: bool = False) -> dict[str, Any]:
    workloads = load_workloads()
    if workload_name not in workloads:
        raise ValueError(f"--workload: unknown {workload_name!r} (known: {', '.join(workloads)})")
    w = workloads[workload_name]
    warmup = w.warmup if warmup is None else warmup
    iterations = w.iterations if iterations is None else iterations
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    from rayppo.console import console

    console.phase(f"rayppo bench {w.name}: {w.description}; {warmup} warm-up + {iterations} measured iterations"
                  + (f" per point of {' x '.join(sweep)}" if sweep else "") + f"; output {out}/")
    if w.kind == "reward-model":
        return run_reward_model(w, out, compare, warmup, iterations, sweep, overrides)
    if w.kind == "distill":
        if sweep:
            raise RayppoError(f"--sweep: not for a distillation workload ({w.name}); pass the overrides instead")
        import distill_bench

        return distill_bench.run(w, out, compare, warmup, iterations, [f"model.policy={w.model}", *overrides])
    policy, reward_model = prepare_models(w)
    overrides = [f"output.dir={out}", *overrides]  # the runs' placement.json and logs/ go with bench.json
    if sweep:
        points = []
        for point in sweep_points(sweep):
            cfg = workload_config(w, policy, reward_model, overrides + [f"{k}={v}" for k, v in point.items()])
            label = " ".join(f"{k}={v}" for k, v in point.items())
            rate = machine_rate(cfg)
            records, memory, rollout = run_rayppo(cfg, warmup, iterations, label)
            points.append({"point": point, **summarize(w.name, cfg, records, memory, None, None,
                                                       plan_estimate(cfg, rollout), learn_arithmetic(cfg, rollout, rate),
                                                       rollout)})
            print_table(points[-1])
        for p in points:  # side by side, one run: each point against the first
            p["speedup_vs_first"] = p["end_to_end_tokens_per_s"] / points[0]["end_to_end_tokens_per_s"]
        (out / "sweep.json").write_text("\n".join(json.dumps(p) for p in points) + "\n")
        summary = {"workload": w.name, "overrides": overrides, "points": points}
        (out / "bench.json").write_text(json.dumps(summary, indent=1))
        plot_sweep(points, out / "sweep.png")
        print_sweep(points)
        return summary
    cfg = workload_config(w, policy, reward_model, overrides)
    rate = machine_rate(cfg)  # before any role starts: the machine to the probe alone
    records, memory, rollout = run_rayppo(cfg, warmup, iterations, w.name)
    arithmetic = learn_arithmetic(cfg, rollout, rate)
    alone = None if skip_alone else stages_alone(cfg, rollout)
    trl = run_trl(cfg, rollout, warmup, iterations, out) if compare == "trl" else None
    summary = summarize(w.name, cfg, records, memory, alone, trl["iterations"] if trl else None,
                        plan_estimate(cfg, rollout), arithmetic, rollout)
    if trl:
        summary["trl_version"] = trl["trl_version"]
    (out / "bench.json").write_text(json.dumps(summary, indent=1))
    plot_stages(summary, out / "stages.png")
    print_table(summary)
    print(f"\nwrote {out / 'bench.json'} and {out / 'stages.png'}")
    return summary


def run_reward_model(w: Workload, out: Path, compare: str | None, warmup: int, steps: int, sweep: list[str],
                     overrides: list[str]) -> dict[str, Any]:
    """A ``reward-model`` workload: ``reward_model_speed.compare`` on the task's pairs, TRL's
    ``RewardTrainer`` beside it with ``--compare trl``; writes ``DIR/bench.json``."""
    from reward_model_speed import compare as compare_speeds
    from reward_model_speed import summary_line

    if sweep:
        raise RayppoError(f"--sweep: not for a reward-model workload ({w.name}); pass the overrides instead")
    config = [f"model.policy={w.model}", *(f"{k}={v}" for k, v in w.config.items()), *overrides]
    result = compare_speeds(None, out, warmup, steps, config, trl=compare == "trl")
    summary = {"workload": w.name, "kind": w.kind, **result}
    (out / "bench.json").write_text(json.dumps(summary, indent=1))
    print(summary_line(result))
    print(f"\nwrote {out / 'bench.json'}")
    return summary


if __name__ == "__main__":  # the child process of stages_alone()
    if len(sys.argv) != 3 or sys.argv[1] != "--stages-alone":
        sys.exit("usage: rayppo bench ... (this file runs directly only as: bench.py --stages-alone DIR)")
    import pyarrow.parquet as pq

    from rayppo.data.rollout import Rollout

    work_dir = Path(sys.argv[2])
    alone = _stages_alone_here(load_config(work_dir / "config.yaml"), Rollout.from_arrow(pq.read_table(work_dir / "rollout.parquet")))
    (work_dir / "alone.json").write_text(json.dumps(alone))
