"""``rayppo status DIR``: where a run stands, read from its folder alone (no Ray, no cluster).

    iterations: 7 of 20 (last: reward/mean 0.41, 3.2 s)
    generators: 1 of 2 sampling (1 waiting for a place: 1), at least 1; lost 1 time
    checkpoint: runs/job/checkpoints/iter_000006
    scale request waiting: generators.num=2

The driver keeps ``fleet.json`` current (``rayppo/cluster/fleet.py``; read back by
``rayppo/cluster/fleet_file.py``); the rest is what every run writes anyway (``metrics.jsonl``,
``config.yaml``, ``checkpoints/``, ``scale.json``).
"""

from __future__ import annotations

import json
from pathlib import Path

from rayppo.cluster.fleet_file import fleet_line


def _iterations_line(run_dir: Path) -> str:
    from rayppo.config.load import load_config

    planned = load_config(run_dir / "config.yaml", paths_relative_to_file=False).stop.iterations
    lines = (run_dir / "metrics.jsonl").read_text().splitlines() if (run_dir / "metrics.jsonl").exists() else []
    records = []
    for line in lines:
        try:
            records.append(json.loads(line))
        except ValueError:  # a line being written as we read
            continue
    done = len({r.get("iteration") for r in records})
    if not records:
        return f"iterations: 0 of {planned}"
    last = records[-1]
    return (f"iterations: {done} of {planned} (last: reward/mean {last.get('reward/mean', float('nan')):.3g}, "
            f"{last.get('time/iteration', float('nan')):.1f} s)")


def run_status(run_dir: str | Path) -> list[str]:
    """The lines ``rayppo status DIR`` prints; ``CheckpointError`` when ``run_dir`` is no run folder."""
    from rayppo.run.checkpoint import CheckpointError, latest_checkpoint
    from rayppo.run.scale import pending

    run_dir = Path(run_dir)
    if not (run_dir / "config.yaml").is_file():
        raise CheckpointError(f"{run_dir / 'config.yaml'} not found: {run_dir} is not a rayppo run folder")
    lines = [_iterations_line(run_dir)]
    fleet = fleet_line(run_dir)
    if fleet:
        lines.append(fleet)
    try:
        lines.append(f"checkpoint: {latest_checkpoint(run_dir)}")
    except CheckpointError:
        lines.append("checkpoint: none yet")
    request = pending(run_dir)
    if request:
        lines.append(f"scale request waiting: {' '.join(request)}")
    return lines
