"""``rayppo bench``: throughput of the real system on a named workload, side by side with TRL.

For a workload of ``benchmarks/workloads.yaml`` it runs W warm-up and M measured iterations of
the distributed system (Ray + vLLM + DeepSpeed), then, in the same invocation:

- each stage alone, in a child process, on the same batch (vLLM generation, one reference pass, one
  reward pass, one learner step): ``overhead_ratio = iteration / (generate + max(reference,
  reward) + learn)``, everything above 1.0 being orchestration, serialization and sync;
- with ``--compare trl``, TRL 1.12's PPO on the identical workload in its own virtual
  environment (``.venv-trl`` beside the repository, created on first use; ``RAYPPO_TRL_VENV``
  names another, and a repository folder that is not writable puts it in rayppo's cache).

Writes ``DIR/bench.json``, ``DIR/stages.png`` and, for sweeps, ``DIR/sweep.json`` and
``DIR/sweep.png``; prints a table.
"""

from __future__ import annotations

import hashlib
import itertools
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import torch
import yaml

from rayppo.config.derived import actor_threads, batch_rows, has_critic, uses_reference, weight_sync_backend
from rayppo.config.load import load_config
from rayppo.config.schema import Config, to_dict
from rayppo.errors import RayppoError
from rayppo.models.paths import cache_root

HERE = Path(__file__).resolve().parent
TRL_REQUIREMENTS = ["torch==2.13.0", "trl==1.12.0", "requests==2.34.2"]  # GRPOTrainer imports requests (its vLLM client)
TRL_SCRIPTS = {"gae": "trl_ppo.py", "grpo": "trl_grpo.py"}
"""The TRL trainer compared for each ``ppo.advantage`` (``--compare trl``)."""
TRL_VENV_ENV = "RAYPPO_TRL_VENV"
"""Names the folder of TRL's virtual environment, over the default choice (``choose_trl_venv``)."""


@dataclass
class Workload:
    name: str
    description: str
    model: str | dict[str, int]
    config: dict[str, Any]
    warmup: int
    iterations: int


def load_workloads(path: Path = HERE / "workloads.yaml") -> dict[str, Workload]:
    raw = yaml.safe_load(path.read_text())
    return {name: Workload(name, w.get("description", ""), w["model"], w.get("config", {}),
                           int(w.get("warmup", 2)), int(w.get("iterations", 5))) for name, w in raw.items()}


# ------------------------------------------------------------------------------------ models
def prepare_models(workload: Workload) -> tuple[Path, Path]:
    """(policy folder, reward-model folder) for a workload, built once and cached."""
    from rayppo.models.embedded import build_random_llama

    from rayppo.models.loading import resolve_model_path
    from rayppo.models.paths import built_on_first_use

    key = hashlib.sha1(json.dumps(workload.model, sort_keys=True).encode()).hexdigest()[:10]
    root = cache_root() / "bench" / f"{workload.name}-{key}"
    builtin = isinstance(workload.model, str) and built_on_first_use(workload.model)  # embedded, the real model
    policy = resolve_model_path(workload.model) if builtin else root / "policy"
    if not builtin and not (policy / "config.json").is_file():
        shape = dict(workload.model)  # eos_mean_length, eos_length_cap: long-tailed lengths (add_stop_words)
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


def _child_output(name: str):
    """Where a child process's output goes: ``logs/NAME.log`` of the bench folder (the terminal
    with ``--verbose``, or when nothing set the console up)."""
    from rayppo.console import console

    if console.verbose or console.log_dir is None:
        return None
    return (console.log_dir / f"{name}.log").open("a", encoding="utf-8")


def _run_child(name: str, what: str, command: list[str]) -> None:
    """``command`` to its end, one phase line saying what runs and where its output is."""
    from rayppo.console import console

    log = _child_output(name)
    where = f" (its output: {console.shown(Path(log.name))})" if log else ""
    console.phase(f"{what}{where}")
    try:
        result = subprocess.run(command, stdout=log, stderr=subprocess.STDOUT if log else None)
    finally:
        if log:
            log.close()
    if result.returncode:
        raise RayppoError(f"{what} failed (exit {result.returncode})" + (f"; see {console.shown(Path(log.name))}"
                                                                       if log else ""))


