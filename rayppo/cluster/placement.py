"""Reserving resources per role with Ray placement groups, failing fast with what is missing."""

from __future__ import annotations

import functools
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:  # Ray is imported where groups are made: the plan (``rayppo plan``) needs none
    from ray.util.placement_group import PlacementGroup

from rayppo.config import Config, role_gpus, tensor_parallel_size
from rayppo.errors import RayppoError


FIXES = {  # what to change when the cluster lacks a resource (also ``rayppo plan``'s advice)
    "CPU": "fewer or smaller actors (generators.num, generators.cpus_per_worker, reference.cpus, reward.cpus, "
           "learner.num_ranks, learner.cpus_per_rank) or more CPUs (cluster.num_cpus on one machine)",
    "GPU": "fewer generators (generators.num) or smaller shares (generators.gpus_per_worker, learner.gpus_per_rank, "
           "reference.gpus, reward.gpus), or fewer learner ranks (learner.num_ranks)",
}

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
    g, l = cfg.generators, cfg.learner
    # across_nodes: the actor holds no GPU; vLLM's ray executor puts a worker in each bundle.
    gen_gpus = 0.0 if g.tensor_parallel_layout == "across_nodes" else role_gpus(cfg, "generators")
    return [
        RoleSpec("generators", g.num, _bundle(g.cpus_per_worker, gen_gpus, g.resources)),
        RoleSpec("reference", cfg.reference.num,
                 _bundle(cfg.reference.cpus, role_gpus(cfg, "reference"), cfg.reference.resources)),
        RoleSpec("reward", cfg.reward.num, _bundle(cfg.reward.cpus, role_gpus(cfg, "reward"), cfg.reward.resources)),
        RoleSpec("learner", l.num_ranks, _bundle(l.cpus_per_rank, role_gpus(cfg, "learner"), l.resources)),
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
    learner = [specs["learner"]] + ([specs["reference"], specs["reward"]] if cfg.cluster.colocate else [])
    plans.append(_role_group("learner", learner))
    if not cfg.cluster.colocate:
        plans += [_role_group("reference", [specs["reference"]]), _role_group("reward", [specs["reward"]])]
    return plans


def _role_group(name: str, members: list[RoleSpec]) -> GroupPlan:
    plan = GroupPlan(name, [])
    for spec in members:
        for i in range(spec.count):
            plan.members.append((spec.name, i, len(plan.bundles)))
            plan.bundles.append(dict(spec.bundle))
    return plan


def total_demand(plans: list[GroupPlan]) -> dict[str, float]:
    demand: dict[str, float] = {}
    for plan in plans:
        for bundle in plan.bundles:
            demand = _add(demand, bundle)
    return demand


def check_capacity(cfg: Config, plans: list[GroupPlan], available: dict[str, float]) -> None:
    """Raise ``PlacementError`` naming every resource the cluster lacks, before anything waits."""
    specs = role_specs(cfg)
    missing = []
    for key, need in sorted(total_demand(plans).items()):
        have = available.get(key, 0.0)
        if need > have + 1e-9:
            users = ", ".join(f"{s.name} {s.count} x {s.bundle[key]:g}" for s in specs if s.bundle.get(key))
            fix = FIXES.get(key, "a cluster that has it, or no actor asking for it (*.resources)")
            missing.append(f"{key}: need {need:g} ({users or 'bundles'}), cluster has {have:g}: {fix}")
    if missing:
        raise PlacementError("the Ray cluster cannot hold this job: " + "; ".join(missing))


def reserve(cfg: Config) -> dict[str, Placement]:
    """Create the placement groups of ``plan_groups`` and wait until they are ready."""
    import ray
    from ray.util.placement_group import placement_group, remove_placement_group

    plans = plan_groups(cfg)
    check_capacity(cfg, plans, ray.cluster_resources())
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


def release(placements: dict[str, Placement]) -> None:
    from ray.util.placement_group import remove_placement_group

    for pg in {id(g): g for p in placements.values() for g in p.groups}.values():
        remove_placement_group(pg)


def placement_report(placements: dict[str, Placement]) -> dict[str, Any]:
    """Which node holds each actor of each role, and what each node offers (placement.json)."""
    import ray
    from ray.util import placement_group_table

    nodes = {n["NodeID"]: {"address": n["NodeManagerAddress"], "resources": n["Resources"]}
             for n in ray.nodes() if n["Alive"]}
    roles = {}
    for role, p in placements.items():
        roles[role] = [placement_group_table(g)["bundles_to_node_id"][i] for g, i in zip(p.groups, p.bundles)]
    return {"roles": roles, "nodes": nodes}
