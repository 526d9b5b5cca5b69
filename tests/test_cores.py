"""``<role>.cores``: each role's actors pinned to their own CPU cores (every thread, and the
processes they start), so that roles on one machine stop sharing cores as roles on separate
GPUs would. Checked on real processes: a subprocess with threads started before the pinning, and
the actors of a real local Ray system."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from rayppo.config.load import load_config
from rayppo.config.schema import ConfigError
from rayppo.machine.role_resources import Engine
from rayppo.trainers.distributed import DistributedTrainer

CORES = sorted(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else []
needs_two_cores = pytest.mark.skipif(len(CORES) < 2, reason="pinning two roles to different cores needs a Linux "
                                                            "machine with two cores available to this process")


def _thread_masks(pid: int) -> dict[int, set[int]]:
    """CPU mask of every thread of process ``pid`` and of its descendants, by thread id."""
    masks = {}
    for tid in os.listdir(f"/proc/{pid}/task"):
        try:
            masks[int(tid)] = os.sched_getaffinity(int(tid))
            children = Path(f"/proc/{pid}/task/{tid}/children").read_text().split()
        except (ProcessLookupError, FileNotFoundError):  # the thread ended meanwhile
            continue
        for child in children:
            masks.update(_thread_masks(int(child)))
    return masks


@pytest.mark.parametrize("value, message", [
    ("[]", "must be a non-empty list"), ("[1, 1]", "lists a core twice"), ("[-1]", "must be a non-empty list"),
    ("[true]", "must be a non-empty list"), ("1", "expected a list")])
def test_bad_cores_are_refused_naming_the_field(value, message):
    with pytest.raises(ConfigError, match=rf"^learner\.cores: {message}"):
        load_config(None, [f"learner.cores={value}"])
    with pytest.raises(ConfigError, match=r"^reward\.cores: pins the distributed system's actors"):
        load_config(None, ["trainer=reference", "reward.cores=[0]"])


@needs_two_cores
def test_pinning_moves_threads_that_already_run_and_the_processes_started_later():
    # A fresh process: threads started before the call (as Ray's and torch's are in an actor)
    # must move too, and a child process started afterwards inherits the mask.
    code = f"""
import json, os, subprocess, sys, threading
from rayppo.machine.role_resources import pin_to_cores
stop = threading.Event()
workers = [threading.Thread(target=stop.wait) for _ in range(3)]
for w in workers: w.start()
pin_to_cores([{CORES[1]}], "learner.cores")
child = subprocess.run([sys.executable, "-c", "import os; print(sorted(os.sched_getaffinity(0)))"],
                       capture_output=True, text=True).stdout
masks = [sorted(os.sched_getaffinity(int(t))) for t in os.listdir("/proc/self/task")]
stop.set()
print(json.dumps({{"masks": masks, "child": json.loads(child)}}))
"""
    out = json.loads(subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout)
    assert len(out["masks"]) >= 4  # the main thread and the three started before the call
    assert all(mask == [CORES[1]] for mask in out["masks"]) and out["child"] == [CORES[1]]


@needs_two_cores
def test_a_core_the_process_cannot_use_is_refused_naming_the_field():
    code = f"from rayppo.machine.role_resources import pin_to_cores; pin_to_cores([{max(CORES) + 64}], 'generators.cores')"
    run = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert run.returncode != 0
    assert f"generators.cores: core(s) [{max(CORES) + 64}] are not available to this process" in run.stderr


@needs_two_cores
@pytest.mark.usefixtures("local_ray")
def test_each_roles_actors_run_every_thread_on_the_roles_cores(tmp_path):
    learner_core, other_core = CORES[1], CORES[0]
    cfg = load_config(None, ["learner.num_ranks=1", f"learner.cores=[{learner_core}]", f"generators.cores=[{other_core}]",
                             f"reference.cores=[{other_core}]", f"reward.cores=[{other_core}]",
                             f"output.dir={tmp_path / 'run'}"])
    trainer = DistributedTrainer(cfg)
    try:
        trainer.learner.locate()
        roles = {"learner": trainer.learner.where}
        for name, group in (("generators", trainer.generators), ("reference", trainer.reference),
                            ("reward", trainer.rewards)):
            roles[name] = group.get(group.call_all(Engine.process_id))
        for name, where in roles.items():
            expected = {learner_core} if name == "learner" else {other_core}
            for pid, _ in where:
                masks = _thread_masks(pid)
                assert len(masks) > 1, name  # Ray's threads at least
                assert all(mask == expected for mask in masks.values()), (name, masks)
    finally:
        trainer.close()
