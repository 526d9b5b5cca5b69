"""The bench's child processes (each stage alone, TRL in its environment): one phase line saying
what runs and where its output goes, the output in the bench folder's ``logs/``, and a failure
that names the log."""

from __future__ import annotations

import subprocess
from pathlib import Path

from bench_trl_venv import trl_environment

from rayppo.errors import RayppoError


def child_output(name: str):
    """Where a child process's output goes: ``logs/NAME.log`` of the bench folder (the terminal
    with ``--verbose``, or when nothing set the console up)."""
    from rayppo.console import console

    if console.verbose or console.log_dir is None:
        return None
    return (console.log_dir / f"{name}.log").open("a", encoding="utf-8")


def run_child(name: str, what: str, command: list[str]) -> None:
    """``command`` to its end, one phase line saying what runs and where its output is."""
    from rayppo.console import console

    log = child_output(name)
    where = f" (its output: {console.user_path(Path(log.name))})" if log else ""
    console.phase(f"{what}{where}")
    try:
        result = subprocess.run(command, stdout=log, stderr=subprocess.STDOUT if log else None, env=trl_environment())
    finally:
        if log:
            log.close()
    if result.returncode:
        raise RayppoError(f"{what} failed (exit {result.returncode})" + (f"; see {console.user_path(Path(log.name))}"
                                                                       if log else ""))
