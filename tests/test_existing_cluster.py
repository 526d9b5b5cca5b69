"""A Ray cluster already on the machine (a developer's ``ray start --head``, another job's) and the
address file a dead one leaves behind: ``rayppo train``'s local start (``RaySession`` with no
``cluster.address``) runs on a private instance beside them and says so; ``cluster.address=auto``
and ``$RAY_ADDRESS`` still join the running cluster; ``auto`` with only a dead cluster's file
fails at once in one line.

Each test gets its own Ray temp folder (``RAY_TMPDIR``: where ``ray start`` writes
``ray_current_cluster`` and ``ray.init`` looks for it), so nothing here touches /tmp/ray or any
other Ray on the machine; the ``ray start --block`` head is stopped by its process id.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import pytest

from rayppo.cluster.address import chosen_address
from rayppo.learner.broadcast_sender import free_port

RAY = str(Path(sys.executable).parent / "ray")
POINTER = "ray/ray_current_cluster"
"""Ray 2.60's address file under the temp folder (ray/_common/utils.py ``get_ray_address_file``)."""

# One driver process, several sessions in turn (imports once): ``local`` (no cluster.address),
# ``auto`` (cluster.address=auto), ``env`` (no cluster.address, RAY_ADDRESS=$CLUSTER).
DRIVER = """
import os, sys, ray
from rayppo.cluster.session import RaySession
from rayppo.errors import RayppoError
for mode in sys.argv[1:]:
    if mode == "env":
        os.environ["RAY_ADDRESS"] = os.environ["CLUSTER"]
    try:
        with RaySession("auto" if mode == "auto" else None, 1, verbose=False):
            answer = ray.get(ray.remote(lambda: 42).remote(), timeout=60) if mode == "local" else "-"
            print(mode, "GCS", ray._private.worker.global_worker.node.address, answer, flush=True)
    except RayppoError as exc:
        print(mode, "REFUSED", exc, flush=True)
    ray.shutdown()  # a session that joined a cluster stays connected (only a local one shuts down)
    os.environ.pop("RAY_ADDRESS", None)
"""


def _temp() -> Path:
    return Path(tempfile.mkdtemp(prefix="rp-ex-", dir="/tmp"))  # short: Ray's socket paths live under it


def _env(temp: Path, **extra: str) -> dict[str, str]:
    base = {k: v for k, v in os.environ.items() if k != "RAY_ADDRESS"}  # conftest: RAY_AUTH_MODE=disabled
    return {**base, "RAY_TMPDIR": str(temp), **extra}


def _drive(temp: Path, *modes: str, **extra: str) -> tuple[dict[str, list[str]], str]:
    """Run DRIVER: ``({mode: its printed words}, stderr)``."""
    result = subprocess.run([sys.executable, "-c", DRIVER, *modes], env=_env(temp, **extra), capture_output=True,
                            text=True, timeout=150)
    assert result.returncode == 0, result.stderr[-3000:]
    said = {words[0]: words[1:] for words in map(str.split, result.stdout.splitlines()) if words and words[0] in modes}
    assert set(said) == set(modes), (result.stdout, result.stderr[-3000:])
    return said, result.stderr


@pytest.mark.parametrize(("configured", "env", "joined"), [
    (None, None, None),                                 # a private local instance
    (None, "10.0.0.1:6379", "10.0.0.1:6379"),           # the user's standing choice, as ray.init honours it
    (None, "local", None),                              # Ray's own word for a new local instance
    (None, "http://10.0.0.1:8265", None),               # a Jobs API (rayppo submit's), not a cluster to join
    ("auto", "10.0.0.1:6379", "auto"),                  # Ray resolves auto (RAY_ADDRESS first)
    ("ray://head:10001", "10.0.0.1:6379", "ray://head:10001"),  # cluster.address wins
])
def test_the_cluster_a_job_joins(monkeypatch, configured, env, joined):
    if env is None:
        monkeypatch.delenv("RAY_ADDRESS", raising=False)
    else:
        monkeypatch.setenv("RAY_ADDRESS", env)
    assert chosen_address(configured) == joined


@pytest.fixture(scope="module")
def cluster():
    """``ray start --head --block`` (1 CPU, no dashboard) in its own temp folder: ``(temp, GCS address)``."""
    temp = _temp()
    head = subprocess.Popen([RAY, "start", "--head", "--block", f"--port={free_port()}", "--num-cpus=1",
                             "--include-dashboard=false", "--disable-usage-stats"], env=_env(temp),
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True)
    try:
        deadline = time.monotonic() + 90
        while not (temp / POINTER).exists():  # written once the head is up (ray/scripts/scripts.py start)
            assert head.poll() is None and time.monotonic() < deadline, "ray start --head did not come up"
            time.sleep(0.5)
        yield temp, (temp / POINTER).read_text().strip()
    finally:
        head.terminate()  # --block: the head's SIGTERM handler stops the processes it started
        try:
            head.wait(timeout=60)
        except subprocess.TimeoutExpired:
            head.kill()  # its reaper then ends the rest of its process group
            head.wait(timeout=30)
        shutil.rmtree(temp, ignore_errors=True)


@pytest.mark.slow
def test_a_running_cluster_gets_a_private_instance_beside_it_and_auto_joins_it(cluster):
    """With a ``ray start`` cluster up, the local start (which crashed: ``ValueError: When connecting
    to an existing cluster, num_cpus and num_gpus must not be provided``) runs its own instance,
    names the cluster and ``cluster.address=auto`` in its start-up line, and leaves the cluster's
    address file alone; ``auto`` and ``$RAY_ADDRESS`` join the cluster."""
    temp, gcs = cluster
    said, stderr = _drive(temp, "local", "auto", "env", CLUSTER=gcs)
    assert said["local"][0] == "GCS" and said["local"][1] != gcs and said["local"][2] == "42", said
    assert (f"starting a local Ray instance with 1 logical CPUs; a Ray cluster already runs on this machine ({gcs}): "
            "cluster.address=auto runs the job on it instead") in stderr, stderr
    assert said["auto"][:2] == ["GCS", gcs], said
    assert said["env"][:2] == ["GCS", gcs], said
    assert f"connecting to the Ray cluster at {gcs} ($RAY_ADDRESS)" in stderr, stderr
    assert (temp / POINTER).read_text().strip() == gcs


@pytest.mark.slow
def test_a_dead_clusters_address_file_breaks_nothing():
    """The file a stopped cluster leaves (``ray stop`` alone deletes it): the local start runs
    (it crashed like the above) and says nothing about a cluster; ``auto`` fails at once in one
    line naming the file (Ray waits for that address for minutes)."""
    temp = _temp()
    try:
        (temp / "ray").mkdir()
        (temp / POINTER).write_text(f"127.0.0.1:{free_port()}")  # nothing listens there
        said, stderr = _drive(temp, "local", "auto")
        assert said["local"][0] == "GCS" and said["local"][2] == "42", said
        assert "already runs" not in stderr, stderr
        assert " ".join(said["auto"]) == (
            f"REFUSED cluster.address=auto: no Ray cluster answers at {(temp / POINTER).read_text()}, the address in "
            f"{temp / POINTER} (left by a cluster that has stopped; `ray stop` deletes the file): start a cluster, "
            "name one, or leave cluster.address unset for a local Ray instance"), said
    finally:
        shutil.rmtree(temp, ignore_errors=True)
