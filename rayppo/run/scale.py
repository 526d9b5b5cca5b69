"""Resizing a running job: ``rayppo scale DIR generators.num=2`` asks, the driver answers between
two iterations.

The request is a file in the run folder (``scale.json``, written whole by a rename). After each
iteration the driver takes it and checks it as ``--resume`` would (only the split over actors and
the roles' resources may change: ``scalable``). More generators (and nothing else) join the running
fleet: they start in placement groups of their own and sample from the first iteration boundary
after they are up to date (``grows_fleet_only``, ``rayppo/cluster/fleet.py``). Any other change: the
driver writes a checkpoint, closes its actors and resumes from that checkpoint on the new split in
the same process (``train.train``). New generators sample from the next
iteration on, with the same noise per row as before (docs/cluster.md, "Sampling noise"); a new
learner split loads the checkpoint resharded (docs/failures.md, "Resuming on another split").
A request the driver cannot carry out (an invalid value, a split the cluster cannot hold) is
refused on one line and the run goes on as it was.
"""

from __future__ import annotations

import functools
import json
import os
from pathlib import Path

from rayppo.run.checkpoint import CheckpointError, continued_config, split_fields

SCALE_FILE = "scale.json"
"""The pending request in a run folder: ``{"overrides": ["generators.num=2", ...]}``."""


def scalable() -> list[str]:
    """The fields a request may change: the split over actors, and each role's resources (GPUs and
    CPUs per actor, threads, cores, custom resources)."""
    from rayppo.config.schema import resume_kinds

    resources = [name for name, kind in resume_kinds().items() if kind == "resource"]  # the roles' own
    return split_fields() + resources


def request_scale(run_dir: str | Path, overrides: list[str]) -> str:
    """Leave a request for the driver of ``run_dir`` (merged into one still pending, later values
    winning); returns what changes, e.g. ``generators.num 1 -> 2``. Refused, naming the field, when
    an override is not a split field or its value would not load."""
    from rayppo.config.load import load_config
    from rayppo.config.schema import ConfigError

    run_dir = Path(run_dir)
    saved = run_dir / "config.yaml"
    if not saved.is_file():
        raise CheckpointError(f"{saved} not found: {run_dir} is not a rayppo run folder")
    if not overrides:
        raise ConfigError(f"scale: nothing to change; give the new split, e.g. generators.num=2 "
                          f"(any of {', '.join(split_fields())})")
    fields = scalable()
    for override in overrides:
        key = override.split("=", 1)[0]
        if "=" not in override or key not in fields:
            raise ConfigError(f"{key}: not part of the split over actors ({', '.join(split_fields())}) nor a role's "
                              f"resources; other fields change with: rayppo train --resume {run_dir} {override}")
    merged = _merged(pending(run_dir), overrides)
    before, after = load_config(saved, paths_relative_to_file=False), continued_config(run_dir, merged)
    if after.trainer != "distributed":
        raise ConfigError(f"trainer={after.trainer!r} runs in one process: there is no split to change")
    _write(run_dir / SCALE_FILE, merged)
    return changes(before, after) or "nothing (the run already has this split)"


def pending(run_dir: Path) -> list[str]:
    """The overrides of the request waiting in ``run_dir`` ([] when none, or when unreadable)."""
    try:
        overrides = json.loads((run_dir / SCALE_FILE).read_text())["overrides"]
    except (OSError, ValueError, KeyError, TypeError):
        return []
    return [o for o in overrides if isinstance(o, str)] if isinstance(overrides, list) else []


def take_request(run_dir: Path) -> list[str] | None:
    """The waiting request's overrides, removed from the folder (None when there is none)."""
    path = run_dir / SCALE_FILE
    if not path.exists():
        return None
    overrides = pending(run_dir)
    path.unlink(missing_ok=True)
    return overrides


def _value(cfg, name: str):
    return functools.reduce(getattr, name.split("."), cfg)


def changed_fields(before, after) -> list[str]:
    """The ``scalable`` fields two configs differ in."""
    return [name for name in scalable() if _value(before, name) != _value(after, name)]


def changes(before, after) -> str:
    """``generators.num 1 -> 2, learner.num_ranks 2 -> 1``: the ``scalable`` fields two configs differ in."""
    return ", ".join(f"{name} {_value(before, name)} -> {_value(after, name)}" for name in changed_fields(before, after))


def grows_fleet_only(before, after) -> bool:
    """Whether ``after`` only adds generators (and perhaps moves ``generators.min_num``): then they
    join the running fleet, with no restart (outside colocated mode, where generators sit in the
    learner's bundles)."""
    fields = set(changed_fields(before, after))
    return ("generators.num" in fields and fields <= {"generators.num", "generators.min_num"}
            and after.generators.num > before.generators.num and not before.cluster.colocate_all)


def _merged(earlier: list[str], later: list[str]) -> list[str]:
    """One override per field, the later request's value winning."""
    by_key = {o.split("=", 1)[0]: o for o in earlier + later}
    return list(by_key.values())


def _write(path: Path, overrides: list[str]) -> None:
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps({"overrides": overrides}))
    os.replace(tmp, path)  # the driver never reads half a request
