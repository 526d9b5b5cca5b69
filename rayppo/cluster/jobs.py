"""Ray Jobs: submit rayppo jobs to a running cluster, follow them, stop them.

    rayppo submit --address http://head:8265 --config job.yaml generators.num=4 --wait
    rayppo status JOB_ID | rayppo logs JOB_ID --follow | rayppo stop JOB_ID

A submission ships a working directory: a copy of your project folder (``--working-dir``,
default the current directory: your reward module, prompt files and configs, so that
``reward.function=my_reward:score`` and relative paths work on the cluster as they do here;
``.git``, virtual environments, ``runs/`` and whatever ``.gitignore`` / ``.rayignore`` exclude
stay behind), ``job.yaml`` (the resolved config, with ``cluster.address=auto`` so the job joins
the cluster it runs on) and, by default, this checkout's ``rayppo`` package (and ``benchmarks/``
for bench jobs), so the cluster runs the code you have. The job starts in that directory. The
cluster needs the dependencies (torch, vLLM, DeepSpeed, ...) installed, as in ``deploy/Dockerfile``.
"""

from __future__ import annotations

import asyncio
import math
import os
import shutil
import sys
import tempfile
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path

import yaml
from ray.exceptions import AuthenticationError
from ray.job_submission import JobStatus, JobSubmissionClient

from rayppo.cluster.session import ACTOR_ENV
from rayppo.config.schema import Config, ConfigError, to_dict
from rayppo.errors import RayppoError, plain

DEFAULT_ADDRESS = "http://127.0.0.1:8265"
PACKAGE_DIR = Path(__file__).resolve().parents[1]
TERMINAL = {JobStatus.SUCCEEDED, JobStatus.FAILED, JobStatus.STOPPED}
STOP_WAIT_ENV = "RAY_JOB_STOP_WAIT_TIME_S"
"""Seconds between the SIGTERM and the SIGKILL of a stopped job. Ray 2.60's job supervisor
(``ray/dashboard/modules/job/job_supervisor.py``, ``JobSupervisor.run``) reads it from its own
environment when it stops the job, default 3 s; the supervisor actor is started with the job's
``runtime_env`` env_vars (``job_manager.py``, ``_get_supervisor_runtime_env``), so it must be set
there at submission: setting it later, or on the machine that calls ``stop``, has no effect."""
STOP_MARGIN_S = 10
"""Seconds of the SIGKILL delay beyond ``stop.sigterm_grace_s``: Python, Ray and the actors exit."""


def stop_wait_s(cfg: Config) -> int:
    """The SIGKILL delay a submitted job gets: its SIGTERM grace and the margin (whole seconds:
    Ray parses the variable as an integer)."""
    return math.ceil(cfg.stop.sigterm_grace_s) + STOP_MARGIN_S


class JobsApiError(RayppoError):
    """The cluster's Jobs API could not be reached or refused this client; one line saying which."""


def jobs_url(address: str | None) -> str:
    """The Jobs API of a cluster: ``address`` or ``$RAY_ADDRESS`` or the local dashboard."""
    return address or os.environ.get("RAY_ADDRESS") or DEFAULT_ADDRESS


def client(address: str | None) -> JobSubmissionClient:
    return JobSubmissionClient(jobs_url(address))


@contextmanager
def answered(address: str | None) -> Iterator[None]:
    """Ray's errors of Jobs API calls as rayppo's one line (``JobsApiError``): a cluster that wants
    its token (Ray's ``AuthenticationError`` runs to 28 lines), one that cannot be reached."""
    url = jobs_url(address)
    try:
        yield
    except AuthenticationError:
        raise JobsApiError(f"the Ray cluster at {url} refused this client: it needs the cluster's token (export "
                           "RAY_AUTH_MODE=token and RAY_AUTH_TOKEN=..., or RAY_AUTH_TOKEN_PATH=FILE)") from None
    except ConnectionError as exc:
        raise JobsApiError(f"cannot reach the Ray cluster's Jobs API at {url} ({plain(str(exc))}); is its dashboard "
                           "running there (--address, or $RAY_ADDRESS)?") from None


