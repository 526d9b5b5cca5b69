"""Reserving resources per role with Ray placement groups, failing fast with what is missing and
the config changes that would make the job fit (computed, and checked against the config's rules)."""

from __future__ import annotations

import copy
import functools
import math
import os
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:  # Ray is imported where groups are made: the plan (``rayppo plan``) needs none
    from ray.util.placement_group import PlacementGroup

from rayppo.cluster.address import chosen_address, refuse_left_over
from rayppo.config.derived import (
    ROLE_SECTIONS,
    reference_actors,
    reward_actors,
    role_gpus,
    teacher_actors,
    tensor_parallel_size,
)
from rayppo.config.schema import Config, ConfigError
from rayppo.errors import RayppoError

COUNT_FIELDS = {"generators": "generators.num", "reference": "reference.num", "reward": "reward.num",
                "teacher": "distill.num", "learner": "learner.num_ranks"}
"""The field that sets how many actors a role has."""
SHARE_FIELDS = {
    "CPU": {"generators": "generators.cpus_per_worker", "reference": "reference.cpus", "reward": "reward.cpus",
            "teacher": "distill.cpus", "learner": "learner.cpus_per_rank"},
    "GPU": {"generators": "generators.gpus_per_worker", "reference": "reference.gpus", "reward": "reward.gpus",
            "teacher": "distill.gpus", "learner": "learner.gpus_per_rank"},
}
"""The field that sets what each actor of a role asks for, per resource."""
CPU_STEP = 0.05
"""Suggested CPU shares are multiples of this: Ray counts to 0.0001, but round shares read better."""


class PlacementError(RayppoError, RuntimeError):
    """The cluster cannot hold the requested roles; the message says what is missing."""


@dataclass
class RoleSpec:
    """``count`` actors of one role, each asking Ray for ``bundle`` (its own resources)."""

    name: str
    count: int
    bundle: dict[str, float]


@dataclass
class GroupPlan:
    """One placement group to create: its bundles, and which actor sits in which bundle."""

    name: str
    bundles: list[dict[str, float]]
    members: list[tuple[str, int, int]] = field(default_factory=list)
    """``(role, actor index, bundle index)``."""
    capture_child_tasks: bool = False
    """Tasks and actors the member starts join the group (vLLM's ray executor places its
    tensor-parallel workers in the generator's group this way)."""


@dataclass
class Placement:
    """Where a role's actors go: actor i sits in bundle ``bundles[i]`` of ``groups[i]``."""

    groups: list[PlacementGroup]
    bundles: list[int]
    bundle: dict[str, float] = field(default_factory=dict)
    capture_child_tasks: bool = False

    def add(self, group: PlacementGroup, bundle: int) -> int:
        """One more actor's place: bundle ``bundle`` of ``group``. Returns the actor's index."""
        self.groups.append(group)
        self.bundles.append(bundle)
        return len(self.groups) - 1

    def actor_options(self, i: int, env: dict[str, str] | None = None) -> dict[str, Any]:
        """Ray actor options for actor ``i`` of the role."""
        from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

        resources = {k: v for k, v in self.bundle.items() if k not in ("CPU", "GPU")}
        options: dict[str, Any] = {
            "num_cpus": self.bundle.get("CPU", 0),
            "num_gpus": self.bundle.get("GPU", 0),
            "scheduling_strategy": PlacementGroupSchedulingStrategy(
                self.groups[i], placement_group_bundle_index=self.bundles[i],
                placement_group_capture_child_tasks=self.capture_child_tasks),
        }
        if resources:
            options["resources"] = resources
        if env:
            options["runtime_env"] = {"env_vars": env}
        return options


def _bundle(cpus: float, gpus: float, extra: dict[str, float]) -> dict[str, float]:
    bundle = {"CPU": float(cpus), **{k: float(v) for k, v in extra.items()}}
    if gpus:
        bundle["GPU"] = float(gpus)
    return bundle


