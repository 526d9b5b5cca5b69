"""``rayppo plan``: will a job fit? Per role: actors, CPUs/GPUs, placement group, peak memory.

The memory per actor comes from ``rayppo.plan.footprint`` (json + math), the placement groups and
what they reserve (``requested_resources``) from ``rayppo.cluster.placement`` (pure: Ray is
imported only where groups are made). The fit check compares that demand with the cluster's
resources, each GPU's memory with the device's (actors sharing a GPU add up; in colocated mode
the worst of the generate, score and learn phases), and the total RSS with the cluster's
``memory``. Every shortage ends with the config changes that fix it, each one checked by running
this check again on the changed config. ``rayppo train`` runs the check on the resource counts it
knows before anything starts (``preflight``).
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from rayppo.cluster.address import chosen_address, machine_cores
from rayppo.cluster.placement import (
    changed,
    fewer_actors,
    local_cpus,
    override_text,
    plan_groups,
    requested_resources,
    role_specs,
    running_cluster_resources,
    shortage_lines,
)
from rayppo.config.derived import (
    ROLE_SECTIONS,
    batch_rows,
    reference_actors,
    reward_actors,
    role_gpus,
    role_threads,
    teacher_actors,
    tensor_parallel_size,
    vllm_memory_utilization,
)
from rayppo.config.schema import Config, ConfigError
from rayppo.models.shape import param_count
from rayppo.plan.footprint import Estimate, GiB, Inputs, estimates, inputs
from rayppo.plan.layout import learner_layout_advice, reference_note, size_text, threads_line

ROLES = ("generators", "reference", "reward", "teacher", "learner")
ACCELERATOR_MIB = {"H200": 143771, "H100": 81559, "A100-80G": 81920, "A100-40G": 40960, "L40S": 46068, "L4": 23034,
                   "A10G": 23028, "T4": 15360}
"""Usable memory of one GPU of Ray's ``accelerator_type:NAME`` resources (unambiguous names only):
the total the driver reports with ECC on (``nvidia-smi --query-gpu=memory.total``, equal to the
total of ``torch.cuda.mem_get_info()``), not the marketing capacity (an "80 GB" H100 has 79.6
GiB, a "48 GB" L40S 45.0). Measure a node's with ``python -c "import torch;
print(torch.cuda.mem_get_info()[1] / 2**30)"`` and pass it as ``--gpu-memory-gib``."""


def _roles(cfg: Config) -> list[str]:
    """``ROLES`` of this job: the teacher only with ``distill.teacher``."""
    return [role for role in ROLES if role != "teacher" or teacher_actors(cfg)]


def _counts(cfg: Config) -> dict[str, int]:
    counts = {"generators": cfg.generators.num, "reference": reference_actors(cfg), "reward": reward_actors(cfg),
              "teacher": teacher_actors(cfg), "learner": cfg.learner.num_ranks}
    return {role: counts[role] for role in _roles(cfg)}


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
            phases = {name: {r: est[r].peak if r in roles else est[r].resident for r in _roles(cfg) if i < counts[r]}
                      for name, roles in busy.items()}
            loads.append(max(phases.items(), key=lambda item: sum(item[1].values())))
        return loads
    loads, shares = [], []
    for role in _roles(cfg):
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

THIS_MACHINE = "this machine"
"""``cluster_resources``'s source for the local Ray instance a job without ``cluster.address`` starts."""


@dataclass
class Target:
    """What a job is checked against."""

    available: dict[str, float]
    """Resource counts, and ``memory`` (bytes) when host memory is to be checked."""
    gpu_memory_gib: float | None = None
    """Memory of one GPU; None leaves GPU memory unchecked."""
    local: bool = False
    """``available`` is the local Ray instance rayppo would start (``cluster.num_cpus`` sizes it)."""
    prompt_tokens: int | None = None
    """P of the memory estimates (None: as ``footprint.inputs`` picks it)."""

    @property
    def checks_memory(self) -> bool:
        return bool(self.gpu_memory_gib) or "memory" in self.available

    def inputs(self, cfg: Config) -> Inputs:
        return inputs(cfg, self.prompt_tokens, self.gpu_memory_gib or 80.0)


