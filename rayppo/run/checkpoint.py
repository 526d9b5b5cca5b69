"""Checkpoints of a run: written atomically, proven whole, found again by ``rayppo train --resume DIR``.

    DIR/checkpoints/iter_000020/   policy/ critic/   the trainer's model and optimizer states
                                   learner.json      the learner's split (``learner/learner_state.py``)
                                   driver.json       iteration, beta, prompt position, version
                                   manifest.json     every file's size and CRC-32, written last
    DIR/checkpoints/latest         "iter_000020", replaced last

A checkpoint is written into ``.tmp-checkpoint``; its manifest is written last, then every file
and folder is fsynced and the folder renamed into place (named after the iteration its driver
state holds), and only then is ``latest`` replaced (write, fsync, rename). A checkpoint of the same
iteration again (an interrupt right after a periodic save) first moves the old one aside as
``.old-iter_...`` and deletes it only once the new one is in place. At ``--resume`` the manifest is
checked: a damaged latest checkpoint (a truncated file after a full disk, a file changed since)
falls back to the newest earlier complete one with a warning, or stops with one line naming the
damaged file. The trainer writes its own part (``Trainer.checkpoint``); this module handles the
folders and the driver's state, as JSON (never pickle).
"""

from __future__ import annotations

import json
import logging
import os
import re
import shutil
import zlib
from pathlib import Path
from typing import Any, Protocol

from rayppo.errors import RayppoError
from rayppo.learner.learner_state import LearnerSplit, check_stage_change, read_split

log = logging.getLogger(__name__)

NAME = re.compile(r"^iter_(\d{6,})$")
DRIVER_STATE = "driver.json"
MANIFEST = "manifest.json"
WRITING = ".tmp-checkpoint"


class CheckpointError(RayppoError, RuntimeError):
    """A checkpoint folder is missing, incomplete or unreadable; the message names the path."""


class Checkpointable(Protocol):
    def checkpoint(self, path: Path) -> dict[str, Any]:
        """Write model and optimizer states under ``path``; return the driver's state (JSON),
        whose ``iteration`` is the number of iterations the written states hold."""

    def restore(self, path: Path, state: dict[str, Any]) -> None:
        """Load what ``checkpoint`` wrote; bring every role to that policy version."""


def checkpoint_root(run_dir: str | Path) -> Path:
    return Path(run_dir) / "checkpoints"


def checkpoint_name(iterations_done: int) -> str:
    return f"iter_{iterations_done:06d}"


def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _write_atomic(path: Path, text: str) -> None:
    tmp = path.with_name(f".{path.name}.tmp")
    with tmp.open("w", encoding="utf-8") as f:
        f.write(text)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)
    _fsync_dir(path.parent)


def _crc32(path: Path, fsync: bool = False) -> int:
    """CRC-32 of a file's bytes (1 MiB at a time); ``fsync``: its data on disk first."""
    crc = 0
    with path.open("rb") as f:
        if fsync:
            os.fsync(f.fileno())
        while chunk := f.read(1 << 20):
            crc = zlib.crc32(chunk, crc)
    return crc


def _files(folder: Path) -> list[Path]:
    return sorted(p for p in folder.rglob("*") if p.is_file() and p.name != MANIFEST)


def _write_manifest(folder: Path) -> None:
    """Every file's size and CRC-32 (each fsynced on the way), then the manifest itself, then
    every folder of the tree fsynced: after this the checkpoint is on disk, whole."""
    files = {p.relative_to(folder).as_posix(): {"bytes": p.stat().st_size, "crc32": _crc32(p, fsync=True)}
             for p in _files(folder)}
    _write_atomic(folder / MANIFEST, json.dumps({"files": files}, indent=1))
    for sub in sorted({p.parent for p in _files(folder)} | {folder}, key=lambda p: -len(p.parts)):
        _fsync_dir(sub)


def damage(folder: Path) -> str | None:
    """What is wrong with the checkpoint ``folder`` (a file missing, truncated or changed since
    its manifest was written), in words naming the file; None when it is whole."""
    manifest = folder / MANIFEST
    try:
        files = json.loads(manifest.read_text(encoding="utf-8"))["files"]
    except FileNotFoundError:
        return f"{manifest} not found (the checkpoint was not completed)"
    except (OSError, ValueError, KeyError, TypeError) as exc:
        return f"{manifest} is unreadable ({exc.__class__.__name__})"
    for rel, expected in files.items():
        path = folder / rel
        if not path.is_file():
            return f"{path} is missing"
        size = path.stat().st_size
        if size != expected["bytes"]:
            return f"{path} has {size:,} bytes, its manifest says {expected['bytes']:,} (truncated or overwritten)"
        if _crc32(path) != expected["crc32"]:
            return f"{path} differs from its manifest (CRC-32): damaged since it was written"
    return None


def write_checkpoint(run_dir: str | Path, trainer: Checkpointable, keep: int) -> Path:
    """Checkpoint the trainer's state, named after the iterations it holds; keep the newest
    ``keep`` (never deleting the one ``latest`` names). Returns its folder."""
    root = checkpoint_root(run_dir)
    tmp = root / WRITING
    shutil.rmtree(tmp, ignore_errors=True)  # a crash while writing one before
    tmp.mkdir(parents=True)
    state = trainer.checkpoint(tmp.resolve())
    name = checkpoint_name(state["iteration"])
    _write_atomic(tmp / DRIVER_STATE, json.dumps(state, indent=1))
    _write_manifest(tmp)
    final, old = root / name, root / f".old-{name}"
    if final.exists():  # the same iteration again: the old one stays complete until the new one is in place
        shutil.rmtree(old, ignore_errors=True)
        os.replace(final, old)
    os.replace(tmp, final)
    _fsync_dir(root)
    _write_atomic(root / "latest", name + "\n")
    shutil.rmtree(old, ignore_errors=True)
    others = sorted((p for p in root.iterdir() if NAME.match(p.name) and p.name != name), key=_iterations)
    for stale in others[:max(0, len(others) - (keep - 1))]:
        shutil.rmtree(stale, ignore_errors=True)
    return final


