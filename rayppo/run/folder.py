"""The run folder (``output.dir``): one run per folder, unless told to replace it.

A second ``rayppo train`` into a folder that holds a run would overwrite its metrics and models
and mix two runs' TensorBoard events, so it is refused with the three ways on: ``--resume DIR``
(continue that run), another ``output.dir``, or ``output.overwrite=true`` (delete the first run's
outputs, and only those: the folder may hold the user's own files).
"""

from __future__ import annotations

import shutil
from pathlib import Path

from rayppo.config.schema import Config, ConfigError

RUN_OUTPUTS = ("metrics.jsonl", "config.yaml", "placement.json", "plot.png", "tb", "checkpoints", "policy", "critic", "reward_model",
               "rollouts", "logs", "wandb", "wandb_run_id", "mlflow_run_id", "fleet.json", "scale.json")
"""What a run writes into its folder (what ``output.overwrite`` deletes)."""

_MARKS = ("metrics.jsonl", "checkpoints", "config.yaml")
"""Files whose presence means the folder holds a run."""


def claim_output_dir(cfg: Config) -> Path:
    """``output.dir``, made ready for a new run; ``ConfigError`` when it holds one already and
    ``output.overwrite`` is off."""
    out = Path(cfg.output.dir)
    if out.exists() and not out.is_dir():
        raise ConfigError(f"output.dir: {out} exists and is not a folder")
    found = [name for name in _MARKS if (out / name).exists()]
    if found and not cfg.output.overwrite:
        raise ConfigError(f"output.dir: {out} already holds a run ({', '.join(found)}); continue it with "
                          f"'rayppo train --resume {out}', choose another output.dir, or replace it with "
                          "output.overwrite=true")
    if found:
        _remove_outputs(out, RUN_OUTPUTS)
    out.mkdir(parents=True, exist_ok=True)
    return out


def release_output_dir(out: Path) -> None:
    """Remove what a run that completed no iteration wrote, its logs excepted, so the folder holds
    no run (``claim_output_dir`` found none there, or replaced it, before this run began)."""
    _remove_outputs(out, tuple(name for name in RUN_OUTPUTS if name != "logs"))


def _remove_outputs(out: Path, names: tuple[str, ...]) -> None:
    for name in names:
        path = out / name
        if path.is_dir() and not path.is_symlink():
            shutil.rmtree(path)
        elif path.exists() or path.is_symlink():
            path.unlink()
