"""Reserving resources per role with Ray placement groups, failing fast with what is missing."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import ray
from ray.util.placement_group import PlacementGroup, placement_group, remove_placement_group
from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

from rayppo.config import Config


class PlacementError(RuntimeError):
    """The cluster cannot hold the requested roles; the message says what is missing."""


@dataclass
class RoleSpec:
    """``count`` actors of one role, each needing ``bundle`` (Ray resources)."""

    name: str
    count: int
    bundle: dict[str, float]
    strategy: str = "PACK"


@dataclass
class Placement:
    """Where a role's actors go: a placement group and one bundle index per actor."""

    group: PlacementGroup
    bundles: list[int]
    bundle: dict[str, float] = field(default_factory=dict)

    def actor_options(self, i: int, env: dict[str, str] | None = None) -> dict[str, Any]:
        """Ray actor options for actor ``i`` of the role."""
        resources = {k: v for k, v in self.bundle.items() if k not in ("CPU", "GPU")}
        options: dict[str, Any] = {
            "num_cpus": self.bundle.get("CPU", 0),
            "num_gpus": self.bundle.get("GPU", 0),
            "scheduling_strategy": PlacementGroupSchedulingStrategy(self.group, placement_group_bundle_index=self.bundles[i]),
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
    """The resources each role asks for, from the config."""
    g, l = cfg.generators, cfg.learner
    return [
        RoleSpec("generators", g.num, _bundle(g.cpus_per_worker, g.gpus_per_worker, g.resources)),
        RoleSpec("reference", cfg.reference.num, _bundle(cfg.reference.cpus, cfg.reference.gpus, cfg.reference.resources)),
        RoleSpec("reward", cfg.reward.num, _bundle(cfg.reward.cpus, cfg.reward.gpus, cfg.reward.resources)),
        # Learner ranks may span nodes; SPREAD is not required, PACK keeps them close when it can.
        RoleSpec("learner", l.num_ranks, _bundle(l.cpus_per_rank, l.gpus_per_rank, l.resources)),
    ]


def total_demand(specs: list[RoleSpec]) -> dict[str, float]:
    demand: dict[str, float] = {}
    for spec in specs:
        for key, value in spec.bundle.items():
            demand[key] = demand.get(key, 0.0) + value * spec.count
    return demand


def check_capacity(specs: list[RoleSpec], available: dict[str, float]) -> None:
    """Raise ``PlacementError`` naming every resource the cluster lacks, before anything waits."""
    missing = []
    for key, need in sorted(total_demand(specs).items()):
        have = available.get(key, 0.0)
        if need > have + 1e-9:
            users = ", ".join(f"{s.name} {s.count} x {s.bundle[key]:g}" for s in specs if s.bundle.get(key))
            missing.append(f"{key}: need {need:g} ({users}), cluster has {have:g}")
    if missing:
        raise PlacementError("the Ray cluster cannot hold this job: " + "; ".join(missing))


def reserve(cfg: Config) -> dict[str, Placement]:
    """One placement group per role (reference and reward join the learner's when colocated)."""
    specs = role_specs(cfg)
    check_capacity(specs, ray.cluster_resources())
    by_name = {s.name: s for s in specs}
    groups: dict[str, list[RoleSpec]] = {"generators": [by_name["generators"]], "learner": [by_name["learner"]]}
    if cfg.cluster.colocate:
        groups["learner"] += [by_name["reference"], by_name["reward"]]
    else:
        groups["reference"], groups["reward"] = [by_name["reference"]], [by_name["reward"]]
    placements: dict[str, Placement] = {}
    created: list[PlacementGroup] = []
    for group_name, members in groups.items():
        bundles = [dict(s.bundle) for s in members for _ in range(s.count)]
        pg = placement_group(bundles, strategy="PACK", name=f"rayppo-{group_name}")
        created.append(pg)
        start = 0
        for s in members:
            placements[s.name] = Placement(pg, list(range(start, start + s.count)), s.bundle)
            start += s.count
    ready, _ = ray.wait([pg.ready() for pg in created], num_returns=len(created), timeout=cfg.cluster.placement_timeout_s)
    if len(ready) < len(created):
        for pg in created:
            remove_placement_group(pg)
        raise PlacementError(
            f"placement groups not ready after {cfg.cluster.placement_timeout_s:g} s: the cluster has the "
            f"resources in total ({total_demand(specs)}) but no nodes can hold the bundles as requested"
        )
    return placements


def release(placements: dict[str, Placement]) -> None:
    for pg in {id(p.group): p.group for p in placements.values()}.values():
        remove_placement_group(pg)


def placement_report(placements: dict[str, Placement]) -> dict[str, Any]:
    """Which node holds each actor of each role, and what each node offers (placement.json)."""
    from ray.util import placement_group_table

    nodes = {n["NodeID"]: {"address": n["NodeManagerAddress"], "resources": n["Resources"]}
             for n in ray.nodes() if n["Alive"]}
    roles = {}
    for role, p in placements.items():
        bundle_nodes = placement_group_table(p.group)["bundles_to_node_id"]
        roles[role] = [bundle_nodes[i] for i in p.bundles]
    return {"roles": roles, "nodes": nodes}