def list_jobs(address: str | None) -> list[str]:
    """One line per job of the cluster, the newest first: id, status, what it runs, since when."""
    lines = []
    for info in sorted(client(address).list_jobs(), key=lambda i: i.start_time or 0, reverse=True):
        started = time.strftime("%Y-%m-%d %H:%M", time.localtime(info.start_time / 1000)) if info.start_time else "-"
        what = (info.metadata or {}).get("rayppo", "")
        lines.append(f"{info.submission_id or info.job_id}  {info.status.value:<9} {started}  "
                     f"{('rayppo ' + what) if what else info.entrypoint}")
    return lines


LEFT_BEHIND = (".git", ".venv", ".venv-*", "venv", "runs", "__pycache__", "*.pyc", ".pytest_cache", "*.egg-info",
               "node_modules")
"""Never shipped from the working directory (Ray also applies its .gitignore and .rayignore)."""


def _copy_working_dir(source: Path, staging: Path, output_dir: str) -> None:
    """The user's project folder into the job's working directory, without what stays behind."""
    if not source.is_dir():
        raise ConfigError(f"--working-dir: {source} is not a folder")
    output = Path(output_dir).resolve()

    def ignore(folder: str, names: list[str]) -> set[str]:
        left = set(shutil.ignore_patterns(*LEFT_BEHIND)(folder, names))
        return left | {n for n in names if (Path(folder) / n).resolve() == output}

    shutil.copytree(source, staging, ignore=ignore, dirs_exist_ok=True, symlinks=True)


def _staging_dir(cfg: Config, ship_code: bool, with_benchmarks: bool, working_dir: Path | None) -> Path:
    staging = Path(tempfile.mkdtemp(prefix="rayppo-job-"))
    if working_dir is not None:
        _copy_working_dir(working_dir, staging, cfg.output.dir)
    job = to_dict(cfg)
    job["cluster"]["address"] = "auto"  # the job's driver joins the cluster it was submitted to
    (staging / "job.yaml").write_text(yaml.safe_dump(job, sort_keys=False))
    if ship_code:
        ignore = shutil.ignore_patterns("__pycache__", "*.pyc")
        shutil.copytree(PACKAGE_DIR, staging / "rayppo", ignore=ignore, dirs_exist_ok=True)
        if with_benchmarks:
            shutil.copytree(PACKAGE_DIR.parent / "benchmarks", staging / "benchmarks", ignore=ignore,
                            dirs_exist_ok=True)
    return staging


def pin_output_dir(cfg: Config) -> str | None:
    """Make a relative ``output.dir`` absolute (from the current directory), and say so.

    A job runs in Ray's temporary copy of its working directory (under the session's
    ``runtime_resources/working_dir_files/``): a relative ``output.dir`` would put the trained
    policy there, where nobody looks and Ray deletes it. Returns the note to print, or None."""
    given = Path(cfg.output.dir)
    if given.is_absolute():
        return None
    cfg.output.dir = str(given.resolve())
    return (f"output.dir={given} is relative, and a job runs in a temporary copy of its working directory: it "
            f"writes to {cfg.output.dir} (on a cluster of several machines, give a folder they all share with you)")


@dataclass(frozen=True)
class Shipment:
    """What a submission carries besides its config, and what the job runs."""

    env: dict[str, str] = field(default_factory=dict)
    """Environment variables of the job (``--env KEY=VALUE``), beside rayppo's own."""
    ship_code: bool = True
    """Ship this checkout's ``rayppo`` package (and ``benchmarks/`` for a bench job)."""
    bench: str | None = None
    """Run ``rayppo bench --workload BENCH`` instead of ``rayppo train``."""
    submission_id: str | None = None
    """The job's id; None: Ray's."""
    working_dir: Path | None = None
    """The project folder to ship; None: only job.yaml and the code."""


