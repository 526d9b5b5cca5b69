"""Which Ray cluster a job runs on: the one the user named, else a private local instance.

Ray 2.60's ``ray.init()`` without an address joins whatever it finds (ray/_private/worker.py
``init``; ray/_private/services.py ``get_ray_address_from_environment``): ``$RAY_ADDRESS``, else
the cluster whose GCS address the last ``ray start`` on this machine wrote to ``ray_current_cluster``
in Ray's temp folder (ray/scripts/scripts.py ``start``, ``write_ray_address``) — even a cluster that
has died since: only ``ray stop`` deletes that file. Joining, ``init`` refuses ``num_cpus``, so a
plain local start crashed wherever a developer's ``ray start --head`` (or another job's cluster,
or its leftover file) was on the machine. rayppo makes the choice explicit instead:

    cluster.address set            join it (``auto``: Ray's own search, $RAY_ADDRESS first)
    else $RAY_ADDRESS host:port    join it (the user's standing choice; a Ray job's driver gets it)
    else                           a private local instance, beside any cluster that runs here
                                   (said in its start-up line, with cluster.address=auto)

``auto`` with only a dead cluster's file fails at once, naming the file, instead of waiting out
Ray's retries.

Ray is imported only in ``recorded_cluster`` (``rayppo plan`` without an address needs none).
"""

from __future__ import annotations

import os
import socket

from rayppo.errors import RayppoError


def chosen_address(configured: str | None) -> str | None:
    """The Ray cluster to join: ``cluster.address``, else ``$RAY_ADDRESS``; None: start a local
    instance. ``RAY_ADDRESS=local`` (Ray's own word for a new local instance) and an
    ``http(s)://`` address (a Jobs API, which ``rayppo submit`` reads from it; ``ray.init``
    refuses one) name no cluster to join."""
    if configured:
        return configured
    env = os.environ.get("RAY_ADDRESS", "").strip()
    if not env or env == "local" or env.startswith(("http://", "https://")):
        return None
    return env


def machine_cores(configured: str | None) -> int | None:
    """The cores this process may use, when the run starts its own local Ray instance (every actor
    on this machine; ``configured`` is ``cluster.address``); None when it joins a cluster, whose
    machines it does not see from here."""
    return None if chosen_address(configured) else len(os.sched_getaffinity(0))


def running_cluster() -> str | None:
    """The GCS address of the cluster ``cluster.address=auto`` would join on this machine, if a
    server answers there; None if Ray's ``ray_current_cluster`` file is missing or left over."""
    recorded = recorded_cluster()
    return recorded[0] if recorded and recorded[2] else None


def refuse_left_over(address: str) -> None:
    """Fail at once (not after minutes of Ray's retries: measured > 120 s) when ``address`` is
    ``auto``, no ``$RAY_ADDRESS`` overrides it, and Ray's file names a cluster that has stopped."""
    if address != "auto" or os.environ.get("RAY_ADDRESS"):
        return
    recorded = recorded_cluster()
    if recorded and not recorded[2]:
        gcs, path, _ = recorded
        raise RayppoError(f"cluster.address=auto: no Ray cluster answers at {gcs}, the address in {path} (left by "
                          "a cluster that has stopped; `ray stop` deletes the file): start a cluster, name one, or "
                          "leave cluster.address unset for a local Ray instance")


def recorded_cluster() -> tuple[str, str, bool] | None:
    """``(GCS address, file, answers)`` from Ray's ``ray_current_cluster`` file in the temp folder
    Ray reads (``$RAY_TMPDIR``, ``$TMPDIR`` or /tmp, then ``ray/``; ray/_common/utils.py
    ``get_ray_address_file``); ``answers``: something accepts connections at that address now.
    None without a readable file."""
    from ray._common.utils import get_ray_address_file

    path = get_ray_address_file(None)
    try:
        with open(path, encoding="utf-8") as f:
            address = f.read().strip()
        host, port = address.rsplit(":", 1)
        port_number = int(port)
    except (OSError, ValueError):
        return None
    try:
        with socket.create_connection((host.strip("[]"), port_number), timeout=2.0):
            return address, path, True
    except OSError:
        return address, path, False