def _iterations(path: Path) -> int:
    match = NAME.match(path.name)
    assert match is not None  # callers sort only the names NAME matched
    return int(match.group(1))


def latest_checkpoint(run_dir: str | Path) -> Path:
    """The newest whole checkpoint: the one ``checkpoints/latest`` names when its manifest checks
    out, else (with a warning naming the damage) the newest earlier one that does;
    ``CheckpointError`` naming the damaged file when none is left."""
    root = checkpoint_root(run_dir)
    marker = root / "latest"
    complete = sorted((p for p in root.iterdir() if NAME.match(p.name)), key=_iterations) if root.is_dir() else []
    if not marker.is_file() and not complete:
        raise CheckpointError(f"--resume: {run_dir} has no checkpoint ({marker} not found); a run writes one every "
                              "output.checkpoint_every iterations, on Ctrl-C and on SIGTERM")
    name = marker.read_text(encoding="utf-8").strip() if marker.is_file() else ""
    old = root / f".old-{name}"
    if NAME.match(name) and not (root / name).exists() and old.is_dir():
        os.replace(old, root / name)  # a crash between the two renames of a same-iteration rewrite
        complete = sorted({*complete, root / name}, key=_iterations)
    named = root / name if NAME.match(name) and (root / name).is_dir() else None
    problems = [] if named or not name else [f"{marker} names {name!r}, which is not a checkpoint folder"]
    for path in ([named] if named else []) + [p for p in reversed(complete) if p != named]:
        problem = damage(path)
        if problem is None:
            if problems:
                log.warning("%s; resuming from %s, the newest whole checkpoint", problems[0], path.name)
            return path
        problems.append(problem)
    raise CheckpointError(f"--resume: no whole checkpoint in {root}: {'; '.join(problems)}")


def read_driver_state(path: Path) -> dict[str, Any]:
    """The driver's state of the checkpoint at ``path``."""
    try:
        state = json.loads((path / DRIVER_STATE).read_text(encoding="utf-8"))
    except (OSError, ValueError) as exc:
        raise CheckpointError(f"--resume: cannot read {path / DRIVER_STATE}: {exc}") from None
    if not isinstance(state, dict) or not isinstance(state.get("iteration"), int):
        raise CheckpointError(f"--resume: {path / DRIVER_STATE} has no iteration count")
    return state


def split_fields() -> list[str]:
    """The split of the work over actors (fields marked ``SPLIT`` in ``config/system.py``): a
    resumed run may change it. The learner's first, as messages name them: its change is the one
    that reshards a checkpoint."""
    from rayppo.config.schema import resume_kinds

    names = [name for name, kind in resume_kinds().items() if kind == "split"]
    return sorted(names, key=lambda name: not name.startswith("learner."))


def resume_config(run_dir: str | Path, overrides: list[str]):
    """The saved config of ``run_dir`` with ``overrides`` applied, and its latest checkpoint.

    Overrides may change resources, stopping and output options; anything else (the algorithm,
    the models, the data, the seed) would make the resumed run a different run: refused, named."""
    run_dir = Path(run_dir)
    saved = run_dir / "config.yaml"
    if not saved.is_file():
        raise CheckpointError(f"--resume: {saved} not found: {run_dir} is not a rayppo run folder")
    checkpoint = latest_checkpoint(run_dir)
    return continued_config(run_dir, overrides), checkpoint


def continued_config(run_dir: Path, overrides: list[str]):
    """``run_dir``'s saved config with ``overrides`` applied, when they change only what a resumed
    run may change (``resume_config``); else ``ConfigError`` naming the field."""
    from rayppo.config.load import load_config
    from rayppo.config.schema import ConfigError, field_docs, resume_kinds

    saved = run_dir / "config.yaml"
    before = _flat(load_config(saved, paths_relative_to_file=False))
    cfg = load_config(saved, overrides, paths_relative_to_file=False)
    after = _flat(cfg)
    resumable = resume_kinds()  # what each field's metadata says (config/system.py)
    for name in (n for n, _, _ in field_docs()):
        if before[name] != after[name] and (name == "output.dir" or name not in resumable):
            raise ConfigError(f"{name}: cannot change on --resume ({before[name]!r} -> {after[name]!r}): it changes "
                              "the run's math; only resources, the split over actors (learner.num_ranks, "
                              "generators.num, reference.num, reward.num, distill.num), stop.*, output.* and cluster.* may change")
    check_stage_change(before["learner.zero_stage"], after["learner.zero_stage"])
    return cfg


def split_change(checkpoint: Path, cfg) -> str:
    """``; on another split: learner 2 ranks ZeRO-2 -> 1 rank ZeRO-2`` when the checkpoint's
    learner split (``read_split`` of ``learner/learner_state.py``, which reshards) is another; else ""."""
    try:
        before = read_split(checkpoint)
    except (OSError, ValueError, KeyError, TypeError):
        before = None  # unreadable: the learner's load names the file; nothing to say here
    after = LearnerSplit(num_ranks=cfg.learner.num_ranks, zero_stage=cfg.learner.zero_stage)
    if before is None or before == after or cfg.trainer != "distributed":
        return ""
    return f"; on another split: learner {before} -> {after}"


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