@dataclass
class Shortage:
    """A memory line before its fixes."""

    kind: str
    """``GPU memory`` (one GPU's) or ``memory`` (host RSS, all actors)."""
    roles: list[str]
    """The roles it adds up, the one that takes the most first: the ones to shrink."""
    text: str

    @property
    def key(self) -> tuple[str, str]:
        return self.kind, self.roles[0]


def fit_lines(cfg: Config, target: Target) -> list[str]:
    """One line per missing thing, ending with ``Fix:`` and the changes that would each make it fit.
    Counts (CPU, GPU, custom resources) are always checked; host memory when ``target.available``
    has ``memory``, GPU memory when ``target.gpu_memory_gib`` is given."""
    lines = shortage_lines(cfg, target.available, target.local)
    if not target.checks_memory:
        return lines
    est = estimates(cfg, target.inputs(cfg))
    if target.gpu_memory_gib:
        lines += [p for e in est.values() for p in e.problems]
    before = _problems(cfg, target)
    for short in _memory_shortages(cfg, est, target):
        lines.append(f"{short.text}. Fix: {', or '.join(_memory_fixes(cfg, est, target, short, before))}")
    return lines


def _problems(cfg: Config, target: Target) -> set[tuple[str, str]]:
    """What does not fit, as ``(resource, role)``: ``fit_lines`` without the words, to tell
    whether a change fixed a line without breaking anything else."""
    have = target.available
    keys = {(k, "") for k, need in requested_resources(cfg).items() if need > have.get(k, 0.0) + 1e-9}
    if target.checks_memory:
        est = estimates(cfg, target.inputs(cfg))
        keys |= {short.key for short in _memory_shortages(cfg, est, target)}
        if target.gpu_memory_gib:
            keys |= {("problem", role) for role, e in est.items() if e.problems}
    return keys


def _memory_shortages(cfg: Config, est: dict[str, Estimate], target: Target) -> list[Shortage]:
    out = _gpu_memory_shortages(cfg, est, target.gpu_memory_gib) if target.gpu_memory_gib else []
    if "memory" in target.available and est:
        need = sum(n * est[r].rss for r, n in _counts(cfg).items())
        if need > target.available["memory"]:
            roles = sorted(_roles(cfg), key=lambda r: -_counts(cfg)[r] * est[r].rss)
            worst = roles[0]
            out.append(Shortage("memory", roles, f"memory: need {need / GiB:.1f} GiB of RSS in total, cluster has "
                                f"{target.available['memory'] / GiB:.1f} GiB (the {worst} take the most)"))
    return out


def _gpu_memory_shortages(cfg: Config, est: dict[str, Estimate], gpu_memory_gib: float) -> list[Shortage]:
    over: dict[tuple, list[int]] = {}  # identical GPUs share one line
    for i, (phase, load) in enumerate(gpu_loads(cfg, est)):
        if sum(load.values()) > gpu_memory_gib * GiB:
            over.setdefault((phase, *((r, round(b / GiB, 1)) for r, b in load.items())), []).append(i)
    out = []
    for (phase, *shares), gpus in over.items():  # shares: (role, GiB) pairs
        which = f"GPU {gpus[0]} needs" if len(gpus) == 1 else f"{len(gpus)} GPUs need"
        roles = [r for r, _ in sorted(shares, key=lambda role_gib: -role_gib[1])]
        out.append(Shortage("GPU memory", roles, f"GPU memory: {which} {sum(b for _, b in shares):.1f} GiB ({phase}: "
                            f"{' + '.join(f'{r} {b:g}' for r, b in shares)}), the device has {gpu_memory_gib:g} GiB"))
    return out


