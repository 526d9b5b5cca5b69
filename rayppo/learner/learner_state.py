"""The learner's part of a checkpoint: DeepSpeed states of policy and critic, the split that wrote
them, and resharding onto another split.

    iter_N/policy/state/   critic/state/   each rank's ZeRO partitions and optimizer shards
    iter_N/learner.json                    the split that wrote them: {"num_ranks": N, "zero_stage": z}
    iter_N/universal/                      written at a resume on another split (once, by rank 0)

A resumed run on another number of ranks or another ZeRO stage converts the states once to
DeepSpeed's universal checkpoint (each parameter's fp32 weights and Adam moments whole), which any
number of ranks loads (docs/failures.md, "Resuming on another split"). ``learner.json`` is read
here only (``read_split``): the learner engine to reshard, ``run/checkpoint.py`` to say the change.
The folders, manifest and driver state around it are ``run/checkpoint.py``'s.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

SPLIT_FILE = "learner.json"
"""The learner split a checkpoint was written by: ``{"num_ranks": N, "zero_stage": z}``."""


@dataclass(frozen=True)
class LearnerSplit:
    """How the learner's work was split: ranks, and the ZeRO stage partitioning their states."""

    num_ranks: int
    zero_stage: int

    def __str__(self) -> str:
        return f"{self.num_ranks} rank{'s' if self.num_ranks != 1 else ''} ZeRO-{self.zero_stage}"


def write_split(folder: Path, split: LearnerSplit) -> None:
    """Record ``split`` as the one that wrote the checkpoint ``folder`` (``SPLIT_FILE``)."""
    (folder / SPLIT_FILE).write_text(json.dumps(asdict(split)))


def read_split(folder: Path) -> LearnerSplit | None:
    """The split the checkpoint ``folder`` was written by; None without ``SPLIT_FILE`` (written
    before rayppo recorded it: taken as the reader's own). A malformed file raises (``OSError``,
    ``ValueError``, ``KeyError``, ``TypeError``)."""
    path = folder / SPLIT_FILE
    if not path.is_file():
        return None
    saved = json.loads(path.read_text())
    return LearnerSplit(num_ranks=int(saved["num_ranks"]), zero_stage=int(saved["zero_stage"]))


def needs_reshard(saved: LearnerSplit | None, now: LearnerSplit) -> bool:
    """Whether states written by the ``saved`` split must be resharded before ``now`` loads them.
    Stage 0 holds whole optimizer states on every rank: any number of ranks loads them as they
    are; a checkpoint without a recorded split is taken as this split's."""
    return saved is not None and now.zero_stage > 0 and saved != now


def check_stage_change(before: int, after: int) -> None:
    """``ConfigError`` unless a resumed run may go from ZeRO stage ``before`` to ``after``. ZeRO-1
    and ZeRO-2 hold the same partitioned optimizer and reshard into each other; stage 0 (no
    partitions) and stage 3 (parameters partitioned too) keep their own layout: DeepSpeed
    0.19.8's universal checkpoint does not load one into the other."""
    from rayppo.config.schema import ConfigError

    if before != after and not {before, after} <= {1, 2}:
        raise ConfigError(f"learner.zero_stage: cannot change on --resume ({before} -> {after}): only ZeRO-1 and "
                          "ZeRO-2 reshard into each other (stages 0 and 3 keep their own checkpoint layout); "
                          "learner.num_ranks may change within any stage")


ENGINE_FOLDERS = ("policy", "critic", "reward_model")
"""The engines a checkpoint may hold, by folder: PPO's policy and critic, or a reward-model run's r_φ."""


def save_states(folder: Path, engines: dict[str, Any], version: int, rank: int, split: LearnerSplit) -> None:
    """DeepSpeed states of ``engines`` (``{"policy": engine, "critic": engine}``, no critic under
    a critic-free estimator; ``{"reward_model": engine}``) under ``folder/<name>``: each rank writes
    its own ZeRO partitions and optimizer shards (the folder must be shared by the ranks' nodes); the
    first engine carries the ``version``. Rank 0 records the ``split``."""
    first = next(iter(engines))
    for name, engine in engines.items():
        client = {"version": version} if name == first else {}
        engine.save_checkpoint(str(folder / name), tag="state", client_state=client, save_latest=False)
    if rank == 0:
        write_split(folder, split)


def load_states(folder: Path, engines: dict[str, Any], rank: int, split: LearnerSplit) -> int:
    """Load what ``save_states`` wrote into ``engines`` (weights, optimizer moments and steps),
    resharded when another split wrote it; returns the policy version. Collective: every rank of
    ``split`` calls it."""
    source = resharded(folder, rank, split.num_ranks) if needs_reshard(read_split(folder), split) else folder
    client: dict[str, Any] = {}
    for name, engine in engines.items():
        with universal_load(engine, source != folder):
            loaded, state = engine.load_checkpoint(str(source / name), tag="state")
        if loaded is None:
            raise FileNotFoundError(f"--resume: no DeepSpeed checkpoint of rank {rank} under {folder}")
        client = client or state
    return int(client["version"])


def resharded(folder: Path, rank: int, world_size: int) -> Path:
    """``folder`` converted once to DeepSpeed's universal checkpoint (``folder/universal``: each
    parameter's fp32 weights and Adam moments whole), which any number of ranks loads. Rank 0
    converts; the others wait."""
    out = folder / "universal"
    if rank == 0 and not (out / SPLIT_FILE).is_file():
        to_universal(folder, out, [name for name in ENGINE_FOLDERS if (folder / name).is_dir()])
    if world_size > 1:
        import torch.distributed as dist  # here: the driver reads splits without loading torch

        dist.barrier()
    return out


def to_universal(path: Path, out: Path, engines: list[str]) -> None:
    """DeepSpeed's ZeRO checkpoints under ``path/<engine>/state`` as universal checkpoints under
    ``out/<engine>/state``, by DeepSpeed's own converter (``deepspeed/checkpoint/ds_to_universal.py``,
    0.19.8: ``main(args)`` with the arguments of its command line). Written next to ``out`` and
    renamed into place, so an interrupted conversion is redone, never half-read."""
    import argparse
    import shutil

    from deepspeed.checkpoint.ds_to_universal import main as convert

    staging = out.with_name(out.name + ".partial")
    shutil.rmtree(staging, ignore_errors=True)
    for name in engines:
        convert(argparse.Namespace(input_folder=str(path / name / "state"),
                                   output_folder=str(staging / name / "state"), num_extract_workers=1,
                                   num_merge_workers=1, keep_temp_folder=False, strict=True,
                                   inject_missing_state=True))
    shutil.copy(path / SPLIT_FILE, staging / SPLIT_FILE)  # marks a finished conversion
    staging.rename(out)


@contextmanager
def universal_load(engine: Any, on: bool) -> Iterator[None]:
    """Load ``engine``'s next checkpoint as a universal one. DeepSpeed reads the choice from its
    config (``DeepSpeedEngine.load_universal_checkpoint`` returns ``_config.load_universal_checkpoint``,
    deepspeed/runtime/engine.py, 0.19.8), fixed at ``initialize``: it is set for this one load."""
    if not on:
        yield
        return
    engine._config.load_universal_checkpoint = True
    try:
        yield
    finally:
        engine._config.load_universal_checkpoint = False
