"""Ctrl-C and SIGTERM during a run: it stops cleanly at an iteration boundary with a checkpoint, or at
once (naming the checkpoint that stands) when there is no time to finish; `rayppo pairs` stops the
same way between its batches."""

from __future__ import annotations

import json
import re
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

    from rayppo.train import StopRequest

    before = signal.getsignal(signal.SIGINT)  # SIG_IGN when the tests run as a background job
    stop = StopRequest()
    with stop.installed():
        os.kill(os.getpid(), signal.SIGINT)
        time.sleep(0.1)  # the handler runs between bytecodes of the main thread
        assert stop.requested  # no KeyboardInterrupt yet: the iteration may finish
        with pytest.raises(KeyboardInterrupt):
            os.kill(os.getpid(), signal.SIGINT)
            time.sleep(1)
    assert signal.getsignal(signal.SIGINT) is before  # the previous handler restored


def _train(out, *args: str) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-m", "rayppo.cli", "train", "--no-progress", *args, f"output.dir={out}"],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def _records_reach(proc: subprocess.Popen, metrics, n: int, timeout_s: float = 240) -> None:
    deadline = time.time() + timeout_s
    while time.time() < deadline and proc.poll() is None:
        if metrics.exists() and len(metrics.read_text().splitlines()) >= n:
            return
        time.sleep(0.2)
    raise AssertionError(proc.communicate())


def test_sigterm_finishes_the_iteration_saves_its_checkpoint_exits_143_and_resumes(tmp_path, small_overrides):
    """A preemption (a real SIGTERM to the driver; periodic checkpoints off): the iteration in
    flight completes, its checkpoint is written, nothing completed is lost, --resume goes on. (The
    distributed trainer gets its SIGTERM from Ray's job supervisor in test_cluster.py.)"""
    out = tmp_path / "run"
    args = [o for o in small_overrides if not o.startswith(("stop.", "output.dir"))] + ["output.checkpoint_every=0"]
    proc = _train(out, *args, "stop.iterations=1000")
    metrics = out / "metrics.jsonl"
    _records_reach(proc, metrics, 2)
    sent = time.monotonic()
    proc.send_signal(signal.SIGTERM)
    stdout, stderr = proc.communicate(timeout=120)
    seconds = time.monotonic() - sent
    print(f"SIGTERM to exit: {seconds:.1f} s")  # measured, not asserted (shared machines)
    assert proc.returncode == 143, stderr[-3000:]
    done = len(metrics.read_text().splitlines())
    assert "preempted:" in stdout and "Preempted (SIGTERM) after" in stderr
    checkpoint = out / "checkpoints" / (out / "checkpoints" / "latest").read_text().strip()
    assert checkpoint.name == f"iter_{done:06d}"  # every completed iteration kept, the one in flight included
    assert not (out / "policy").exists()  # a preempted run is not finished: no final model yet
    resumed = _train(out, "--resume", str(out), f"stop.iterations={done + 1}")
    stdout, stderr = resumed.communicate(timeout=300)
    assert resumed.returncode == 0, stderr[-3000:]
    assert [json.loads(line)["iteration"] for line in metrics.read_text().splitlines()] == list(range(done + 1))
    assert (out / "policy" / "config.json").is_file()


def test_sigterm_without_the_time_to_finish_stops_at_once_and_names_the_checkpoint_that_stands(tmp_path,
                                                                                                small_overrides):
    """stop.sigterm_grace_s=0: no time for the iteration in flight; no checkpoint is written from a
    state half-way through it, the last periodic one stands."""
    out = tmp_path / "run"
    base = [o for o in small_overrides if not o.startswith(("stop.", "output.dir"))]
    proc = _train(out, *base, "output.checkpoint_every=1", "stop.sigterm_grace_s=0", "stop.iterations=1000")
    _records_reach(proc, out / "metrics.jsonl", 2)
    before = sorted(p.name for p in (out / "checkpoints").glob("iter_*"))
    proc.send_signal(signal.SIGTERM)
    _, stderr = proc.communicate(timeout=120)
    assert proc.returncode == 143, stderr[-3000:]
    latest = (out / "checkpoints" / "latest").read_text().strip()
    assert f"the checkpoint {out / 'checkpoints' / latest} stands" in stderr
    assert latest >= before[-1]  # only periodic checkpoints, the newest named


def test_sigterm_decides_by_the_time_left_and_cuts_short_when_the_grace_is_spent():
    """The preemption rule on this process: an iteration that cannot finish within the grace is
    stopped at once; one that can is left to finish, unless it overruns the grace (its checkpoint's
    time kept back)."""
    import os

    from rayppo.train import StopRequest

    stop = StopRequest(grace_s=10.0)
    with stop.installed():
        stop.last_iteration_s = 100.0  # the iteration in flight needs ~100 s more
        with pytest.raises(KeyboardInterrupt):
            os.kill(os.getpid(), signal.SIGTERM)
            time.sleep(1)
    assert stop.requested == "preempted"
    stop = StopRequest(grace_s=0.6)
    with stop.installed():
        stop.iteration_done(0.1)
        stop.last_checkpoint_s = 0.1
        os.kill(os.getpid(), signal.SIGTERM)
        time.sleep(0.1)
        assert stop.requested == "preempted"  # fits: no interrupt yet
        started = time.monotonic()
        with pytest.raises(KeyboardInterrupt):
            time.sleep(5)  # an iteration that overruns: cut short at grace - checkpoint time
        assert 0.2 < time.monotonic() - started < 4.5  # cut short, not slept out
    assert signal.getsignal(signal.SIGTERM) is not stop._sigterm  # the previous handler restored


def test_ctrl_c_stops_rayppo_pairs_after_its_batch_with_every_line_whole(tmp_path, embedded_dir):
    """Started as a shell starts `rayppo pairs ... &` (SIGINT ignored, which it also was while vLLM
    sampled: the command had no handler of its own), a Ctrl-C reaches it as it reaches `rayppo
    train`: the batch in flight completes and is written, then it stops with 130; the file holds
    whole lines, the pairs the summary counts."""
    pairs = tmp_path / "pairs.jsonl"
    proc = subprocess.Popen([sys.executable, "-m", "rayppo.cli", "pairs", "--no-progress", f"preference.pairs={pairs}",
                             "preference.samples_per_prompt=4", "rollout.batch_size=16"],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=tmp_path,
                            preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_IGN))
    try:
        deadline = time.time() + 240
        while time.time() < deadline and proc.poll() is None and not (pairs.exists() and pairs.stat().st_size):
            time.sleep(0.2)  # the first batch written: the second is being sampled
        assert proc.poll() is None, proc.communicate()
        proc.send_signal(signal.SIGINT)
        stdout, stderr = proc.communicate(timeout=120)  # the 32 batches of the embedded task take minutes
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == 130, stderr[-3000:]
    assert "Ctrl-C: stopping after this batch (Ctrl-C again to stop now)" in stderr
    text = pairs.read_text()
    assert text.endswith("\n")
    rows = [json.loads(line) for line in text.splitlines()]
    said = re.match(r"interrupted: (\d+) pairs from (\d+) prompts", stdout)
    assert said and int(said[1]) == len(rows) > 0, stdout
    # Whole batches of 16 prompts (the one written when the signal came, and the one in flight), far
    # fewer than the embedded task's 512.
    assert int(said[2]) % 16 == 0 and 16 <= int(said[2]) <= 64, stdout