def _memory_fixes(cfg: Config, est: dict[str, Estimate], target: Target, short: Shortage,
                  before: set[tuple[str, str]]) -> list[str]:
    """Overrides that each make ``short`` go away with nothing else running short: up to three
    single changes (the first value that works of each field), else the options together in order
    until they do; for host memory also fewer actors; else what the config cannot do."""
    goal = before - {short.key}

    def fixes_it(candidate: Config | None) -> bool:
        return candidate is not None and _problems(candidate, target) <= goal

    options = [option for role in short.roles for option in _memory_options(cfg, role, short.kind == "GPU memory")]
    found: list[dict[str, Any]] = []
    for option in options:
        if len(found) < 3 and not any(set(option) & set(f) for f in found) and fixes_it(changed(cfg, option)):
            found.append(option)
    together: dict[str, Any] = {}
    for option in options if not found else []:
        together = {**together, **option}
        if fixes_it(changed(cfg, together)):
            found.append(together)
            break
    fixes = [override_text(f) for f in found]
    if short.kind == "memory":
        fewer = fewer_actors(cfg, fixes_it, lambda s: s.count * est[s.name].rss)
        fixes += [f"fewer actors: {override_text(fewer)}"] if fewer else []
    if fixes:
        return fixes
    if short.kind == "memory":
        return ["a machine with more memory" if target.local else "nodes with more memory"]
    return [f"GPUs with more than {target.gpu_memory_gib:g} GiB, or a smaller model (the config's memory options "
            "are not enough)"]


def _memory_options(cfg: Config, role: str, on_gpu: bool) -> list[dict[str, Any]]:
    """Changes that shrink the GPU memory (``on_gpu``) or RSS of each actor of ``role``, in the order
    to try them (the mildest first)."""
    lr = cfg.learner
    if role == "learner":
        options: list[dict[str, Any]] = [] if lr.gradient_checkpointing else [{"learner.gradient_checkpointing": True}]
        options += [{"learner.zero_stage": 3}] if lr.zero_stage < 3 else []
        options += [{"learner.offload": True}] if on_gpu and not lr.offload else []  # to host memory: not for RSS
        b, m = batch_rows(cfg), cfg.ppo.minibatches
        return options + [{"ppo.minibatches": d} for d in range(m + 1, b + 1) if b % d == 0]
    if role == "generators" and on_gpu:  # vLLM's share of the GPU, in steps of 0.05
        steps = int(vllm_memory_utilization(cfg) / 0.05 - 1e-9)
        return [{"generators.gpu_memory_utilization": round(k * 0.05, 2)} for k in range(steps, 1, -1)]
    if role == "generators":  # vLLM on CPU: its KV cache, whole GiB (VLLM_CPU_KVCACHE_SPACE)
        return [{"generators.kv_cache_gib": float(k)} for k in range(int(cfg.generators.kv_cache_gib) - 1, 0, -1)]
    scorer = getattr(cfg, ROLE_SECTIONS[role])  # cfg.reference, .reward, .distill
    options = [{f"{ROLE_SECTIONS[role]}.gpus": 1.0}] if on_gpu and 0 < scorer.gpus < 1 else []  # a GPU of its own
    if role == "reward":
        size = cfg.reward.batch_size
        options += [{"reward.batch_size": size >> k} for k in range(1, size.bit_length())]
    return options


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
    advice: list[str] = field(default_factory=list)
    """What fits but is probably not meant (``advice``)."""


def make_plan(cfg: Config, available: dict[str, float], source: str, gpu_memory_gib: float = 80.0,
              prompt_tokens: int | None = None) -> Plan:
    """The plan of ``cfg`` on ``available`` (from ``source``: ``THIS_MACHINE`` is the local Ray
    instance rayppo would start, whose CPUs ``cluster.num_cpus`` sets)."""
    target = Target(available, gpu_memory_gib, source == THIS_MACHINE, prompt_tokens)
    m = target.inputs(cfg)
    cores = machine_cores(cfg.cluster.address) if source == THIS_MACHINE else None
    return Plan(m, estimates(cfg, m), available, gpu_memory_gib, source, fit_lines(cfg, target),
                advice(cfg, m, available) + learner_layout_advice(cfg, m, cores))


BILLION = 1e9


