"""Checkpoints of a run: written atomically, found again by ``rayppo train --resume DIR``.

    DIR/checkpoints/iter_000020/   policy/ critic/   the trainer's model and optimizer states
                                   driver.json       iteration, beta, prompt position, version
    DIR/checkpoints/latest         "iter_000020", replaced last

A checkpoint is written into ``.tmp-iter_000020`` and renamed into place only when complete;
``latest`` is replaced (write + rename) after that. A crash at any point leaves ``latest``
naming a complete checkpoint. The trainer writes its own part (``Trainer.checkpoint``); this
module only handles the folders and the driver's state, as JSON (never pickle).
"""

from __future__ import annotations

import json
import os
import re
import shutil
from pathlib import Path
from typing import Any, Protocol

from rayppo.errors import RayppoError

NAME = re.compile(r"^iter_(\d{6,})$")
DRIVER_STATE = "driver.json"


class CheckpointError(RayppoError, RuntimeError):
    """A checkpoint folder is missing, incomplete or unreadable; the message names the path."""


class Checkpointable(Protocol):
    def checkpoint(self, path: Path) -> dict[str, Any]:
        """Write model and optimizer states under ``path``; return the driver's state (JSON)."""

    def restore(self, path: Path, state: dict[str, Any]) -> None:
        """Load what ``checkpoint`` wrote; bring every role to that policy version."""


def checkpoint_root(run_dir: str | Path) -> Path:
    return Path(run_dir) / "checkpoints"


def _write_atomic(path: Path, text: str) -> None:
    tmp = path.with_name(f".{path.name}.tmp")
    with tmp.open("w", encoding="utf-8") as f:
        f.write(text)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)


def write_checkpoint(run_dir: str | Path, iterations_done: int, trainer: Checkpointable, keep: int) -> Path:
    """Checkpoint after ``iterations_done`` iterations; keep the newest ``keep``. Returns its folder."""
    root = checkpoint_root(run_dir)
    name = f"iter_{iterations_done:06d}"
    tmp, final = root / f".tmp-{name}", root / name
    shutil.rmtree(tmp, ignore_errors=True)  # a crash while writing it before
    tmp.mkdir(parents=True)
    state = trainer.checkpoint(tmp.resolve())
    _write_atomic(tmp / DRIVER_STATE, json.dumps(state, indent=1))
    if final.exists():  # the same iteration again (an interrupt right after a periodic save)
        shutil.rmtree(final)
    os.replace(tmp, final)
    _write_atomic(root / "latest", name + "\n")
    for old in sorted(p for p in root.iterdir() if NAME.match(p.name))[:-keep]:
        shutil.rmtree(old, ignore_errors=True)
    return final


def latest_checkpoint(run_dir: str | Path) -> Path:
    """The folder ``checkpoints/latest`` names; ``CheckpointError`` saying what is wrong."""
    root = checkpoint_root(run_dir)
    marker = root / "latest"
    if not marker.is_file():
        raise CheckpointError(f"--resume: {run_dir} has no checkpoint ({marker} not found); a run writes one every "
                              "output.checkpoint_every iterations and on Ctrl-C")
    name = marker.read_text(encoding="utf-8").strip()
    if not NAME.match(name) or not (root / name / DRIVER_STATE).is_file():
        raise CheckpointError(f"--resume: {marker} names {name!r}, which is not a complete checkpoint in {root}")
    return root / name


def read_driver_state(path: Path) -> dict[str, Any]:
    """The driver's state of the checkpoint at ``path``."""
    try:
        state = json.loads((path / DRIVER_STATE).read_text(encoding="utf-8"))
    except (OSError, ValueError) as exc:
        raise CheckpointError(f"--resume: cannot read {path / DRIVER_STATE}: {exc}") from None
    if not isinstance(state, dict) or not isinstance(state.get("iteration"), int):
        raise CheckpointError(f"--resume: {path / DRIVER_STATE} has no iteration count")
    return state


# Fields a resumed run may change: none of them changes the math of the iterations to come.
RESUMABLE_SECTIONS = ("stop.", "output.", "cluster.")
RESUMABLE_FIELDS = ("cpus", "cpus_per_worker", "cpus_per_rank", "threads", "cores", "resources", "gpus",
                    "gpus_per_worker", "gpus_per_rank", "placement_timeout_s")


def resume_config(run_dir: str | Path, overrides: list[str]):
    """The saved config of ``run_dir`` with ``overrides`` applied, and its latest checkpoint.

    Overrides may change resources, stopping and output options; anything else (the algorithm,
    the models, the data, the seed) would make the resumed run a different run: refused, named."""
    from rayppo.config.load import load_config
    from rayppo.config.schema import ConfigError, field_docs

    run_dir = Path(run_dir)
    saved = run_dir / "config.yaml"
    if not saved.is_file():
        raise CheckpointError(f"--resume: {saved} not found: {run_dir} is not a rayppo run folder")
    checkpoint = latest_checkpoint(run_dir)
    before = _flat(load_config(saved, paths_relative_to_file=False))
    cfg = load_config(saved, overrides, paths_relative_to_file=False)
    after = _flat(cfg)
    for name in (n for n, _, _ in field_docs()):
        if before[name] != after[name] and (name == "output.dir" or not _resumable(name)):
            raise ConfigError(f"{name}: cannot change on --resume ({before[name]!r} -> {after[name]!r}): it changes "
                              "the run's math; only resources, stop.*, output.* and cluster.* may change")
    return cfg, checkpoint


def _resumable(name: str) -> bool:
    return name.startswith(RESUMABLE_SECTIONS) or name.rsplit(".", 1)[-1] in RESUMABLE_FIELDS


def _flat(cfg) -> dict[str, Any]:
    from rayppo.config.schema import to_dict

    out: dict[str, Any] = {}

    def walk(prefix: str, node: dict[str, Any]) -> None:
        for key, value in node.items():
            if isinstance(value, dict) and not key.endswith(("resources", "actor_env")):
                walk(f"{prefix}{key}.", value)
            else:
                out[f"{prefix}{key}"] = value

    walk("", to_dict(cfg))
    return out