def learn_arithmetic(cfg: Config, rollout) -> dict[str, float]:
    """The learner stage's useful FLOPs for this rollout (``rayppo.plan.flops``) and, measured here and
    now, the GFLOP/s of one matmul of the size the learner runs most: a minibatch's tokens through
    the MLP's up projection, in the model's dtype, on the learner's threads (the actors are gone)."""
    from rayppo.models.shape import read_shape
    from rayppo.plan.flops import Sequences, learn_flops

    policy = read_shape(cfg.model.policy)
    critic = read_shape(cfg.model.critic or cfg.model.policy) if has_critic(cfg.ppo) else None
    seq = Sequences([len(p) + len(r) for p, r in zip(rollout.prompt_ids, rollout.response_ids)],
                    sum(len(r) for r in rollout.response_ids))
    # Asynchronous mode's learner also recomputes log pi_prox (one policy forward per row).
    lockstep, proximal = (learn_flops(policy, critic, seq, cfg.ppo.epochs, cfg.ppo.minibatches, proximal=p)
                          for p in (False, True))
    flops = proximal if cfg.rollout.max_staleness > 0 else lockstep
    lr = cfg.learner
    threads = lr.num_ranks * actor_threads(lr.threads, lr.cpus_per_rank)
    shape = [sum(seq.lengths) // cfg.ppo.minibatches, policy.hidden, policy.intermediate]
    return {"learn_gflop": flops / 1e9, "matmul_gflop_per_s": matmul_gflop_per_s(*shape, cfg.model.dtype, threads),
            "matmul_shape": shape, "matmul_threads": threads, "proximal_flops_ratio": proximal / lockstep}


def matmul_gflop_per_s(m: int, k: int, n: int, dtype: str, threads: int, repeats: int = 15) -> float:
    """GFLOP/s of an ``[m, k] x [k, n]`` matmul on ``threads`` torch threads: the median of
    ``repeats`` timed calls after a warm-up (a minimum would catch the CPU's best moment)."""
    before = torch.get_num_threads()
    a = torch.randn(m, k).to(torch.bfloat16 if dtype == "bfloat16" else torch.float32)
    b = torch.randn(k, n).to(a.dtype)
    torch.set_num_threads(threads)
    try:
        a @ b
        seconds = statistics.median(_timed(torch.mm, a, b)[0] for _ in range(repeats))
    finally:
        torch.set_num_threads(before)
    return 2 * m * k * n / seconds / 1e9


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
        _run_child("stages-alone", "each stage alone on the measured batch, in a child process",
                   [sys.executable, __file__, "--stages-alone", str(work)])
        return json.loads((work / "alone.json").read_text())


def _stages_alone_here(cfg: Config, rollout) -> dict[str, float]:
    """Each stage once, in this process, with the role's total threads.

    Each engine runs one warm-up call first, as it did in the measured run.
    """
    from rayppo.actors.generator import GeneratorEngine
    from rayppo.actors.reference import ReferenceEngine
    from rayppo.actors.reward import RewardEngine
    from rayppo.cluster.learner_group import LearnerGroup
    from rayppo.data.prompts import PromptBatch
    from rayppo.trainers.distributed import vllm_settings
    from rayppo.trainers.iteration import sampling_settings

    g, m, lr = cfg.generators, cfg.model, cfg.learner
    threads = {"gen": g.num * actor_threads(g.threads, g.cpus_per_worker),
               "learn": lr.num_ranks * actor_threads(lr.threads, lr.cpus_per_rank)}
    prompts = PromptBatch(rollout.prompt_text, rollout.prompt_ids)
    out: dict[str, float] = {}
    # The generator goes last: vLLM's CPU worker pins this process's threads and from then on
    # ignores torch.set_num_threads, which gave the reference and reward passes (1 thread each in
    # the run) the generator's 2 threads here and halved their "alone" times.
    torch.set_num_threads(cfg.reference.num * actor_threads(cfg.reference.threads, cfg.reference.cpus))
    out["reference"] = 0.0  # none at ppo.kl_coef = 0
    if uses_reference(cfg.ppo):
        reference = ReferenceEngine(m.reference or m.policy, cfg.rollout.temperature, 64, m.dtype,
                                    micro_batch_tokens=cfg.reference.micro_batch_tokens)
        reference.ref_logprobs(rollout)
        out["reference"], _ = _timed(reference.ref_logprobs, rollout)
        del reference
    torch.set_num_threads(cfg.reward.num * actor_threads(cfg.reward.threads, cfg.reward.cpus))
    reward = RewardEngine(cfg.reward.function, cfg.reward.model, cfg.reward.batch_size, m.dtype,
                          micro_batch_tokens=cfg.reward.micro_batch_tokens)
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
    generator = GeneratorEngine(m.policy, sampling_settings(cfg), g.backend, m.dtype, 0, cfg.seed, vllm_settings(cfg))
    generator.generate(prompts, 0)
    out["generate"], _ = _timed(generator.generate, prompts, 1)
    return out


def venv_state(path: Path) -> str:
    """What ``path`` holds, as a TRL environment: ``ready`` (bin/python and TRL_REQUIREMENTS' exact
    versions installed), ``missing``, ``a dangling symlink``, ``a file`` or ``half-made (...)``
    (an interrupted or failed install: pip writes a package's dist-info last)."""
    if path.is_symlink() and not path.exists():
        return "a dangling symlink"
    if not path.exists():
        return "missing"
    if not path.is_dir():
        return "a file"
    if not (path / "bin" / "python").exists():
        return "half-made (no bin/python)"
    sites = list(path.glob("lib/python*/site-packages"))
    for name, version in (r.split("==") for r in TRL_REQUIREMENTS):
        # torch's dist-info carries a local version: torch-2.13.0+cpu.dist-info
        if not any(any(site.glob(f"{name.replace('-', '_')}-{version}*.dist-info")) for site in sites):
            return f"half-made (no {name}=={version})"
    return "ready"


def _writable(folder: Path) -> bool:
    """Whether a folder can be made in ``folder``: tried, since ``os.access`` answers yes to root
    where the filesystem still refuses (read-only mounts aside)."""
    try:
        os.rmdir(tempfile.mkdtemp(prefix=".rayppo-probe-", dir=folder))
        return True
    except OSError:
        return False


@dataclass
class TrlVenv:
    """Where TRL's virtual environment lives, and why there."""

    path: Path
    why: str

    @property
    def state(self) -> str:
        return venv_state(self.path)


def choose_trl_venv(repo: Path = HERE.parent, environ: dict[str, str] | None = None) -> TrlVenv:
    """``RAYPPO_TRL_VENV`` when set; else ``.venv-trl`` beside the repository when it is ready or
    the repository folder is writable; else ``venv-trl`` in rayppo's cache (``cache_root``)."""
    named = (os.environ if environ is None else environ).get(TRL_VENV_ENV)
    if named:
        return TrlVenv(Path(named).expanduser().absolute(), f"from {TRL_VENV_ENV}")
    beside = repo / ".venv-trl"
    if venv_state(beside) == "ready" or _writable(repo):
        return TrlVenv(beside, "beside the repository")
    return TrlVenv(cache_root() / "venv-trl", f"{repo} is not writable")


VENV_ENTRIES = {"bin", "include", "lib", "lib64", "share", "pyvenv.cfg"}
"""What ``python -m venv`` and pip put at the top of an environment: a half-made folder holding
anything else is not ours to remove."""


def clear_leftovers(venv: TrlVenv, state: str) -> None:
    """Make room for a new environment at ``venv.path`` (in ``state``): a link that leads to no
    ready environment is removed (its target, maybe not ours, is left alone), a half-made
    environment deleted. A file, or a folder with more than a venv in it, is refused."""
    path = venv.path
    if path.is_symlink():
        path.unlink()
    elif state == "a file" or (state.startswith("half-made") and
                               not all(child.name in VENV_ENTRIES for child in path.iterdir())):
        what = "a file" if state == "a file" else f"{state} but holds more than a virtual environment"
        raise RayppoError(f"TRL's environment: {path} ({venv.why}) is {what}; move it, or set {TRL_VENV_ENV} to "
                          "a new folder")
    elif state.startswith("half-made"):
        shutil.rmtree(path)


def install_line(venv: TrlVenv, state: str) -> str:
    """The one line ``ensure_trl_venv`` prints before it installs: where, why, and that it is once."""
    redo = "" if state == "missing" else f"it was {state}, so it is rebuilt: "
    return (f"TRL's environment: {venv.path} ({venv.why}): {redo}a one-time install of {' '.join(TRL_REQUIREMENTS)}, "
            "reused by later --compare trl runs")


def ensure_trl_venv(venv: TrlVenv | None = None) -> Path:
    """TRL's pinned release in its own virtual environment (TRL pins other versions than rayppo):
    made once where ``choose_trl_venv`` says, remade over a dangling link or a half-made install.
    Returns its python."""
    venv = venv or choose_trl_venv()
    state = venv.state
    python = venv.path / "bin" / "python"
    if state == "ready":
        return python
    clear_leftovers(venv, state)
    print(install_line(venv, state), file=sys.stderr)
    venv.path.parent.mkdir(parents=True, exist_ok=True)
    subprocess.run([sys.executable, "-m", "venv", str(venv.path)], check=True)
    subprocess.run([str(python), "-m", "pip", "install", "--quiet", *TRL_REQUIREMENTS], check=True)
    return python


def run_trl(cfg: Config, rollout, warmup: int, iterations: int, out_dir: Path,
            venv: TrlVenv | None = None) -> list[dict[str, float]]:
    """TRL on the same workload, timed per iteration, in its own environment (``ensure_trl_venv``):
    its PPO for ``ppo.advantage=gae`` (``trl_ppo.py``), its GRPO for ``grpo`` (``trl_grpo.py``)."""
    script = TRL_SCRIPTS.get(cfg.ppo.advantage)
    if script is None:
        raise RayppoError(f"--compare trl: no TRL trainer is compared for ppo.advantage={cfg.ppo.advantage} "
                          f"(compared: {', '.join(TRL_SCRIPTS)})")
    python = ensure_trl_venv(venv)
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
    _run_child("trl", f"TRL on the same workload ({script})", [str(python), str(HERE / script), "--spec",
                                                                 str(out_dir / "trl_spec.json"), "--out",
                                                                 str(out_dir / "trl.json")])
    return json.loads((out_dir / "trl.json").read_text())["iterations"]


# ----------------------------------------------------------------------------------- summary
def length_stats(rollout) -> dict[str, float]:
    """The measured batch's response lengths: mean, p50, p90, max, and the share cut at the cap."""
    lengths = sorted(len(r) for r in rollout.response_ids)
    n = len(lengths)
    return {"mean": sum(lengths) / n, "p50": lengths[n // 2], "p90": lengths[min(n - 1, int(0.9 * n))],
            "max": lengths[-1], "truncated_share": sum(r == "length" for r in rollout.finish_reason) / n}


def stage_tokens(cfg: Config, rollout, learn: dict[str, float]) -> dict[str, dict[str, float]]:
    """Per stage, the real tokens of the measured batch against the tokens its passes process,
    padding included (``processed / real`` is what padding costs): the reference and reward passes
    as their engines cut them (``data.micro_batches.scoring_batches``), the learner as it counted
    (``tokens/learn_*``, every epoch). Generation pads nothing (vLLM's paged KV cache)."""
    from rayppo.data.micro_batches import padded_tokens, scoring_batches
    from rayppo.models.loading import resolve_model_path
    from rayppo.models.packing import cut_layout, scoring_layout

    prompt, response = rollout.lengths()
    whole = [a + b for a, b in zip(prompt, response)]
    none = [0] * len(whole)  # the reward model scores each text whole (re-tokenised; here the same tokenizer)
    reward = scoring_batches(none, whole, cfg.reward.micro_batch_tokens, cfg.reward.batch_size)
    # The reference engine's layout (``ReferenceEngine.layout``): right-padded rows cost their whole
    # sequence, packed ones (varlen, flash-attention's one row) their real tokens.
    reference_config = resolve_model_path(cfg.model.reference or cfg.model.policy) / "config.json"
    mode = scoring_layout(SimpleNamespace(**json.loads(reference_config.read_text())))
    layout = mode or "padded"
    split = (none, whole) if mode else (prompt, response)
    reference = scoring_batches(*split, cfg.reference.micro_batch_tokens, 64, cut_layout(mode))
    packed = cut_layout(mode) == "packed"  # a pass processes its real tokens
    out = {"generate": {"real": sum(response), "processed": sum(response)},
           "reference": {"real": sum(whole), "processed": sum(whole) if packed else padded_tokens(*split, reference),
                         "layout": layout},
           "reward": {"real": sum(whole), "processed": padded_tokens(none, whole, reward)}}
    if "tokens/learn_real" in learn:
        out["learn"] = {"real": learn["tokens/learn_real"], "processed": learn["tokens/learn_processed"],
                        "layout": "packed" if learn.get("tokens/learn_packed") else
                                  "right_padded" if learn.get("tokens/learn_right_padded") else "padded"}
    return {stage: t | {"padding_factor": t["processed"] / max(t["real"], 1)} for stage, t in out.items()}


def _mmm(values: list[float]) -> dict[str, float]:
    return {"min": min(values), "median": statistics.median(values), "max": max(values)}


def _overlap_bound(col: dict[str, list[float]], learn_factor: float = 1.0) -> dict[str, Any]:
    """What overlapping the stages (``rollout.max_staleness`` >= 1) can buy at best, from this
    run's stage times, when every role has its own device: the iteration shrinks to its busiest
    role's seconds. ``overlap_bound`` is that speed-up; ``idle_floor`` each role's idle share
    then (a role faster than the busiest one waits for it however the work is scheduled).
    ``learn_factor`` scales the learner's seconds: measured synchronously, by the pi_prox pass
    that asynchronous mode adds (``proximal_flops_ratio``)."""
    busy = {s: statistics.median(col[f"time/{s}"]) for s in ("generate", "reference", "reward", "learn")}
    busy["learn"] *= learn_factor
    busiest = max(busy, key=busy.get)
    return {"overlap_bound": statistics.median(col["time/iteration"]) / busy[busiest], "busiest_stage": busiest,
            "idle_floor": {"generators": 1 - busy["generate"] / busy[busiest],
                           "learners": 1 - busy["learn"] / busy[busiest]}}


def summarize(name: str, cfg: Config, records: list[dict[str, float]], memory: dict[str, int],
              alone: dict[str, float] | None, trl: list[dict[str, float]] | None,
              estimate: dict[str, int] | None = None, arithmetic: dict[str, float] | None = None,
              rollout=None) -> dict[str, Any]:
    """The figures of one benchmark run (bench.json). Token rates count real response tokens
    (rows x mean length per iteration), never padding; TRL's samples the same model, so its
    lengths follow the same distribution and its rate uses the same count."""
    col = {k: [r[k] for r in records] for k in records[0]}
    real = [batch_rows(cfg) * length for length in col["response/length_mean"]]  # rows = prompts x samples
    tokens = statistics.median(real)
    per_iteration = [
        {"iteration_s": r["time/iteration"], "generate_s": r["time/generate"], "reference_s": r["time/reference"],
         "reward_s": r["time/reward"], "learn_s": r["time/learn"], "sync_s": r["time/sync"],
         "generator_idle_s": r["time/iteration"] - r["time/generate"],
         "learner_idle_s": r["time/iteration"] - r["time/learn"], "response_tokens": t}
        for r, t in zip(records, real)
    ]
    iteration = statistics.median(col["time/iteration"])
    # A synchronous run's learner lacks the pi_prox pass that overlapping would add to it.
    learn_factor = (arithmetic or {}).get("proximal_flops_ratio", 1.0) if cfg.rollout.max_staleness == 0 else 1.0
    out: dict[str, Any] = {
        "workload": name,
        "machine": f"{os.cpu_count()} CPU cores" + (f", {torch.cuda.get_device_name()}" if torch.cuda.is_available() else ""),
        "tokens_per_iteration": tokens,
        "end_to_end_tokens_per_s": statistics.median(t / i for t, i in zip(real, col["time/iteration"])),
        "iteration_s": _mmm(col["time/iteration"]),
        "stage_s": {s: _mmm(col[f"time/{s}"]) for s in ("generate", "reference", "reward", "learn", "sync")},
        # A stage that did not run (no reference at ppo.kl_coef = 0) has no rate.
        "stage_tokens_per_s": {s: tokens / statistics.median(col[f"time/{s}"]) for s in ("generate", "reference", "reward", "learn")
                               if statistics.median(col[f"time/{s}"]) > 0},
        "idle_s": {"generators": _mmm([p["generator_idle_s"] for p in per_iteration]),
                   "learners": _mmm([p["learner_idle_s"] for p in per_iteration])},
        # Shares of the iteration each role waited (the asynchronous pipeline's goal: both small).
        "idle_share": {"generators": statistics.median(p["generator_idle_s"] / p["iteration_s"] for p in per_iteration),
                       "learners": statistics.median(p["learner_idle_s"] / p["iteration_s"] for p in per_iteration)},
        **_overlap_bound(col, learn_factor),
        "weight_sync": weight_sync_backend(cfg) or "object_store",
        "sync_bytes": col["sync/bytes"][-1],
        "sync_gb_per_s": statistics.median(b / max(t, 1e-9) / 1e9 for b, t in zip(col["sync/bytes"], col["time/sync"])),
        "sync_share": statistics.median(s / i for s, i in zip(col["time/sync"], col["time/iteration"])),
        # The correctness guard's weight check, as a share of the sync it checks (included in it).
        "sync_verify_share": statistics.median(v / s for v, s in zip(col["time/sync_verify"], col["time/sync"])),
        "peak_memory_bytes": memory,
        "per_iteration": per_iteration,
    }
    if rollout is not None:
        out["lengths"] = length_stats(rollout)
        out["stage_tokens"] = stage_tokens(cfg, rollout, records[-1])
    if estimate:  # the pre-flight plan against what was measured, per role
        out["plan_estimate_bytes"] = estimate
        out["plan_ratio"] = {role: estimate[role] / memory[role] for role in memory if role in estimate}
    if arithmetic:  # the learner's achieved rate against a matmul's, both on the learner's threads
        achieved = arithmetic["learn_gflop"] / statistics.median(col["time/learn"])
        out |= arithmetic | {"learn_gflop_per_s": achieved,
                             "learn_efficiency": achieved / arithmetic["matmul_gflop_per_s"]}
    if alone:
        limit = alone["generate"] + max(alone["reference"], alone["reward"]) + alone["learn"]
        out["stages_alone_s"] = alone
        out["overhead_ratio"] = iteration / limit
    if trl:
        walls = [t["wall_s"] for t in trl]
        without_gc = [t["wall_s"] - t["gc_s"] for t in trl]
        out["trl_iteration_s"] = _mmm(walls)
        out["trl_gc_s"] = statistics.median(t["gc_s"] for t in trl)
        out["trl_end_to_end_tokens_per_s"] = tokens / statistics.median(walls)
        out["trl_without_gc_tokens_per_s"] = tokens / statistics.median(without_gc)
        out["ratio_vs_trl"] = out["end_to_end_tokens_per_s"] / out["trl_end_to_end_tokens_per_s"]
        out["ratio_vs_trl_without_gc"] = out["end_to_end_tokens_per_s"] / out["trl_without_gc_tokens_per_s"]
        out["trl_trainer"] = "GRPOTrainer" if cfg.ppo.advantage == "grpo" else "PPOTrainer"
    return out


def print_table(s: dict[str, Any]) -> None:
    def row(label: str, v: dict[str, float]) -> str:
        return f"  {label:<18}{v['min']:>9.3f}{v['median']:>9.3f}{v['max']:>9.3f}"

    print(f"\nworkload {s['workload']} ({s['machine']}), {s['tokens_per_iteration']:,.0f} generated tokens per iteration")
    if "lengths" in s:
        n = s["lengths"]
        print(f"  response lengths     mean {n['mean']:.1f}, p50 {n['p50']}, p90 {n['p90']}, max {n['max']}, "
              f"{100 * n['truncated_share']:.0f}% cut at the cap")
        print("  processed / real     " + ", ".join(f"{k} {v['padding_factor']:.2f}x" + (" (packed)" if v.get("packed") else "")
                                                   for k, v in s["stage_tokens"].items()))
    print(f"  {'seconds':<18}{'min':>9}{'median':>9}{'max':>9}")
    print(row("iteration", s["iteration_s"]))
    for stage, v in s["stage_s"].items():
        print(row(stage, v))
    print(row("generators idle", s["idle_s"]["generators"]))
    print(row("learners idle", s["idle_s"]["learners"]))
    print(f"  idle share           generators {100 * s['idle_share']['generators']:.0f}%, "
          f"learners {100 * s['idle_share']['learners']:.0f}% of the iteration")
    print(f"  overlap bound        {s['overlap_bound']:.2f}x: every role on its own device, the iteration "
          f"could shrink to its busiest stage ({s['busiest_stage']}); idle shares then at least generators "
          f"{100 * s['idle_floor']['generators']:.0f}%, learners {100 * s['idle_floor']['learners']:.0f}%")
    print(f"  end-to-end tokens/s  {s['end_to_end_tokens_per_s']:,.0f}   per stage: "
          + ", ".join(f"{k} {v:,.0f}" for k, v in s["stage_tokens_per_s"].items()))
    print(f"  weight sync ({s['weight_sync']}) {s['sync_bytes'] / 1e6:.1f} MB/iteration, {s['sync_gb_per_s']:.2f} GB/s, "
          f"{100 * s['sync_share']:.1f}% of the iteration; its weight check {100 * s['sync_verify_share']:.0f}% of the sync")
    print("  peak memory (RSS)    " + ", ".join(f"{k} {v / 2**30:.2f} GiB" for k, v in s["peak_memory_bytes"].items()))
    if "plan_ratio" in s:
        print("  rayppo plan's guess  " + ", ".join(f"{k} {s['plan_estimate_bytes'][k] / 2**30:.2f} GiB ({r:.2f}x)"
                                                   for k, r in s["plan_ratio"].items()))
    if "learn_efficiency" in s:
        print(f"  learner arithmetic   {s['learn_gflop']:,.0f} GFLOP in {s['stage_s']['learn']['median']:.1f} s = "
              f"{s['learn_gflop_per_s']:.0f} GFLOP/s; a {' x '.join(map(str, s['matmul_shape']))} matmul "
              f"{s['matmul_gflop_per_s']:.0f} GFLOP/s -> learn_efficiency {s['learn_efficiency']:.2f}")
        print("  (learn_efficiency: the learner's FLOP rate over a plain matmul's on the same threads; 1.0 is the "
              "machine's arithmetic limit)")
    if "overhead_ratio" in s:
        alone = s["stages_alone_s"]
        print("  stages alone         " + ", ".join(f"{k} {v:.3f} s" for k, v in alone.items())
              + f"  -> overhead ratio {s['overhead_ratio']:.2f}")
    if "ratio_vs_trl" in s:
        print(f"  TRL 1.12 {s.get('trl_trainer', 'PPOTrainer'):<12}{s['trl_end_to_end_tokens_per_s']:,.0f} tokens/s "
              f"(iteration {s['trl_iteration_s']['median']:.3f} s, of which gc.collect {s['trl_gc_s']:.3f} s)")
        print(f"  rayppo / TRL         {s['ratio_vs_trl']:.2f}x as shipped, "
              f"{s['ratio_vs_trl_without_gc']:.2f}x against TRL without its gc.collect calls")


def print_sweep(points: list[dict[str, Any]]) -> None:
    """One line per sweep point: tokens/s, speed-up over the first point, idle shares."""
    print(f"\n  {'point':<36}{'tokens/s':>10}{'speed-up':>10}{'gen idle':>10}{'learn idle':>11}")
    for p in points:
        label = " ".join(f"{k}={v}" for k, v in p["point"].items())
        print(f"  {label:<36}{p['end_to_end_tokens_per_s']:>10,.0f}{p['speedup_vs_first']:>9.2f}x"
              f"{100 * p['idle_share']['generators']:>9.0f}%{100 * p['idle_share']['learners']:>10.0f}%")


def plot_stages(s: dict[str, Any], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = s["per_iteration"]
    fig, ax = plt.subplots(figsize=(7, 3.6))
    bottom = [0.0] * len(rows)
    for stage in ("generate", "reference", "learn", "sync"):
        values = [r[f"{stage}_s"] for r in rows]
        ax.bar(range(len(rows)), values, bottom=bottom, label=stage)
        bottom = [b + v for b, v in zip(bottom, values)]
    other = [r["iteration_s"] - b for r, b in zip(rows, bottom)]
    ax.bar(range(len(rows)), other, bottom=bottom, label="other (orchestration)", color="lightgrey")
    ax.set(title=f"{s['workload']}: time per iteration by stage", xlabel="measured iteration", ylabel="seconds")
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


def plot_sweep(points: list[dict[str, Any]], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    labels = [" ".join(f"{k.split('.')[-1]}={v}" for k, v in p["point"].items()) for p in points]
    fig, ax = plt.subplots(figsize=(max(5, 1.6 * len(points)), 3.6))
    ax.bar(range(len(points)), [p["end_to_end_tokens_per_s"] for p in points])
    ax.set_xticks(range(len(points)), labels, rotation=20, fontsize=8)
    ax.set(title="scaling sweep: end-to-end tokens/s", ylabel="tokens/s")
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


# -------------------------------------------------------------------------------------- main
def sweep_points(specs: list[str]) -> list[dict[str, str]]:
    """``["generators.num=1,2", "learner.num_ranks=1,2"]`` -> the 4 combinations."""
    axes = []
    for spec in specs:
        if "=" not in spec:
            raise ValueError(f"--sweep {spec!r}: expected key=v1,v2,...")
        key, values = spec.split("=", 1)
        axes.append([(key, v) for v in values.split(",")])
    return [dict(combo) for combo in itertools.product(*axes)]


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
    policy, reward_model = prepare_models(w)
    overrides = [f"output.dir={out}", *overrides]  # the runs' placement.json and logs/ go with bench.json
    if sweep:
        points = []
        for point in sweep_points(sweep):
            cfg = workload_config(w, policy, reward_model, overrides + [f"{k}={v}" for k, v in point.items()])
            label = " ".join(f"{k}={v}" for k, v in point.items())
            records, memory, rollout = run_rayppo(cfg, warmup, iterations, label)
            points.append({"point": point, **summarize(w.name, cfg, records, memory, None, None,
                                                       plan_estimate(cfg, rollout), learn_arithmetic(cfg, rollout),
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
    records, memory, rollout = run_rayppo(cfg, warmup, iterations, w.name)
    arithmetic = learn_arithmetic(cfg, rollout)
    alone = None if skip_alone else stages_alone(cfg, rollout)
    trl = run_trl(cfg, rollout, warmup, iterations, out) if compare == "trl" else None
    summary = summarize(w.name, cfg, records, memory, alone, trl, plan_estimate(cfg, rollout), arithmetic, rollout)
    (out / "bench.json").write_text(json.dumps(summary, indent=1))
    plot_stages(summary, out / "stages.png")
    print_table(summary)
    print(f"\nwrote {out / 'bench.json'} and {out / 'stages.png'}")
    return summary


if __name__ == "__main__":  # the child process of stages_alone()
    if len(sys.argv) != 3 or sys.argv[1] != "--stages-alone":
        sys.exit("usage: rayppo bench ... (this file runs directly only as: bench.py --stages-alone DIR)")
    import pyarrow.parquet as pq

    from rayppo.data.rollout import Rollout

    work_dir = Path(sys.argv[2])
    alone = _stages_alone_here(load_config(work_dir / "config.yaml"), Rollout.from_arrow(pq.read_table(work_dir / "rollout.parquet")))
    (work_dir / "alone.json").write_text(json.dumps(alone))