def advice(cfg: Config, m: Inputs, available: dict[str, float]) -> list[str]:
    """Lines about a job that fits but is probably not the one meant: a policy of billions of
    parameters in fp32 on GPUs (bf16 halves weights, gradients and activations), a model role left
    on CPU while the cluster's GPUs stay free, lengths the plan could not take from the job."""
    out = []
    on_gpus = any(role_gpus(cfg, role) > 0 for role in _roles(cfg))
    params = param_count(m.policy)
    if cfg.model.dtype == "float32" and params >= BILLION and on_gpus:
        out.append(f"model.dtype=float32 for a {params / BILLION:.1f}B-parameter policy on GPUs: bfloat16 halves its "
                   "weights, gradients and activations (model.dtype=bfloat16)")
    free = available.get("GPU", 0.0) - requested_resources(cfg).get("GPU", 0.0)
    if free >= 1 and not cfg.cluster.colocate_all:
        counts = _counts(cfg)
        holds_a_model = {"generators": True, "reference": True, "reward": cfg.reward.model is not None,
                         "teacher": True, "learner": True}
        for role in _roles(cfg):
            if counts[role] and holds_a_model[role] and role_gpus(cfg, role) == 0:
                field_name = {"generators": "generators.gpus_per_worker", "learner": "learner.gpus_per_rank"}.get(
                    role, f"{ROLE_SECTIONS[role]}.gpus")
                out.append(f"{role} run{'s' if counts[role] == 1 else ''} on CPU while {free:g} GPU"
                           f"{'s' if free != 1 else ''} stay free ({field_name}=1)")
    if m.prompt_note.startswith("upper bound"):
        out.append(f"planned for {m.prompt_tokens} prompt tokens, the longest the context allows: give --prompt-tokens "
                   "or data.prompts for the job's own lengths")
    return out


