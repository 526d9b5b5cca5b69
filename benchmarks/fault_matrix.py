"""Every role's process SIGKILLed or SIGSTOPped in every phase of an iteration, in both trainers.

One run per (trainer, signal) on the embedded default (vLLM generator, reference, reward, two
DeepSpeed learner ranks; a checkpoint after every iteration, an evaluation every second). Its
cells (``role@phase``) fire one at a time: once the previous cell's fault has been recovered
from and two more iterations have completed, the next signal goes to that role's process the
moment the driver enters the phase (``DistributedTrainer.phase``). A phase can end before the
signal lands (a sync takes a fraction of a second): the table says where it landed, and a fault
that lands between calls is found at the role's next call, which is a case of its own worth
surviving. A stopped process is found by the call deadline (``cluster.call_timeout_s``, 30 s
here, above this machine's ~15 s actor start-up).

For each cell: where the signal landed, what the run did (``replaced``: the actor was replaced
and its share redone; ``learner restarted``: the learner group was rebuilt from the latest
checkpoint; ``stopped``: the run ended, with the message and the checkpoint that stands) and the
seconds from the signal to the next completed iteration.

    python benchmarks/fault_matrix.py --out runs/fault_matrix                 # all four runs (~40 min)
    python benchmarks/fault_matrix.py --trainer sync --signal STOP --cells learner@sync

Writes ``OUT/fault_matrix.json`` and ``OUT/fault_matrix.md`` (the table) and prints the table.
``tests/test_fault_matrix.py`` runs it (opt-in: ``RAYPPO_FAULT_MATRIX=1``) and asserts every cell
is survived.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import threading
import time
from dataclasses import asdict, dataclass
from pathlib import Path

from rayppo.cluster.group import get
from rayppo.config.load import load_config
from rayppo.errors import brief
from rayppo.machine.role_resources import Engine
from rayppo.run.checkpoint import CheckpointError, latest_checkpoint
from rayppo.train import run
from rayppo.trainers.choice import make_trainer
from rayppo.trainers.distributed import DistributedTrainer

CELLS = {
    # The synchronous trainer: each role where it has a call in flight, then two idle ones
    # (found at the role's next call).
    "sync": ["generators@generate", "reference@score", "reward@score", "learner@learn", "generators@sync",
             "learner@sync", "generators@verify", "learner@verify", "generators@evaluate", "reward@evaluate",
             "learner@checkpoint", "reference@learn", "learner@generate"],
    # The pipeline: generation and scoring run in their threads while the driver waits for a
    # scored batch, trains, or publishes; generators check their own loads (no verify phase).
    "async": ["generators@learn", "reference@learn", "reward@wait", "learner@learn", "generators@sync",
              "learner@sync", "generators@evaluate", "reward@evaluate", "learner@checkpoint", "learner@wait"],
}
SIGNALS = {"KILL": signal.SIGKILL, "STOP": signal.SIGSTOP}
GAP = 2
"""Completed iterations between a cell's recovery and the next cell's signal."""
TIMEOUT_S = 30.0


@dataclass
class Cell:
    role: str
    phase: str
    landed: str = ""
    """The driver's phase right after the signal was sent."""
    outcome: str = "not fired"
    recovered_s: float | None = None
    """Seconds from the signal to the next completed iteration."""
    detail: str = ""

    @property
    def name(self) -> str:
        return f"{self.role}@{self.phase}"


def _pid(trainer: DistributedTrainer, role: str, phase: str) -> int:
    """The process to signal: learner rank 1 while it trains (a rank other than the one that
    sends the weights), rank 0 otherwise; actor 0 of the other roles."""
    if role == "learner":
        return trainer.learner.where[1 if phase == "learn" and len(trainer.learner.where) > 1 else 0][0]
    group = {"generators": trainer.generators, "reference": trainer.reference, "reward": trainer.rewards}[role]
    return get(group.call_at(0, Engine.process_id, ()))[0]


def _wait(condition, done: threading.Event, poll_s: float = 0.002) -> bool:
    while not condition():
        if done.is_set():
            return False
        time.sleep(poll_s)
    return True