def role_specs(cfg: Config) -> list[RoleSpec]:
    """The resources each role's actors ask for themselves, from the config."""
    g, lrn = cfg.generators, cfg.learner
    # across_nodes: the actor holds no GPU; vLLM's ray executor puts a worker in each bundle.
    gen_gpus = 0.0 if g.tensor_parallel_layout == "across_nodes" else role_gpus(cfg, "generators")
    return [
        RoleSpec("generators", g.num, _bundle(g.cpus_per_worker, gen_gpus, g.resources)),
        RoleSpec("reference", reference_actors(cfg),  # none when ppo.kl_coef = 0
                 _bundle(cfg.reference.cpus, role_gpus(cfg, "reference"), cfg.reference.resources)),
        RoleSpec("reward", reward_actors(cfg), _bundle(cfg.reward.cpus, role_gpus(cfg, "reward"), cfg.reward.resources)),
        *([RoleSpec("teacher", teacher_actors(cfg),  # the role exists only with distill.teacher
                    _bundle(cfg.distill.cpus, role_gpus(cfg, "teacher"), cfg.distill.resources))]
          if teacher_actors(cfg) else []),
        RoleSpec("learner", lrn.num_ranks, _bundle(lrn.cpus_per_rank, role_gpus(cfg, "learner"), lrn.resources)),
    ]


def _add(a: dict[str, float], b: dict[str, float]) -> dict[str, float]:
    return {k: a.get(k, 0.0) + b.get(k, 0.0) for k in {*a, *b}}


def plan_groups(cfg: Config) -> list[GroupPlan]:
    """The placement groups of a job (pure: no Ray), one layout per mode:

    - colocated (``cluster.colocate_all``): one group, one bundle per learner rank holding that
      rank's GPU, the rank, and generator / reference / reward actor i when there is one;
    - tensor parallel across nodes: one group per generator of ``tp`` one-GPU bundles (vLLM's ray
      executor refuses bundles of more than one GPU), the actor's CPUs in bundle 0;
    - otherwise one group per role (reference and reward join the learner's with ``colocate``),
      each actor one bundle of its own resources (a one-node TP generator's bundle holds all
      its GPUs, so they are on one node for vLLM's mp executor)."""
    specs = {s.name: s for s in role_specs(cfg)}
    if cfg.cluster.colocate_all:
        gpu = {"GPU": 1.0} if cfg.learner.gpus_per_rank else {}
        bundles = []
        for i in range(cfg.learner.num_ranks):
            # The bundle holds the GPU once; the actors' fractions of it are Ray's accounting only.
            held = [specs[r].bundle for r in ("learner", "generators", "reference", "reward") if i < specs[r].count]
            bundles.append(functools.reduce(_add, ({k: v for k, v in b.items() if k != "GPU"} for b in held), gpu))
        members = [(r, i, i) for r, s in specs.items() for i in range(s.count)]
        return [GroupPlan("colocated", bundles, members)]
    plans = []
    g = cfg.generators
    if g.tensor_parallel_layout == "across_nodes":
        tp = tensor_parallel_size(g)
        for i in range(g.num):
            first = _add(specs["generators"].bundle, {"GPU": 1.0})
            plans.append(GroupPlan(f"generator-{i}", [first] + [{"GPU": 1.0}] * (tp - 1), [("generators", i, 0)],
                                   capture_child_tasks=True))
    else:
        plans.append(_role_group("generators", [specs["generators"]]))
    scorers = ("reference", "reward", "teacher")
    learner = [specs["learner"]] + ([specs[r] for r in scorers if r in specs] if cfg.cluster.colocate else [])
    plans.append(_role_group("learner", learner))
    if not cfg.cluster.colocate:
        plans += [_role_group(r, [specs[r]]) for r in scorers if r in specs]
    return [plan for plan in plans if plan.bundles]  # a role with no actors (no reference at beta = 0)


def _role_group(name: str, members: list[RoleSpec]) -> GroupPlan:
    plan = GroupPlan(name, [])
    for spec in members:
        for i in range(spec.count):
            plan.members.append((spec.name, i, len(plan.bundles)))
            plan.bundles.append(dict(spec.bundle))
    return plan


def total_demand(plans: list[GroupPlan]) -> dict[str, float]:
    """The resources of every bundle of ``plans``, added up."""
    demand: dict[str, float] = {}
    for plan in plans:
        for bundle in plan.bundles:
            demand = _add(demand, bundle)
    return demand


