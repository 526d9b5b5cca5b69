"""Starting a local Ray instance, or joining a cluster, for the length of a job."""

from __future__ import annotations

import logging
import os
import secrets
import stat
from collections.abc import Callable
from pathlib import Path
from typing import Any

import ray

from rayppo.cluster.address import chosen_address, refuse_left_over, running_cluster
from rayppo.cluster.placement import local_cpus
from rayppo.console import console

log = logging.getLogger(__name__)

# What every actor process of a job needs in its environment.
ACTOR_ENV = {
    "TOKENIZERS_PARALLELISM": "false",
    "VLLM_ENABLE_V1_MULTIPROCESSING": "0",  # vLLM engine inside the actor process
    "VLLM_CPU_OMP_THREADS_BIND": "nobind",
    # NCCL's NVLink SHARP (NVLS) can hang or corrupt collectives on H100/H200 nodes when each Ray
    # actor sees only its own GPUs through CUDA_VISIBLE_DEVICES (NVIDIA/nccl#1906, the mitigation
    # NeMo-RL ships). Costs nothing elsewhere; cluster.actor_env can set it back to 1.
    "NCCL_NVLS_ENABLE": "0",
}


class RaySession:
    """``with RaySession(address, num_cpus):`` joins the cluster the user chose (``address``, else
    ``$RAY_ADDRESS``: ``chosen_address``) or starts a private local instance, and cleans up after.

    No job-level runtime environment is set here: each actor gets ``ACTOR_ENV`` in its own
    options, and a submitted job's runtime environment (working dir, env vars) stays untouched.
    """

    def __init__(self, address: str | None, num_cpus: float | None, cpus_asked: float = 0.0, verbose: bool = True):
        """``num_cpus``: the local instance's logical CPUs (None: the machine's cores, or
        ``cpus_asked``, what the job's roles reserve, when that is more). ``verbose=False``
        keeps Ray's banners, the actors' output and what the cluster reports out of this terminal
        (they have log files)."""
        self.address, self.num_cpus, self.cpus_asked = address, num_cpus, cpus_asked
        self.verbose = verbose
        self.started = False
        self._restore: Callable[[], None] | None = None

    def __enter__(self) -> RaySession:
        if ray.is_initialized():
            return self
        quiet = {"log_to_driver": self.verbose, "logging_level": logging.INFO if self.verbose else logging.WARNING}
        if not self.verbose:
            # Ray announces its default token authentication at every local start (the docs'
            # security section says what it means); not a warning about this job.
            logging.getLogger("ray._private.authentication.authentication_token_setup").setLevel(logging.ERROR)
        address = chosen_address(self.address)
        if address:
            console.phase(f"connecting to the Ray cluster at {address}" + ("" if self.address else " ($RAY_ADDRESS)"))
            refuse_left_over(address)
            ray.init(address=address, **quiet)
        else:
            # Ray 2.60's servers listen on every interface whatever the node address (measured:
            # tests/test_security.py), so what keeps this instance private is the token Ray
            # generates for a new local cluster (~/.ray/auth_token): left on unless the user
            # turned it off, and then said out loud.
            if os.environ.get("RAY_AUTH_MODE", "").lower() == "disabled":
                log.warning("RAY_AUTH_MODE=disabled: the local Ray instance accepts anyone who can reach this "
                            "machine's Ray ports (they listen on every interface); unset it to keep token "
                            "authentication on")
            else:
                private_token_file()
            cpus = self.num_cpus or local_cpus(self.cpus_asked)
            cores = os.cpu_count() or 1
            over = f" on {cores} cores (oversubscribed: the stages of an iteration take turns)" if cpus > cores else ""
            other = running_cluster()
            beside = (f"; a Ray cluster already runs on this machine ({other}): cluster.address=auto runs the job "
                      "on it instead" if other else "")
            console.phase(f"starting a local Ray instance with {cpus:g} logical CPUs{over}{beside}")
            # address="local": a new instance whatever Ray would find to join (Ray 2.60,
            # ray/_private/services.py canonicalize_bootstrap_address returns None for "local"
            # before reading $RAY_ADDRESS or the ray_current_cluster file; ray/_private/worker.py
            # init overrides only a None or "auto" address with $RAY_ADDRESS). Without it, init
            # joins a `ray start` cluster (or the address a dead one left) and refuses num_cpus.
            ray.init(address="local", num_cpus=cpus, include_dashboard=False, dashboard_host="127.0.0.1", **quiet)
            self.started = True
        if not self.verbose:
            self._restore = cluster_reports_to_log()
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def close(self) -> None:
        if self.started and ray.is_initialized():
            ray.shutdown()
        self.started = False
        if self._restore is not None and not ray.is_initialized():  # a joined cluster's driver stays
            self._restore()  # connected until it exits, and what the cluster reports still goes to the log
            self._restore = None


REPORTS_LOGGER = "raylet"
"""The logger of what the cluster reports to the driver: not rayppo's, so the terminal leaves it to driver.log."""


def cluster_reports_to_log() -> Callable[[], None]:
    """Send what the cluster reports to this driver to the log (``logs/driver.log``) instead of the
    terminal; returns the function that puts Ray's printing back.

    Ray's driver prints every error the cluster pushes to it on stdout, in colour, whatever
    ``log_to_driver`` says (Ray 2.60: ``ray/_private/worker.py``, ``listen_error_messages`` calls the
    module's ``print_to_stdstream`` by name): a raylet that died is reported by each of its node's
    two agents with the last 20 lines of its log, an object-store state dump
    (``ray/_private/process_watcher.py``). When a generator's node is lost that is ~40 lines beside
    rayppo's own, which says what the loss means for the run ("generator 1 left the fleet ...").
    """
    from ray._private import worker

    printed = getattr(worker, "print_to_stdstream", None)
    if printed is None:  # another Ray: its printing left as it is (tests/test_terminal.py says so)
        return lambda: None
    reports = logging.getLogger(REPORTS_LOGGER)

    def to_log(data: dict[str, Any], ignore_prefix: bool = False) -> None:
        source = f"{data.get('pid', 'ray')}" + (f", ip={data['ip']}" if data.get("ip") else "")
        for line in data.get("lines", []):
            reports.warning("(%s) %s", source, line)

    def restore() -> None:
        worker.print_to_stdstream = printed

    worker.print_to_stdstream = to_log
    return restore


def private_token_file() -> Path | None:
    """Make the local instance's token file readable by this user only (0600 in a 0700 folder).

    Ray 2.60 writes ``~/.ray/auth_token`` with the process umask (usually 0644 in a 0755 folder;
    ray/_private/authentication/authentication_token_setup.py, ``generate_and_save_token``), and
    whoever reads the token can run code in the cluster as this user. A missing token is created
    here first, 0600 from its first byte (the same 256-bit hex token Ray would generate), so no
    other user can ever read it; an existing one is tightened. ``RAY_AUTH_TOKEN`` in the
    environment (no file) or ``RAY_AUTH_TOKEN_PATH`` (the user's own file) are left alone.
    Returns the token file handled, or None.
    """
    if os.environ.get("RAY_AUTH_TOKEN") or os.environ.get("RAY_AUTH_TOKEN_PATH"):
        return None
    path = Path.home() / ".ray" / "auth_token"
    path.parent.mkdir(mode=0o700, parents=True, exist_ok=True)
    os.chmod(path.parent, stat.S_IMODE(path.parent.stat().st_mode) & 0o700)
    try:
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    except FileExistsError:
        os.chmod(path, 0o600)
        return path
    with os.fdopen(fd, "w") as f:
        f.write(secrets.token_hex(32))
    return path
