"""Ctrl-C during a distributed run: it stops cleanly after saving a checkpoint."""

from __future__ import annotations

import signal
import subprocess
import sys
import time

import pytest

pytestmark = pytest.mark.slow


def test_ctrl_c_saves_a_checkpoint_and_exits_130(tmp_path, embedded_dir):
    out = tmp_path / "run"
    proc = subprocess.Popen(
        [sys.executable, "-m", "rayppo.cli", "train", "--no-progress", "generators.backend=hf",
         "learner.num_ranks=1", "rollout.batch_size=16", "stop.iterations=1000", f"output.dir={out}"],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
    )
    metrics = out / "metrics.jsonl"
    deadline = time.time() + 240
    while time.time() < deadline and proc.poll() is None:
        if metrics.exists() and len(metrics.read_text().splitlines()) >= 2:
            break
        time.sleep(1)
    assert proc.poll() is None, proc.communicate()
    proc.send_signal(signal.SIGINT)
    stdout, stderr = proc.communicate(timeout=240)
    assert proc.returncode == 130, stderr[-3000:]  # 128 + SIGINT, as a shell reports an interrupted command
    assert "interrupted:" in stdout and "saving a checkpoint" in stderr and f"rayppo train --resume {out}" in stderr
    assert len(metrics.read_text().splitlines()) >= 2
    done = len(metrics.read_text().splitlines())
    checkpoint = out / "checkpoints" / (out / "checkpoints" / "latest").read_text().strip()
    assert checkpoint.name == f"iter_{done:06d}"  # the state after the last completed iteration
    state_files = list((checkpoint / "policy").rglob("*"))
    assert any(p.name.endswith("optim_states.pt") for p in state_files), state_files  # optimizer state
    assert list((checkpoint / "critic").rglob("*optim_states.pt"))
    assert (out / "policy" / "config.json").is_file() and (out / "critic" / "value_head.safetensors").is_file()


def test_first_ctrl_c_asks_for_a_stop_and_the_second_aborts():
    import os

    from rayppo.train import _StopRequest

    before = signal.getsignal(signal.SIGINT)  # SIG_IGN when the tests run as a background job
    stop = _StopRequest()
    with stop.installed():
        os.kill(os.getpid(), signal.SIGINT)
        time.sleep(0.1)  # the handler runs between bytecodes of the main thread
        assert stop.requested  # no KeyboardInterrupt yet: the iteration may finish
        with pytest.raises(KeyboardInterrupt):
            os.kill(os.getpid(), signal.SIGINT)
            time.sleep(1)
    assert signal.getsignal(signal.SIGINT) is before  # the previous handler restored