def requested_resources(cfg: Config) -> dict[str, float]:
    """What the job reserves in total, per resource (``CPU``, ``GPU``, custom names): every role's
    actors times what each asks for, as its placement groups ask Ray for it (colocated: each
    learner rank's GPU once, the roles' CPUs added up). Pure: no Ray. A local Ray instance started
    without ``cluster.num_cpus`` gets at least its ``CPU``, rounded up (a Ray node's resources are
    whole numbers); ``rayppo plan``, the pre-flight check and ``reserve`` compare it with the
    cluster's resources."""
    # Ray counts resources to 0.0001: rounding drops float dust such as 3 x 0.1 = 0.30000000000000004.
    return {k: round(v, 4) for k, v in total_demand(plan_groups(cfg)).items() if v > 0}


def changed(cfg: Config, changes: dict[str, Any]) -> Config | None:
    """A copy of ``cfg`` with ``changes`` (``section.field`` -> value), or None when the config's
    checks refuse it: a suggested fix has to load."""
    from rayppo.config.checks import validate  # it builds on rayppo.config, as load_config imports it

    new = copy.deepcopy(cfg)
    for dotted, value in changes.items():
        section, name = dotted.split(".")
        setattr(getattr(new, section), name, value)
    try:
        return validate(new)
    except ConfigError:
        return None


def _value(v: Any) -> str:
    """A value as an override types it: ``true``, ``null``, ``0.25``, ``{learner_node: 1}``."""
    if v is None:
        return "null"
    if isinstance(v, bool):
        return str(v).lower()
    if isinstance(v, float):
        return f"{v:.4f}".rstrip("0").rstrip(".")
    if isinstance(v, dict):
        return "{" + ", ".join(f"{k}: {_value(x)}" for k, x in v.items()) + "}"
    return str(v)


def override_text(changes: dict[str, Any]) -> str:
    """``generators.num=1 learner.offload=true``: changes as command-line overrides."""
    return " ".join(f"{k}={_value(v)}" for k, v in changes.items())


def shortage_lines(cfg: Config, available: dict[str, float], local: bool) -> list[str]:
    """One line per resource the job reserves more of than ``available`` holds: who asks for it,
    then ``Fix:`` and the changes that would each make it fit. ``local``: ``available`` is the
    local Ray instance rayppo starts (``cluster.num_cpus`` sizes it), not a cluster."""
    specs = role_specs(cfg)
    lines = []
    for key, need in sorted(requested_resources(cfg).items()):
        have = available.get(key, 0.0)
        if need > have + 1e-9:
            users = ", ".join(f"{s.name} {s.count} x {_asks(cfg, s, key):g}" for s in specs
                              if s.count and _asks(cfg, s, key))
            lines.append(f"{key}: need {need:g} ({users or 'bundles'}), cluster has {have:g}. "
                         f"Fix: {', or '.join(capacity_fixes(cfg, key, have, local))}")
    return lines


def capacity_fixes(cfg: Config, key: str, have: float, local: bool) -> list[str]:
    """What makes the job's ``key`` fit in ``have``: more of it, smaller shares, fewer actors, or
    (a custom resource) no actor asking for it. Every override listed passes the config's checks."""
    fixes = [_more(cfg, key, have, local)]
    shares = smaller_shares(cfg, key, have)
    if shares:
        fixes.append(f"smaller {key} shares: {override_text(shares)}")
    fewer = fewer_actors(cfg, lambda c: _holds(c, key, have), lambda s: s.count * _asks(cfg, s, key))
    if fewer:
        fixes.append(f"fewer actors: {override_text(fewer)}")
    if key == "GPU" and have < 1:  # no GPU to share: the roles could still run on CPUs
        cpus = {f: 0.0 for f in SHARE_FIELDS["GPU"].values() if _get(cfg, f) > 0}
        candidate = changed(cfg, cpus)
        if candidate is not None and _holds(candidate, key, have):
            fixes.append(f"CPUs only: {override_text(cpus)}")
    if key not in ("CPU", "GPU"):
        sections = {s.name: ROLE_SECTIONS[s.name] for s in role_specs(cfg)}  # the teacher's is distill
        unasked = {f"{sections[s.name]}.resources": {k: v for k, v in getattr(cfg, sections[s.name]).resources.items()
                                                      if k != key}
                   for s in role_specs(cfg) if s.bundle.get(key)}
        fixes.append(f"no actor asking for it: {override_text(unasked)}")
    return fixes


