"""``rayppo plan``: will a job fit? Per role: actors, CPUs/GPUs, placement group, peak memory.

The memory per actor comes from ``rayppo.footprint`` (json + math), the placement groups from
``rayppo.cluster.placement`` (pure, but its module imports Ray). The fit check compares the
placement groups' total demand with the cluster's resources, each GPU's memory with the device's
(actors sharing a GPU add up; in colocated mode the worst of the generate, score and learn
phases), and the total RSS with the cluster's ``memory``. ``rayppo train`` runs the same check
on the resource counts it knows before anything starts (``preflight``).
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from rayppo.config import Config, ConfigError, role_gpus, tensor_parallel_size
from rayppo.footprint import GiB, MiB, Estimate, Inputs, estimate_roles, estimates, inputs, param_count

ROLES = ("generators", "reference", "reward", "learner")
ACCELERATOR_GIB = {"H200": 141, "H100": 80, "A100-80G": 80, "A100-40G": 40, "L40S": 48, "L4": 24,
                   "A10G": 24, "T4": 16}
"""Device memory of Ray's ``accelerator_type:NAME`` resources (unambiguous names only)."""


def _counts(cfg: Config) -> dict[str, int]:
    return {"generators": cfg.generators.num, "reference": cfg.reference.num, "reward": cfg.reward.num,
            "learner": cfg.learner.num_ranks}


def gpu_loads(cfg: Config, est: dict[str, Estimate]) -> list[tuple[str, dict[str, float]]]:
    """Each GPU's peak: ``(phase, role -> bytes)``. Colocated, GPU i holds learner rank i and actor
    i of each other role, and its peak is the worst phase (generate, score, learn) with the busy
    roles at their peak and the others resident (vLLM asleep). Otherwise every actor counts at its
    peak (caching allocators keep what they reserved), ``concurrent``; fractional shares are packed
    first-fit, as Ray packs them, and a tensor-parallel generator is counted on each of its GPUs."""
    counts = _counts(cfg)
    if cfg.cluster.colocate_all:
        busy = {"generate": ("generators",), "score": ("reference", "reward"), "learn": ("learner",)}
        loads = []
        for i in range(cfg.learner.num_ranks if cfg.learner.gpus_per_rank else 0):
            phases = {name: {r: est[r].peak if r in roles else est[r].resident for r in ROLES if i < counts[r]}
                      for name, roles in busy.items()}
            loads.append(max(phases.items(), key=lambda item: sum(item[1].values())))
        return loads
    loads, shares = [], []
    for role in ROLES:
        g = role_gpus(cfg, role)
        if role == "generators" and cfg.generators.tensor_parallel_layout == "across_nodes":
            g = float(tensor_parallel_size(cfg.generators))
        loads += [("concurrent", {role: est[role].peak})] * (int(g) * counts[role] if g >= 1 else 0)
        shares += [(g, role)] * (counts[role] if 0 < g < 1 else 0)
    free: list[float] = []  # of each shared GPU, in the order they were opened
    shared: list[dict[str, float]] = []
    for g, role in sorted(shares, key=lambda share: -share[0]):
        i = next((j for j, left in enumerate(free) if left >= g - 1e-9), len(free))
        if i == len(free):
            free.append(1.0)
            shared.append({})
        free[i] -= g
        shared[i][role] = shared[i].get(role, 0.0) + est[role].peak
    return loads + [("concurrent", load) for load in shared]

MEMORY_FIXES = {
    "generators": "a lower generators.gpu_memory_utilization (on CPU a smaller generators.kv_cache_gib)",
    "reference": "a GPU of its own for the reference (reference.gpus=1) or a shorter rollout.max_new_tokens",
    "reward": "a GPU of its own for the reward model (reward.gpus=1) or a smaller reward.batch_size",
}


def _memory_fix(cfg: Config, role: str) -> str:
    """What makes ``role`` smaller, leaving out what the config already does."""
    if role != "learner":
        return MEMORY_FIXES[role]
    lr = cfg.learner
    options = [] if lr.gradient_checkpointing else ["learner.gradient_checkpointing=true"]
    options += ["learner.zero_stage=3" if lr.zero_stage < 3 else "more learner.num_ranks"]
    options += [] if lr.offload else ["learner.offload=true"]
    return ", ".join(options) + ", or more ppo.minibatches"


