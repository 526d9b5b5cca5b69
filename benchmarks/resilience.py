"""What failures cost, measured on the real system (Ray, vLLM, DeepSpeed) for a workload:

- a checkpoint: its size on disk and the time to write it (``write_checkpoint``, as a run does);
- a generator killed (SIGKILL) at the start of an iteration: that iteration's time minus a clean
  one's (the replacement's start, its weights, its share sampled again);
- a learner rank killed: the time from the failure to the group standing again at the latest
  checkpoint with the generators in sync (``DistributedTrainer.recover``);
- how fast bad input is answered: ``rayppo train`` with an unknown field, end to end.

    python benchmarks/resilience.py --workload tiny --out runs/resilience

Writes ``OUT/resilience-WORKLOAD.json`` and prints it.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from bench import load_workloads, prepare_models, workload_config  # noqa: E402

from rayppo.cluster.group import get  # noqa: E402
from rayppo.errors import LearnerFailedError  # noqa: E402
from rayppo.machine.role_resources import Engine  # noqa: E402
from rayppo.run.checkpoint import write_checkpoint  # noqa: E402
from rayppo.trainers.distributed import DistributedTrainer  # noqa: E402


def _folder_bytes(path: Path) -> int:
    return sum(f.stat().st_size for f in path.rglob("*") if f.is_file())


def measure(workload_name: str, out: Path) -> dict[str, float]:
    workload = load_workloads()[workload_name]
    policy, reward_model = prepare_models(workload)
    cfg = workload_config(workload, policy, reward_model, [f"output.dir={out / workload_name}"])
    trainer = DistributedTrainer(cfg)
    try:
        trainer.iteration()  # warm-up: compiled kernels, caches
        clean = trainer.iteration()["time/iteration"]
        start = time.perf_counter()
        folder = write_checkpoint(out / workload_name, trainer, keep=1)
        result = {"checkpoint_write_s": time.perf_counter() - start, "checkpoint_bytes": _folder_bytes(folder),
                  "iteration_s": clean}
        os.kill(get(trainer.generators.call_at(0, Engine.process_id, ()))[0], signal.SIGKILL)
        result["generator_restart_lost_s"] = trainer.iteration()["time/iteration"] - clean
        os.kill(trainer.learner.where[0][0], signal.SIGKILL)
        try:
            trainer.iteration()
        except LearnerFailedError as failure:
            start = time.perf_counter()
            trainer.recover(failure)
            result["learner_restart_s"] = time.perf_counter() - start
        return result
    finally:
        trainer.close()


def bad_input_seconds() -> float:
    """``rayppo train`` with a typo'd field, from process start to its exit code 2."""
    start = time.perf_counter()
    proc = subprocess.run([sys.executable, "-m", "rayppo.cli", "train", "ppo.clip_epsilon=0.1"], capture_output=True)
    assert proc.returncode == 2, proc.stderr
    return time.perf_counter() - start


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--workload", default="tiny", help="a workload of benchmarks/workloads.yaml")
    parser.add_argument("--out", default="runs/resilience", help="folder for the run and the JSON")
    args = parser.parse_args()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    result = {"workload": args.workload, **measure(args.workload, out), "bad_input_s": bad_input_seconds()}
    (out / f"resilience-{args.workload}.json").write_text(json.dumps(result, indent=1))
    print(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