def _more(cfg: Config, key: str, have: float, local: bool) -> str:
    """The fix that adds what is missing: the local instance's ``cluster.num_cpus`` (Ray's CPUs are
    reservations, not pinned cores), else a cluster with more."""
    need = requested_resources(cfg)[key]
    if key == "CPU" and local:  # a Ray node's resources are whole numbers: ray.init refuses num_cpus=2.5
        unset = ", or cluster.num_cpus=null (sized to what the roles reserve)" if cfg.cluster.num_cpus else ""
        return (f"cluster.num_cpus={math.ceil(need - 1e-9)} (oversubscribing this machine is fine: the stages of an "
                f"iteration take turns){unset}")
    if local and key == "GPU":
        return f"a machine with {need:g} GPU{'' if need == 1 else 's'}, or a Ray cluster with them (cluster.address)"
    if local:
        return f"a Ray cluster whose nodes offer {need:g} {key} (cluster.address: a local instance has none)"
    short = round(need - have, 4)
    if key in ("CPU", "GPU"):
        return f"{short:g} more {key}{'' if short == 1 else 's'} (add nodes to the cluster)"
    return f"{short:g} more {key} (add nodes started with ray start --resources '{{\"{key}\": N}}')"


def _get(cfg: Config, dotted: str) -> Any:
    section, name = dotted.split(".")
    return getattr(getattr(cfg, section), name)


def _asks(cfg: Config, spec: RoleSpec, key: str) -> float:
    """What each actor of ``spec`` reserves of ``key``, counting the GPUs a generator's placement
    group holds for vLLM's workers across nodes (its own bundle has none)."""
    if key == "GPU" and spec.name == "generators" and cfg.generators.tensor_parallel_layout == "across_nodes":
        return float(tensor_parallel_size(cfg.generators))
    return spec.bundle.get(key, 0.0)


def _holds(cfg: Config, key: str, have: float) -> bool:
    return requested_resources(cfg).get(key, 0.0) <= have + 1e-9


def _shareable(cfg: Config, key: str) -> dict[str, tuple[int, float]]:
    """``field -> (actors, share)`` of the per-actor asks for ``key`` that may shrink: every CPU
    share; GPU shares a role may split (at most one GPU, not colocated, a fraction only for a
    single learner rank: NCCL refuses two ranks on one GPU)."""
    out = {}
    for spec in role_specs(cfg):
        name = SHARE_FIELDS.get(key, {}).get(spec.name)
        share = spec.bundle.get(key, 0.0)
        if name is None or share <= 0 or not spec.count:  # a role with no actors (no teacher) asks nothing
            continue
        if key == "GPU" and (cfg.cluster.colocate_all or share > 1 or (spec.name == "learner" and spec.count > 1)):
            continue
        out[name] = (spec.count, share)
    return out


def smaller_shares(cfg: Config, key: str, have: float) -> dict[str, float] | None:
    """Per-actor asks for ``key`` (CPU or GPU) that fit in ``have``, or None. CPUs: every share
    scaled down alike, in steps of ``CPU_STEP``. GPUs: the roles that may share one get equal
    ``1/k`` shares (they pack whole GPUs, as Ray needs)."""
    fields = _shareable(cfg, key)
    asked = sum(n * share for n, share in fields.values())
    budget = have - (requested_resources(cfg).get(key, 0.0) - asked)  # what is left for those fields
    if not fields or budget <= 0:
        return None
    if key == "CPU":
        scale = budget / asked
        new = {f: round(max(1, math.floor(share * scale / CPU_STEP + 1e-9)) * CPU_STEP, 4)
               for f, (_, share) in fields.items()}
    else:
        gpus = math.floor(budget + 1e-9)
        k = math.ceil(sum(n for n, _ in fields.values()) / gpus) if gpus else 0
        new = {f: min(share, round(1 / k, 4)) for f, (_, share) in fields.items()} if k else {}
    changes = {f: v for f, v in new.items() if v != fields[f][1]}
    if not changes:
        return None
    candidate = changed(cfg, changes)
    return changes if candidate is not None and _holds(candidate, key, have) else None