def fit_lines(cfg: Config, est: dict[str, Estimate], available: dict[str, float],
              gpu_memory_gib: float | None) -> list[str]:
    """One line per missing thing, naming the fix. Counts (CPU, GPU, custom resources) are always
    checked; host memory only when ``available`` has ``memory`` (bytes), GPU memory only when
    ``gpu_memory_gib`` is given (then ``est`` must be the roles' estimates)."""
    from rayppo.cluster.placement import FIXES, plan_groups, role_specs, total_demand

    lines = []
    for key, need in sorted(total_demand(plan_groups(cfg)).items()):
        have = available.get(key, 0.0)
        if need > have + 1e-9:  # worded as placement.check_capacity words it, plus the fix
            users = ", ".join(f"{s.name} {s.count} x {s.bundle[key]:g}" for s in role_specs(cfg) if s.bundle.get(key))
            fix = FIXES.get(key, "a cluster that has it, or no actor asking for it (generators.resources, "
                                 "reference.resources, reward.resources, learner.resources)")
            lines.append(f"{key}: need {need:g} ({users or 'bundles'}), cluster has {have:g}: {fix}")
    if gpu_memory_gib:
        lines += [p for e in est.values() for p in e.problems] + _gpu_memory_lines(cfg, est, gpu_memory_gib)
    if "memory" in available and est:
        need = sum(n * est[r].rss for r, n in _counts(cfg).items())
        if need > available["memory"]:
            worst = max(ROLES, key=lambda r: _counts(cfg)[r] * est[r].rss)
            lines.append(f"memory: need {need / GiB:.1f} GiB of RSS in total, cluster has "
                         f"{available['memory'] / GiB:.1f} "
                         f"GiB (the {worst} take the most): fewer actors, or {_memory_fix(cfg, worst)}")
    return lines


def _gpu_memory_lines(cfg: Config, est: dict[str, Estimate], gpu_memory_gib: float) -> list[str]:
    over: dict[tuple, list[int]] = {}  # identical GPUs share one line
    for i, (phase, load) in enumerate(gpu_loads(cfg, est)):
        if sum(load.values()) > gpu_memory_gib * GiB:
            over.setdefault((phase, *((r, round(b / GiB, 1)) for r, b in load.items())), []).append(i)
    lines = []
    for (phase, *load), gpus in over.items():
        which = f"GPU {gpus[0]} needs" if len(gpus) == 1 else f"{len(gpus)} GPUs need"
        worst = max(load, key=lambda role_gib: role_gib[1])[0]
        lines.append(f"GPU memory: {which} {sum(b for _, b in load):.1f} GiB ({phase}: "
                     f"{' + '.join(f'{r} {b:g}' for r, b in load)}), the device has {gpu_memory_gib:g} GiB: "
                     f"{_memory_fix(cfg, worst)}")
    return lines

@dataclass
class Plan:
    """What ``rayppo plan`` reports."""

    inputs: Inputs
    """The models and lengths assumed."""
    roles: dict[str, Estimate]
    """Peak memory per actor of each role."""
    available: dict[str, float]
    """The cluster's resources (``memory`` in bytes)."""
    gpu_memory_gib: float
    """Memory of one GPU."""
    source: str
    """Where ``available`` came from."""
    missing: list[str]
    """One line per missing thing, with its fix; empty when the job fits."""


def make_plan(cfg: Config, available: dict[str, float], source: str, gpu_memory_gib: float = 80.0,
              prompt_tokens: int | None = None) -> Plan:
    m = inputs(cfg, prompt_tokens, gpu_memory_gib)
    est = estimates(cfg, m)
    return Plan(m, est, available, gpu_memory_gib, source, fit_lines(cfg, est, available, gpu_memory_gib))


def _size(n: float) -> str:
    return f"{n / GiB:.2f} GiB" if n >= GiB else f"{n / MiB:.0f} MiB"


def plan_json(cfg: Config, plan: Plan) -> dict[str, Any]:
    """The plan as plain data (``rayppo plan --json``); sizes in bytes."""
    from rayppo.cluster.placement import plan_groups, role_specs, total_demand

    groups: dict[str, list[str]] = {}
    for group in plan_groups(cfg):
        for role in dict.fromkeys(role for role, _, _ in group.members):
            groups.setdefault(role, []).append(group.name)
    roles = {s.name: {"actors": s.count, "cpus": s.bundle.get("CPU", 0.0), "gpus": s.bundle.get("GPU", 0.0),
                      "groups": groups.get(s.name, []), "device": plan.roles[s.name].device,
                      "peak_bytes": plan.roles[s.name].peak, "rss_bytes": plan.roles[s.name].rss,
                      "breakdown": plan.roles[s.name].parts, "host": plan.roles[s.name].host} for s in role_specs(cfg)}
    m = plan.inputs
    return {"fits": not plan.missing, "missing": plan.missing, "roles": roles,
            "policy": {"parameters": param_count(m.policy), "layers": m.policy.layers, "hidden": m.policy.hidden,
                       "vocab": m.policy.vocab, "dtype": cfg.model.dtype},
            "prompt_tokens": m.prompt_tokens, "prompt_tokens_from": m.prompt_note,
            "response_tokens": cfg.rollout.max_new_tokens, "demand": total_demand(plan_groups(cfg)),
            "available": plan.available, "resources_from": plan.source, "gpu_memory_gib": plan.gpu_memory_gib,
            "gpus": [{"phase": phase, "roles": load} for phase, load in gpu_loads(cfg, plan.roles)]}