def _inject(trainer: DistributedTrainer, cells: list[Cell], sig: int, done: threading.Event) -> None:
    """Fire each cell in turn (module docstring) and record what followed."""
    sup = trainer.supervisor
    for cell in cells:
        fire_at = sup.completed + GAP
        # Each condition is polled by _wait before the loop moves on: the loop variables it reads are current.
        if not _wait(lambda: sup.completed >= fire_at, done, 0.05):  # noqa: B023
            return
        pid = _pid(trainer, cell.role, cell.phase)  # asked before the phase: a busy actor answers after its call
        if not _wait(lambda: trainer.phase == cell.phase and sup.completed >= fire_at, done):  # noqa: B023
            return
        restarts, learner_restarts = sup.restarts, trainer.learner_restarts
        os.kill(pid, sig)
        start = time.monotonic()
        cell.landed, cell.outcome = trainer.phase, "stopped"
        if not _wait(lambda: sup.restarts > restarts, done, 0.01):  # noqa: B023
            return
        completed = sup.completed
        if not _wait(lambda: sup.completed > completed, done, 0.01):  # noqa: B023
            return
        cell.recovered_s = time.monotonic() - start
        cell.outcome = "learner restarted" if trainer.learner_restarts > learner_restarts else "replaced"


def one_run(out: Path, trainer_kind: str, signal_name: str, names: list[str]) -> dict:
    """One run with ``names`` fired in turn; its cells and how the run ended."""
    cells = [Cell(role, phase) for role, phase in (name.split("@") for name in names)]
    iterations = 4 + (GAP + 2) * len(cells)  # slack: a restarted learner redoes iterations
    cfg = load_config(None, [f"stop.iterations={iterations}", "eval.every=2", "eval.samples=1",
                             f"rollout.max_staleness={1 if trainer_kind == 'async' else 0}",
                             "output.checkpoint_every=1", "output.keep_checkpoints=2", "output.save_model=false",
                             f"cluster.call_timeout_s={TIMEOUT_S:g}", f"cluster.sync_timeout_s={TIMEOUT_S:g}",
                             # One restart per cell, cells GAP iterations apart: never a crash loop.
                             "cluster.max_actor_restarts=2", f"cluster.restart_window={GAP}",
                             f"output.dir={out}", "output.overwrite=true"])
    trainer = make_trainer(cfg)
    done = threading.Event()
    injector = threading.Thread(target=_inject, args=(trainer, cells, SIGNALS[signal_name], done), daemon=True)
    injector.start()
    start, ended, error = time.perf_counter(), "completed", ""
    try:
        result = run(cfg, trainer, progress=False)
        ended = f"{result.stop_reason} ({result.iterations} iterations)"
    except Exception as exc:  # noqa: BLE001 - a stopped run is a result of the matrix
        ended, error = "stopped", brief(exc)
    finally:
        done.set()
        injector.join(timeout=5)
    try:
        standing = str(latest_checkpoint(out).name)
    except CheckpointError:
        standing = "none"
    for cell in cells:
        if cell.outcome == "stopped":
            cell.detail = f"{error} (checkpoint standing: {standing})"
    return {"trainer": trainer_kind, "signal": signal_name, "iterations": iterations, "ended": ended,
            "error": error, "seconds": time.perf_counter() - start, "cells": [asdict(c) for c in cells]}


def table(runs: list[dict]) -> str:
    """The markdown table: fault x phase x trainer -> outcome."""
    lines = ["| trainer | signal | role | phase | landed in | outcome | s to the next iteration |",
             "|---|---|---|---|---|---|---|"]
    for r in runs:
        for c in r["cells"]:
            seconds = f"{c['recovered_s']:.1f}" if c["recovered_s"] is not None else "-"
            outcome = c["outcome"] + (f": {c['detail']}" if c["detail"] else "")
            lines.append(f"| {r['trainer']} | SIG{r['signal']} | {c['role']} | {c['phase']} | {c['landed'] or '-'} | "
                         f"{outcome} | {seconds} |")
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--trainer", choices=[*CELLS, "both"], default="both", help="which trainer(s) to run")
    parser.add_argument("--signal", choices=[*SIGNALS, "both"], default="both", help="SIGKILL, SIGSTOP or both")
    parser.add_argument("--cells", nargs="*", help="role@phase cells to fire (default: all of the trainer's)")
    parser.add_argument("--out", default="runs/fault_matrix", help="folder for the runs, the JSON and the table")
    args = parser.parse_args()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    runs = []
    for kind in CELLS if args.trainer == "both" else [args.trainer]:
        for name in SIGNALS if args.signal == "both" else [args.signal]:
            runs.append(one_run(out / f"{kind}-{name.lower()}", kind, name, args.cells or CELLS[kind]))
            print(table(runs[-1:]), flush=True)
    (out / "fault_matrix.json").write_text(json.dumps(runs, indent=1))
    (out / "fault_matrix.md").write_text(table(runs) + "\n")
    print(table(runs))


if __name__ == "__main__":
    main()