def submit(cfg: Config, address: str | None, shipment: Shipment) -> str:
    """Submit ``rayppo train`` (or ``rayppo bench --workload BENCH``) with ``cfg``, shipping what
    ``shipment`` says; returns the job id. ``output.dir`` must be absolute (``pin_output_dir``)."""
    bench, ship_code = shipment.bench, shipment.ship_code
    if not Path(cfg.output.dir).is_absolute():
        raise ConfigError(f"output.dir: {cfg.output.dir} is relative; a job runs in a temporary copy of its working "
                          "directory (give an absolute path, on storage the cluster shares)")
    staging = _staging_dir(cfg, ship_code, bench is not None, shipment.working_dir)
    # With the code shipped, `python -m rayppo.cli` imports it from the job's working directory.
    program = "python -m rayppo.cli" if ship_code else "rayppo"
    if bench:
        entrypoint = f"{program} bench --workload {bench} --output {cfg.output.dir}"
    else:
        entrypoint = f"{program} train --config job.yaml --no-progress"
    runtime_env = {"working_dir": str(staging),
                   "env_vars": {**ACTOR_ENV, STOP_WAIT_ENV: str(stop_wait_s(cfg)), **shipment.env}}
    return client(address).submit_job(entrypoint=entrypoint, runtime_env=runtime_env,
                                      submission_id=shipment.submission_id,
                                      metadata={"rayppo": bench or "train", "output_dir": cfg.output.dir})


@dataclass(frozen=True)
class JobStanding:
    """Where a job stands on the cluster; the run's own progress is read from ``run_dir`` by the
    caller (``rayppo.run.status``: a floor above the cluster's)."""

    state: str
    """``RUNNING``, with the cluster's message in brackets when it has one."""
    run_dir: str | None
    """The run folder (``output.dir``) of a ``rayppo train`` job; None for a bench job or another's."""


def status(job_id: str, address: str | None) -> JobStanding:
    """The job's state, and the folder its run writes (when it is a ``rayppo train``)."""
    info = client(address).get_job_info(job_id)
    message = f" ({info.message})" if info.message else ""
    metadata = info.metadata or {}
    run_dir = metadata.get("output_dir") if metadata.get("rayppo") == "train" else None
    return JobStanding(f"{info.status.value}{message}", run_dir)


def logs(job_id: str, address: str | None, follow: bool, out=None) -> None:
    out = out or sys.stdout
    c = client(address)
    if not follow:
        out.write(c.get_job_logs(job_id))
        return

    async def tail() -> None:
        async for chunk in c.tail_job_logs(job_id):
            out.write(chunk)
            out.flush()

    asyncio.run(tail())


def stop(job_id: str, address: str | None, timeout_s: float | None = None) -> str:
    """Ask the cluster to stop the job (SIGTERM: a rayppo run finishes its iteration and writes a
    checkpoint within its grace) and wait until it has; returns the final status. Default wait:
    the job's SIGKILL delay and a minute."""
    c = client(address)
    if timeout_s is None:
        env = (c.get_job_info(job_id).runtime_env or {}).get("env_vars") or {}
        timeout_s = float(env.get(STOP_WAIT_ENV, 3)) + 60.0
    c.stop_job(job_id)
    deadline = time.time() + timeout_s
    while time.time() < deadline:
        state = c.get_job_status(job_id)
        if state in TERMINAL:
            return state.value
        time.sleep(1)
    return c.get_job_status(job_id).value


def wait(job_id: str, address: str | None, out=None) -> str:
    """Follow the job's logs until it ends; returns its final status."""
    logs(job_id, address, follow=True, out=out)
    c = client(address)
    while (state := c.get_job_status(job_id)) not in TERMINAL:  # logs can end a moment early
        time.sleep(0.5)
    return state.value