def plan_json(cfg: Config, plan: Plan) -> dict[str, Any]:
    """The plan as plain data (``rayppo plan --json``); sizes in bytes."""
    groups: dict[str, list[str]] = {}
    for group in plan_groups(cfg):
        for role in dict.fromkeys(role for role, _, _ in group.members):
            groups.setdefault(role, []).append(group.name)
    est = plan.roles
    cores = machine_cores(cfg.cluster.address) if plan.source == THIS_MACHINE else None
    roles = {s.name: {"actors": s.count, "cpus": s.bundle.get("CPU", 0.0), "gpus": s.bundle.get("GPU", 0.0),
                      "threads": role_threads(cfg, s.name, cores),
                      "groups": groups.get(s.name, []), "device": est[s.name].device,
                      "peak_bytes": est[s.name].peak, "rss_bytes": est[s.name].rss,
                      "breakdown": est[s.name].parts, "host": est[s.name].host,
                      **({"kv_cache_batch_bytes": est[s.name].kv_cache} if est[s.name].kv_cache else {})}
             for s in role_specs(cfg) if s.name in est}
    m = plan.inputs
    return {"fits": not plan.missing, "missing": plan.missing, "roles": roles,
            "policy": {"parameters": param_count(m.policy), "layers": m.policy.layers, "hidden": m.policy.hidden,
                       "vocab": m.policy.vocab, "dtype": cfg.model.dtype},
            "prompt_tokens": m.prompt_tokens, "prompt_tokens_from": m.prompt_note,
            "response_tokens": cfg.rollout.max_new_tokens, "demand": requested_resources(cfg),
            "advice": plan.advice,
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
    rows = [("role", "actors", "CPU", "GPU", "threads", "group", "peak/actor", "breakdown")]
    for role, r in data["roles"].items():
        group = ", ".join(r["groups"]) if len(r["groups"]) < 3 else f"{r['groups'][0]} .. {r['groups'][-1]}"
        parts = ", ".join(f"{k} {size_text(v)}" for k, v in r["breakdown"].items())
        parts += f"; host RSS {size_text(r['rss_bytes'])}" if r["device"] == "gpu" else ""
        rows.append((role, str(r["actors"]), f"{r['cpus']:g}", f"{r['gpus']:g}", str(r["threads"]), group,
                     f"{size_text(r['peak_bytes'])} {'GPU' if r['device'] == 'gpu' else 'RSS'}", parts))
    widths = [max(len(row[i]) for row in rows) for i in range(7)]
    out += ["  ".join(c.ljust(w) for c, w in zip(row, widths)) + "  " + row[7] for row in rows]
    shown = sorted((k, v) for k, v in plan.available.items() if not k.startswith("node:") and "accelerator" not in k)
    have = ", ".join(f"{k} {v / GiB:.1f} GiB" if k == "memory" else f"{k} {v:g}" for k, v in shown)
    need = ", ".join(f"{k} {v:g}" for k, v in sorted(data["demand"].items()))
    rss = sum(n * plan.roles[r].rss for r, n in _counts(cfg).items())
    gpus = [sum(gpu["roles"].values()) for gpu in data["gpus"]]
    source = f"{plan.source}, {os.cpu_count() or 1} cores" if plan.source == THIS_MACHINE else plan.source
    out += ["", f"cluster ({source}): {have}", f"needs: {need}, RSS {size_text(rss)} in total"
            + (f", busiest GPU {size_text(max(gpus))} of {plan.gpu_memory_gib:g} GiB" if gpus else "")]
    out += [threads_line(cfg, plan.source == THIS_MACHINE)] + reference_note(cfg, plan.roles)
    out += [f"note: {line}" for line in plan.advice]
    return "\n".join(out + (["fits"] if not plan.missing else ["does not fit:"] + [f"  {x}" for x in plan.missing]))


def local_resources(cfg: Config, with_memory: bool = True) -> dict[str, float]:
    """This machine as rayppo's local Ray instance sees it: CPUs (``cluster.num_cpus``, else the
    cores or what the roles reserve, rounded up, when that is more), GPUs
    (``CUDA_VISIBLE_DEVICES``, else the NVIDIA driver's list), memory (MemTotal)."""
    visible = os.environ.get("CUDA_VISIBLE_DEVICES")
    gpus = (len([d for d in visible.split(",") if d.strip()]) if visible is not None
            else len(list(Path("/proc/driver/nvidia/gpus").glob("*"))))
    cpus = cfg.cluster.num_cpus or local_cpus(requested_resources(cfg).get("CPU", 0.0))
    out = {"CPU": float(cpus), "GPU": float(gpus)}
    meminfo = Path("/proc/meminfo")
    if with_memory and meminfo.is_file():
        out["memory"] = float(meminfo.read_text().split("MemTotal:")[1].split()[0]) * 1024
    return out


def accelerator_gib(resources: dict[str, float]) -> float | None:
    """Usable memory (GiB) of one GPU from Ray's ``accelerator_type:NAME`` resource, when the name is known."""
    names = [k.split(":", 1)[1] for k in resources if k.startswith("accelerator_type:")]
    return next((ACCELERATOR_MIB[n] / 1024 for n in names if n in ACCELERATOR_MIB), None)


def cluster_resources(cfg: Config, address: str | None, given: str | None) -> tuple[dict[str, float], str]:
    """``(resources, where from)``: the ``--cluster-resources`` JSON, the Ray cluster at ``address``
    (or ``cluster.address``, else ``$RAY_ADDRESS``, as ``rayppo train`` joins: ``chosen_address``;
    only then is Ray imported), or this machine."""
    if given:
        try:
            data = json.loads(given)
        except json.JSONDecodeError as exc:
            raise ConfigError(f"--cluster-resources: not valid JSON ({exc.msg}): {given!r}") from None
        if not isinstance(data, dict) or not all(isinstance(v, (int, float)) for v in data.values()):
            raise ConfigError(f'--cluster-resources: expected an object of numbers like {{"GPU": 8}}, got {given!r}')
        return {k: float(v) for k, v in data.items()}, "--cluster-resources"
    address = address or chosen_address(cfg.cluster.address)
    if not address:
        return local_resources(cfg), THIS_MACHINE
    return running_cluster_resources(address), f"Ray cluster {address}"


def preflight(cfg: Config) -> list[str]:
    """``rayppo train``'s check before anything starts on this machine: the CPU/GPU counts of
    the local Ray instance it would start (its CPUs fall short only when ``cluster.num_cpus`` is
    set below what the roles reserve). With a cluster to join (``cluster.address``, else
    ``$RAY_ADDRESS``: ``chosen_address``) nothing is checked here: the driver checks the cluster's
    counts when it reserves the roles' placement groups (same lines, same fixes), after it has
    joined; joining earlier from a Ray job re-points the job's working directory under modules
    still to be imported. ``rayppo plan --address`` shows memory too."""
    if chosen_address(cfg.cluster.address):
        return []
    return fit_lines(cfg, Target(local_resources(cfg, with_memory=False), local=True))
