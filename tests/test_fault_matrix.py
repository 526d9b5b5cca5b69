"""The fault matrix (``benchmarks/fault_matrix.py``): SIGKILL and SIGSTOP of every role's process in
every phase of an iteration, in the synchronous and the asynchronous trainer, each survived.

Opt-in (``RAYPPO_FAULT_MATRIX=1``): the four runs take ~40 minutes on a 2-core machine, more than
the suite's budget; the suite itself covers one cell of each kind (``test_failures.py``,
``test_async.py``, ``test_interrupt.py``, ``test_resume.py``).

    RAYPPO_FAULT_MATRIX=1 python -m pytest tests/test_fault_matrix.py -s
"""

from __future__ import annotations

import importlib.util
import os
import sys
from pathlib import Path

import pytest

OPTED_IN = os.environ.get("RAYPPO_FAULT_MATRIX") == "1"
pytestmark = [pytest.mark.slow,
              pytest.mark.skipif(not OPTED_IN, reason="the fault matrix takes ~40 minutes: opt in with "
                                                      "RAYPPO_FAULT_MATRIX=1")]
SCRIPT = Path(__file__).resolve().parents[1] / "benchmarks" / "fault_matrix.py"


def _matrix():
    spec = importlib.util.spec_from_file_location("rayppo_fault_matrix_test", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # its dataclasses look their module up by name
    spec.loader.exec_module(module)
    return module


@pytest.mark.parametrize("signal_name", ["KILL", "STOP"])
@pytest.mark.parametrize("trainer", ["sync", "async"])
def test_every_role_signalled_in_every_phase_is_survived(tmp_path, trainer, signal_name):
    matrix = _matrix()
    result = matrix.one_run(tmp_path / "run", trainer, signal_name, matrix.CELLS[trainer])
    print(matrix.table([result]))
    assert result["ended"] == f"completed ({result['iterations']} iterations)", result["error"]
    outcomes = {c["role"] + "@" + c["phase"]: c["outcome"] for c in result["cells"]}
    expected = {name: "learner restarted" if name.startswith("learner") else "replaced" for name in outcomes}
    assert outcomes == expected