def render(cfg: Config, plan: Plan) -> str:
    """The plan as a table, then ``fits`` or the missing lines."""
    data = plan_json(cfg, plan)
    p = data["policy"]
    out = [f"policy: {p['parameters'] / 1e6:.1f}M parameters ({p['layers']} layers x {p['hidden']}, "
           f"vocab {p['vocab']}), "
           f"{p['dtype']}; {data['prompt_tokens']} prompt tokens ({data['prompt_tokens_from']}) + "
           f"{data['response_tokens']} response tokens", ""]
    rows = [("role", "actors", "CPU", "GPU", "group", "peak/actor", "breakdown")]
    for role, r in data["roles"].items():
        group = ", ".join(r["groups"]) if len(r["groups"]) < 3 else f"{r['groups'][0]} .. {r['groups'][-1]}"
        parts = ", ".join(f"{k} {_size(v)}" for k, v in r["breakdown"].items())
        parts += f"; host RSS {_size(r['rss_bytes'])}" if r["device"] == "gpu" else ""
        rows.append((role, str(r["actors"]), f"{r['cpus']:g}", f"{r['gpus']:g}", group,
                     f"{_size(r['peak_bytes'])} {'GPU' if r['device'] == 'gpu' else 'RSS'}", parts))
    widths = [max(len(row[i]) for row in rows) for i in range(6)]
    out += ["  ".join(c.ljust(w) for c, w in zip(row, widths)) + "  " + row[6] for row in rows]
    shown = sorted((k, v) for k, v in plan.available.items() if not k.startswith("node:") and "accelerator" not in k)
    have = ", ".join(f"{k} {v / GiB:.1f} GiB" if k == "memory" else f"{k} {v:g}" for k, v in shown)
    need = ", ".join(f"{k} {v:g}" for k, v in sorted(data["demand"].items()))
    rss = sum(n * plan.roles[r].rss for r, n in _counts(cfg).items())
    gpus = [sum(gpu["roles"].values()) for gpu in data["gpus"]]
    out += ["", f"cluster ({plan.source}): {have}", f"needs: {need}, RSS {_size(rss)} in total"
            + (f", busiest GPU {_size(max(gpus))} of {plan.gpu_memory_gib:g} GiB" if gpus else "")]
    return "\n".join(out + (["fits"] if not plan.missing else ["does not fit:"] + [f"  {x}" for x in plan.missing]))


def local_resources(cfg: Config, with_memory: bool = True) -> dict[str, float]:
    """This machine as rayppo's local Ray instance sees it: CPUs (``cluster.num_cpus`` or the
    cores), GPUs (``CUDA_VISIBLE_DEVICES``, else the NVIDIA driver's list), memory (MemTotal)."""
    visible = os.environ.get("CUDA_VISIBLE_DEVICES")
    gpus = (len([d for d in visible.split(",") if d.strip()]) if visible is not None
            else len(list(Path("/proc/driver/nvidia/gpus").glob("*"))))
    out = {"CPU": float(cfg.cluster.num_cpus or os.cpu_count() or 1), "GPU": float(gpus)}
    meminfo = Path("/proc/meminfo")
    if with_memory and meminfo.is_file():
        out["memory"] = float(meminfo.read_text().split("MemTotal:")[1].split()[0]) * 1024
    return out


def accelerator_gib(resources: dict[str, float]) -> float | None:
    """Memory of one GPU from Ray's ``accelerator_type:NAME`` resource, when the name is known."""
    names = [k.split(":", 1)[1] for k in resources if k.startswith("accelerator_type:")]
    return next((float(ACCELERATOR_GIB[n]) for n in names if n in ACCELERATOR_GIB), None)


def cluster_resources(cfg: Config, address: str | None, given: str | None) -> tuple[dict[str, float], str]:
    """``(resources, where from)``: the ``--cluster-resources`` JSON, the Ray cluster at ``address``
    (or ``cluster.address``; only then is Ray imported), or this machine."""
    if given:
        try:
            data = json.loads(given)
        except json.JSONDecodeError as exc:
            raise ConfigError(f"--cluster-resources: not valid JSON ({exc.msg}): {given!r}") from None
        if not isinstance(data, dict) or not all(isinstance(v, (int, float)) for v in data.values()):
            raise ConfigError(f'--cluster-resources: expected an object of numbers like {{"GPU": 8}}, got {given!r}')
        return {k: float(v) for k, v in data.items()}, "--cluster-resources"
    address = address or cfg.cluster.address
    if not address:
        return local_resources(cfg), "this machine"
    import ray

    ray.init(address=address, log_to_driver=False)
    try:
        return dict(ray.cluster_resources()), f"Ray cluster {address}"
    finally:
        ray.shutdown()


def preflight(cfg: Config) -> list[str]:
    """``rayppo train``'s check before anything starts on this machine: the CPU/GPU counts of
    the local Ray instance it would start. With ``cluster.address`` nothing is checked here: the
    driver checks the cluster's counts when it reserves the roles' placement groups (same lines,
    same fixes), after it has joined; joining earlier from a Ray job re-points the job's working
    directory under modules still to be imported. ``rayppo plan --address`` shows memory too."""
    if cfg.cluster.address:
        return []
    return fit_lines(cfg, {}, local_resources(cfg, with_memory=False), None)
