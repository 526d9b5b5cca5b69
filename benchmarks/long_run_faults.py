"""A long run with sporadic faults against a clean run of the same seed, side by side.

Both runs use the embedded default (distributed trainer: vLLM generator, reference, reward, two
DeepSpeed ranks). The faulty run SIGKILLs one actor's process every ``--every`` completed
iterations, taking the roles in turn (learner rank 0, generator, reference, reward, ...): the
restart budget (``cluster.max_actor_restarts`` within ``cluster.restart_window``) must let it
finish on its own. Reported: iterations completed, kills, restarts, the final reward (mean of
the last five iterations) of both runs, and the wall-time ratio.

    python benchmarks/long_run_faults.py --iterations 120 --every 15 --out runs/long_run_faults

Writes ``OUT/long_run_faults.json`` and prints it.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import threading
import time
from pathlib import Path

from rayppo.cluster.group import get
from rayppo.config.load import load_config
from rayppo.machine.role_resources import Engine
from rayppo.train import run
from rayppo.trainers.distributed import DistributedTrainer

ROLES = ("learner", "generators", "reference", "reward")
"""In turn, the learner first: a 120-iteration run with a kill every 15 kills it twice."""


def _kill(trainer: DistributedTrainer, role: str) -> None:
    if role == "learner":
        os.kill(trainer.learner.where[0][0], signal.SIGKILL)
        return
    group = {"generators": trainer.generators, "reference": trainer.reference, "reward": trainer.rewards}[role]
    os.kill(get(group.call_at(0, Engine.process_id, ()))[0], signal.SIGKILL)


def _killer(trainer: DistributedTrainer, every: int, total: int, kills: list[tuple[int, str]]) -> threading.Thread:
    """Kill the next role once ``supervisor.completed`` (iterations done, redone ones included)
    passes each multiple of ``every`` below ``total``."""
    def loop() -> None:
        for n, at in enumerate(range(every, total, every)):
            while trainer.supervisor.completed < at:
                time.sleep(0.05)
            role = ROLES[n % len(ROLES)]
            _kill(trainer, role)
            kills.append((at, role))

    thread = threading.Thread(target=loop, daemon=True)
    thread.start()
    return thread


def one_run(out: Path, iterations: int, every: int | None) -> dict[str, float]:
    cfg = load_config(None, [f"stop.iterations={iterations}", "eval.every=0", f"output.dir={out}",
                             "output.overwrite=true", "output.save_model=false"])
    trainer = DistributedTrainer(cfg)
    kills: list[tuple[int, str]] = []
    killer = _killer(trainer, every, iterations, kills) if every else None
    start = time.perf_counter()
    result = run(cfg, trainer, progress=False)
    seconds = time.perf_counter() - start
    records = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    if killer is not None:
        killer.join(timeout=1)
    return {"iterations": result.iterations, "stop_reason": result.stop_reason, "seconds": seconds,
            "reward_last5": result.reward_end, "kills": [f"{role}@{at}" for at, role in kills],
            "actor_restarts": records[-1]["faults/actor_restarts"],
            "learner_restarts": records[-1]["faults/learner_restarts"]}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--iterations", type=int, default=120, help="iterations of each run")
    parser.add_argument("--every", type=int, default=15, help="completed iterations between two kills")
    parser.add_argument("--out", default="runs/long_run_faults", help="folder for the runs and the JSON")
    args = parser.parse_args()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    clean = one_run(out / "clean", args.iterations, None)
    faulty = one_run(out / "faulty", args.iterations, args.every)
    result = {"iterations": args.iterations, "kill_every": args.every, "clean": clean, "faulty": faulty,
              "wall_time_ratio": faulty["seconds"] / clean["seconds"]}
    (out / "long_run_faults.json").write_text(json.dumps(result, indent=1))
    print(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