def fewer_actors(cfg: Config, fits: Callable[[Config], bool],
                 weight: Callable[[RoleSpec], float]) -> dict[str, int] | None:
    """Actor counts that make ``fits`` true, or None: one actor less at a time of the role that
    weighs most (of equals the first of generators, reference, reward, learner: fewer learner
    ranks mean larger ZeRO shards), skipping a step the config's checks refuse."""
    changes: dict[str, int] = {}
    current, refused = cfg, set()
    while not fits(current):
        specs = [s for s in role_specs(current) if s.count > 1 and s.name not in refused and weight(s) > 0]
        if not specs:
            return None
        spec = max(specs, key=weight)  # max keeps the first of equals
        trial = {**changes, COUNT_FIELDS[spec.name]: spec.count - 1}
        candidate = changed(cfg, trial)
        if candidate is None:  # e.g. colocated: a generator per learner rank at most
            refused.add(spec.name)
        else:
            changes, current, refused = trial, candidate, set()
    return changes or None


def check_capacity(cfg: Config, available: dict[str, float]) -> None:
    """Raise ``PlacementError`` naming every resource the cluster lacks and how to fit the job,
    before anything waits."""
    missing = shortage_lines(cfg, available, local=not chosen_address(cfg.cluster.address))
    if missing:
        raise PlacementError("the Ray cluster cannot hold this job: " + "; ".join(missing))


def reserve(cfg: Config) -> dict[str, Placement]:
    """Create the placement groups of ``plan_groups`` and wait until they are ready."""
    import ray
    from ray.util.placement_group import placement_group, remove_placement_group

    plans = plan_groups(cfg)
    check_capacity(cfg, ray.cluster_resources())
    specs = {s.name: s for s in role_specs(cfg)}
    placements = {name: Placement([], [], spec.bundle) for name, spec in specs.items()}
    created: list[PlacementGroup] = []
    for plan in plans:
        pg = placement_group(plan.bundles, strategy="PACK", name=f"rayppo-{plan.name}")
        created.append(pg)
        for role, _, bundle_index in sorted(plan.members, key=lambda m: (m[0], m[1])):
            placements[role].groups.append(pg)
            placements[role].bundles.append(bundle_index)
            placements[role].capture_child_tasks |= plan.capture_child_tasks
    ready, _ = ray.wait([pg.ready() for pg in created], num_returns=len(created), timeout=cfg.cluster.placement_timeout_s)
    if len(ready) < len(created):
        for pg in created:
            remove_placement_group(pg)
        raise PlacementError(
            f"placement groups not ready after {cfg.cluster.placement_timeout_s:g} s: the cluster has the "
            f"resources in total ({total_demand(plans)}) but no nodes can hold the bundles as requested"
        )
    return placements


def room_for_generators(cfg: Config, count: int) -> bool:
    """Whether the cluster has ``count`` more generators' resources free now (in total: a node
    may still lack room for a bundle, which then waits for a place)."""
    import ray

    more = copy.deepcopy(cfg)
    more.generators.num = count
    demand = total_demand([plan for plan in plan_groups(more)
                           if any(role == "generators" for role, _, _ in plan.members)])
    free = ray.available_resources()
    return all(need <= free.get(key, 0.0) + 1e-9 for key, need in demand.items() if need > 0)


