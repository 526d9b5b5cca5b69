"""``fleet.json``: the generator fleet as the driver last saw it, in the run folder.

``Fleet`` (``cluster/fleet.py``) writes it whole on every change; ``rayppo status DIR``
(``run/status.py``) reads it back with ``fleet_line``. The name and the reading live here, apart
from the fleet, so that the run's status is read without Ray: this module imports the standard
library only, and ``run/``, a floor above the cluster, may import it.
"""

from __future__ import annotations

import json
from pathlib import Path

FLEET_FILE = "fleet.json"
"""The generator fleet as the driver last saw it, in the run folder."""


def fleet_line(run_dir: Path) -> str | None:
    """``generators: 1 of 2 sampling (1 waiting for a place: 1), at least 1; lost 1 time`` from
    ``fleet.json``; None when the run has none (the in-process trainer, or not started)."""
    try:
        state = json.loads((run_dir / FLEET_FILE).read_text())
        active, waiting, total, lost = state["active"], state["waiting"], state["generators"], state["lost"]
    except (OSError, ValueError, KeyError, TypeError):
        return None
    waits = f" ({len(waiting)} waiting for a place: {', '.join(map(str, waiting))})" if waiting else ""
    return (f"generators: {len(active)} of {total} sampling{waits}, at least {state.get('min_num', 1)}; "
            f"lost {lost} time{'' if lost == 1 else 's'}")