def reserve_generators(cfg: Config, count: int) -> list[tuple[PlacementGroup, int]]:
    """Placement groups for ``count`` more generators, laid out as ``plan_groups`` lays out the
    first ones (a group of one bundle per generator; across nodes, a group of one-GPU bundles per
    generator). Not waited for: Ray places them when the cluster has room. Returns each new
    generator's (group, bundle). Not in colocated mode, where generators sit in the learner's bundles."""
    from ray.util.placement_group import placement_group

    if cfg.cluster.colocate_all:
        raise PlacementError("colocated mode (cluster.colocate_all) puts each generator in a learner rank's bundle: "
                             "more generators need a restart with more learner ranks")
    more = copy.deepcopy(cfg)
    more.generators.num = count
    slots = []
    for plan in plan_groups(more):
        members = [(i, bundle) for role, i, bundle in plan.members if role == "generators"]
        if members:  # a group that holds generators holds nothing else outside colocated mode
            pg = placement_group(plan.bundles, strategy="PACK", name=f"rayppo-more-{plan.name}")
            slots += [(i, pg, bundle) for i, bundle in members]
    return [(pg, bundle) for _, pg, bundle in sorted(slots, key=lambda slot: slot[0])]


def reserve_learner(cfg: Config) -> Placement:
    """A placement group of the learner's ranks alone (one bundle each, packed), waited for: a
    job that runs no other role (``rayppo reward-model``)."""
    import ray
    from ray.util.placement_group import placement_group, remove_placement_group

    spec = next(s for s in role_specs(cfg) if s.name == "learner")
    pg = placement_group([spec.bundle] * spec.count, strategy="PACK", name="rayppo-learner")
    ready, _ = ray.wait([pg.ready()], timeout=cfg.cluster.placement_timeout_s)
    if not ready:
        remove_placement_group(pg)
        raise PlacementError(f"the learner's {spec.count} bundles of {spec.bundle} were not placed within "
                             f"cluster.placement_timeout_s={cfg.cluster.placement_timeout_s:g} s")
    return Placement([pg] * spec.count, list(range(spec.count)), spec.bundle)


def release(placements: dict[str, Placement]) -> None:
    from ray.util.placement_group import remove_placement_group

    for pg in {id(g): g for p in placements.values() for g in p.groups}.values():
        remove_placement_group(pg)


def bundle_placed(placement: Placement, i: int) -> bool:
    """Whether actor ``i``'s bundle is on a live node. After a node is lost Ray places its bundles
    again once a node has room; until then they have none."""
    import ray
    from ray.util import placement_group_table

    node = placement_group_table(placement.groups[i])["bundles_to_node_id"].get(placement.bundles[i], "")
    return bool(node) and any(n["NodeID"] == node and n["Alive"] for n in ray.nodes())


def placement_report(placements: dict[str, Placement]) -> dict[str, Any]:
    """Which node holds each actor of each role, and what each node offers (placement.json)."""
    import ray
    from ray.util import placement_group_table

    nodes = {n["NodeID"]: {"address": n["NodeManagerAddress"], "resources": n["Resources"]}
             for n in ray.nodes() if n["Alive"]}
    roles = {}
    for role, p in placements.items():
        roles[role] = [placement_group_table(g)["bundles_to_node_id"].get(i, "") for g, i in zip(p.groups, p.bundles)]
    return {"roles": roles, "nodes": nodes}


MAX_OVERSUBSCRIPTION = 4
"""A local instance nobody sized counts at most this many logical CPUs per core."""


def local_cpus(cpus_asked: float) -> float:
    """Logical CPUs of a local Ray instance nobody sized (``cluster.num_cpus`` unset): the
    machine's cores, or what the roles reserve (rounded up: Ray starts with whole CPUs) when
    that is more, up to ``MAX_OVERSUBSCRIPTION`` per core. Ray's CPUs are reservations, not
    pinned cores: on a 2-core laptop a job whose roles reserve 2.5 runs fine, its generate,
    score and learn stages taking turns; one reserving 30 is refused with the fixes."""
    cores = os.cpu_count() or 1
    return float(max(cores, min(math.ceil(cpus_asked - 1e-9), MAX_OVERSUBSCRIPTION * cores)))



def running_cluster_resources(address: str) -> dict[str, float]:
    """The resources of the Ray cluster at ``address``: joined for the question, then left
    (Ray is imported only here, so ``rayppo plan`` without an address never loads it)."""
    import ray

    refuse_left_over(address)
    ray.init(address=address, log_to_driver=False)
    try:
        return dict(ray.cluster_resources())
    finally:
        ray.shutdown()
