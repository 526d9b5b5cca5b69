"""Checkpoints and ``rayppo train --resume``: atomic folders, clear errors, and exact resumption
after a real SIGKILL of the driver (fp32, fixed seed: the resumed iterations equal the
uninterrupted run's)."""

from __future__ import annotations

import json
import os
import re
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from rayppo.cli import main
from rayppo.config.load import load_config
from rayppo.config.schema import ConfigError
from rayppo.run.checkpoint import CheckpointError, latest_checkpoint, resume_config, write_checkpoint
from rayppo.run.metrics import MetricsFileError, read_metrics

# Statistics compared between the resumed and the uninterrupted run (issue: 1e-6 relative).
STATS = ("reward/mean", "policy/loss", "value/loss", "kl/ref_mean", "policy/clipfrac", "policy/approx_kl",
         "value/mean", "entropy", "kl_coef", "distill/reverse_kl_mean")
RELATIVE = 1e-6


def _records(out: Path) -> list[dict[str, float]]:
    return [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]


def _worst_gap(a: list[dict[str, float]], b: list[dict[str, float]]) -> float:
    """Largest relative difference of ``STATS`` between two runs' records, iteration by iteration."""
    assert [r["iteration"] for r in a] == [r["iteration"] for r in b]
    keys = [k for k in STATS if k in a[0]] + [k for k in a[0] if k.startswith("dynamic/")]  # no value/* without a critic
    gap = max(abs(x[k] - y[k]) / max(abs(x[k]), abs(y[k]), 1e-12) for x, y in zip(a, b) for k in keys)
    print(f"worst relative gap to the uninterrupted run: {gap:.2e}")  # the figure the README quotes (-s)
    return gap


WORKLOADS = {
    "gae": [],
    "grpo+dynamic sampling": ["ppo.advantage=grpo", "rollout.samples_per_prompt=4",
                              "rollout.dynamic_sampling_rounds=2", "rollout.batch_size=8"],
    "distillation": ["distill.teacher=embedded", "distill.coef=0.5"],
    "multi-turn": ["model.policy=embedded-guess", "data.prompts=embedded-guess", "rollout.max_new_tokens=40",
                   "rollout.environment=rayppo.tasks.guess:HigherLower", "rollout.max_turns=6"],
}


@pytest.mark.parametrize("estimator", list(WORKLOADS))
def test_reference_trainer_resumes_exactly(tmp_path, small_overrides, estimator):
    """trainer=reference: 2 iterations, then --resume to 4, equals 4 uninterrupted iterations; also
    for a critic-free estimator on groups whose extra prompt draws (dynamic sampling) move the
    prompt order that the checkpoint holds, for on-policy distillation (the teacher comes back with
    the run: its term is in the resumed updates), and for multi-turn episodes (the guessing game), whose
    environment processes start again on resume."""
    groups = WORKLOADS[estimator]
    base = [o for o in small_overrides if not o.startswith(("stop.", "output.dir"))] + ["output.checkpoint_every=1"]
    base += groups
    whole, part = tmp_path / "whole", tmp_path / "part"
    assert main(["train", "--no-progress", *base, "stop.iterations=4", f"output.dir={whole}"]) == 0
    assert main(["train", "--no-progress", *base, "stop.iterations=2", f"output.dir={part}"]) == 0
    assert latest_checkpoint(part).name == "iter_000002"
    assert main(["train", "--no-progress", "--resume", str(part), "stop.iterations=4"]) == 0
    assert _worst_gap(_records(whole), _records(part)) < RELATIVE
    assert len(list((part / "checkpoints").glob("iter_*"))) == 2  # output.keep_checkpoints


def test_resume_refuses_changes_to_the_math_and_names_the_field(tmp_path, small_overrides):
    out = tmp_path / "run"
    assert main(["train", "--no-progress", *small_overrides, f"output.dir={out}", "output.checkpoint_every=1"]) == 0
    cfg, checkpoint = resume_config(out, ["stop.iterations=9", "reference.cpus=1"])
    assert cfg.stop.iterations == 9 and checkpoint.name == "iter_000002"
    with pytest.raises(ConfigError, match=r"^ppo.lr: cannot change on --resume \(0.0003 -> 0.1\)"):
        resume_config(out, ["ppo.lr=0.1"])
    with pytest.raises(ConfigError, match="^output.dir: cannot change"):
        resume_config(out, [f"output.dir={tmp_path / 'elsewhere'}"])
    # The split over actors may change (the learner's state is resharded on load); not ZeRO-2 -> 3.
    cfg, _ = resume_config(out, ["learner.num_ranks=1", "generators.num=2", "reward.num=2", "learner.zero_stage=1"])
    assert (cfg.learner.num_ranks, cfg.generators.num, cfg.reward.num, cfg.learner.zero_stage) == (1, 2, 2, 1)
    with pytest.raises(ConfigError, match=r"^learner.zero_stage: cannot change on --resume \(2 -> 3\): only ZeRO-1"):
        resume_config(out, ["learner.zero_stage=3"])


def test_a_damaged_checkpoint_falls_back_to_the_previous_whole_one_or_names_the_file(tmp_path, small_overrides,
                                                                                     capsys, caplog):
    """Real damage on disk: a half-written folder, a file truncated as by a full disk, a file
    overwritten since; --resume takes the newest whole checkpoint, or stops with one line."""
    out = tmp_path / "run"
    assert main(["train", "--no-progress", *small_overrides, f"output.dir={out}", "output.checkpoint_every=1"]) == 0
    root = out / "checkpoints"
    assert sorted(p.name for p in root.glob("iter_*")) == ["iter_000001", "iter_000002"]  # keep_checkpoints=2
    (root / ".tmp-checkpoint").mkdir()  # a crash while writing the next one: latest is intact
    assert latest_checkpoint(out) == root / "iter_000002"
    trainer_file = root / "iter_000002" / "trainer.pt"
    size = trainer_file.stat().st_size
    with trainer_file.open("r+b") as f:
        f.truncate(size // 2)
    with caplog.at_level("WARNING", logger="rayppo.run.checkpoint"):
        assert latest_checkpoint(out) == root / "iter_000001"
    assert f"{trainer_file} has {size // 2:,} bytes, its manifest says {size:,}" in caplog.text
    assert "resuming from iter_000001, the newest whole checkpoint" in caplog.text
    (root / "latest").write_text("iter_000007\n")  # names nothing: the newest whole one is taken
    assert latest_checkpoint(out) == root / "iter_000001"
    state = root / "iter_000001" / "driver.json"
    state.write_text(state.read_text().replace('"iteration": 1', '"iteration": 9'))  # same size, other bytes
    assert main(["train", "--no-progress", "--resume", str(out)]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err[-1].startswith("rayppo: error: --resume: ") and "no whole checkpoint in" in err[-1]
    assert str(root / "iter_000001" / "driver.json") in err[-1] and str(trainer_file) in err[-1]
    with pytest.raises(CheckpointError, match="has no checkpoint"):
        latest_checkpoint(tmp_path)


def test_a_run_resumes_past_a_damaged_checkpoint_and_a_torn_metrics_line(tmp_path, small_overrides, capsys):
    """Killed while writing: the newest checkpoint's weights truncated, the last metrics record
    torn. --resume takes the checkpoint before, leaves the torn record out and completes."""
    out = tmp_path / "run"
    base = [o for o in small_overrides if not o.startswith(("stop.", "output.dir"))] + ["output.checkpoint_every=1"]
    assert main(["train", "--no-progress", *base, "stop.iterations=3", f"output.dir={out}"]) == 0
    with (out / "checkpoints" / "iter_000003" / "trainer.pt").open("r+b") as f:
        f.truncate(100)
    metrics = out / "metrics.jsonl"
    whole = metrics.read_text()
    metrics.write_text(whole + whole.splitlines()[-1][:17])  # a fourth record, cut mid-write
    assert [r["iteration"] for r in read_metrics(metrics)] == [0, 1, 2]
    assert main(["train", "--no-progress", "--resume", str(out), "stop.iterations=4"]) == 0
    assert "resuming from iter_000002, the newest whole checkpoint" in capsys.readouterr().err
    assert [r["iteration"] for r in _records(out)] == [0, 1, 2, 3]  # iteration 2 redone, replacing its record
    lines = metrics.read_text().splitlines()
    metrics.write_text("\n".join([lines[0], "{not json", *lines[1:]]) + "\n")
    with pytest.raises(MetricsFileError, match=rf"^{re.escape(str(metrics))}:2: not a JSON record"):
        read_metrics(metrics)


class _Saver:
    """A trainer's checkpoint part without a trainer: one file, and the iteration it holds."""

    def __init__(self, iteration: int, payload: bytes = b"weights") -> None:
        self.iteration, self.payload = iteration, payload

    def checkpoint(self, path: Path) -> dict:
        (path / "state.bin").write_bytes(self.payload)
        return {"iteration": self.iteration}


def test_checkpoints_are_named_after_what_they_hold_and_rewrites_are_atomic(tmp_path):
    root = tmp_path / "checkpoints"
    assert write_checkpoint(tmp_path, _Saver(7), keep=2).name == "iter_000007"  # not the caller's count
    write_checkpoint(tmp_path, _Saver(7, b"newer"), keep=2)  # the same iteration again
    assert (root / "iter_000007" / "state.bin").read_bytes() == b"newer" and not list(root.glob(".old-*"))
    # A crash between the two renames of a rewrite: the old copy is aside, latest names nothing.
    os.replace(root / "iter_000007", root / ".old-iter_000007")
    assert latest_checkpoint(tmp_path) == root / "iter_000007"  # put back, whole
    assert (root / "iter_000007" / "state.bin").read_bytes() == b"newer"
    # keep_checkpoints=1 after a run went back to an earlier checkpoint: what latest names stays.
    write_checkpoint(tmp_path, _Saver(3), keep=1)
    assert [p.name for p in root.glob("iter_*")] == ["iter_000003"]
    assert latest_checkpoint(tmp_path) == root / "iter_000003"


def _train(out: Path, args: list[str]) -> subprocess.Popen:
    """``rayppo train`` as its own process group (the driver and the local Ray it starts)."""
    return subprocess.Popen([sys.executable, "-m", "rayppo.cli", "train", "--no-progress", *args, f"output.dir={out}"],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True)


RUN_ARGS = ["generators.backend=vllm", "learner.num_ranks=1", "rollout.batch_size=16", "ppo.lr=0.003",
            "output.checkpoint_every=1", "output.save_model=false", "output.tensorboard=false"]
"""The distributed runs below (Ray, DeepSpeed, vLLM generators, fp32): vLLM is the default backend,
each row sampled with a seed of its own (``sample_seeds``); the hf generator's resumption is the
in-process trainer's, shown exactly above."""


@pytest.fixture(scope="module")
def uninterrupted(tmp_path_factory, embedded_dir) -> list[dict[str, float]]:
    """The records of 4 iterations of ``RUN_ARGS`` run without a stop, on 1 generator."""
    out = tmp_path_factory.mktemp("whole")
    proc = _train(out, [*RUN_ARGS, "stop.iterations=4"])
    assert proc.wait(timeout=400) == 0, proc.communicate()[1][-3000:]
    return _records(out)


def _wait_for(what, timeout_s: float = 400) -> None:
    deadline = time.time() + timeout_s
    while time.time() < deadline and not what():
        time.sleep(0.2)


@pytest.mark.slow
def test_sigkill_after_iteration_k_then_resume_equals_the_uninterrupted_run(tmp_path, uninterrupted):
    """SIGKILL the driver's whole process group once the checkpoint after iteration 2 is in place,
    resume, and compare iterations 2-3 with the run that was never interrupted."""
    killed = tmp_path / "killed"
    proc = _train(killed, [*RUN_ARGS, "stop.iterations=1000"])
    latest = killed / "checkpoints" / "latest"
    _wait_for(lambda: proc.poll() is not None or (latest.is_file() and latest.read_text().strip() >= "iter_000002"))
    os.killpg(proc.pid, signal.SIGKILL)
    proc.wait()
    done = int(latest_checkpoint(killed).name.removeprefix("iter_"))
    resumed = _train(killed, ["--resume", str(killed), f"stop.iterations={done + 2}"])
    assert resumed.wait(timeout=400) == 0, resumed.communicate()[1][-3000:]
    records = _records(killed)
    assert [r["iteration"] for r in records] == list(range(done + 2))  # no iteration twice, none lost
    if done + 2 > 4:  # the kill came late: compare what the uninterrupted run has
        pytest.fail(f"the driver was killed after iteration {done}, past the uninterrupted run's 4")
    assert _worst_gap(uninterrupted[done:done + 2], records[done:]) < RELATIVE


@pytest.mark.slow
def test_a_job_scaled_while_it_runs_goes_on_as_the_uninterrupted_run(tmp_path, uninterrupted):
    """``rayppo scale DIR generators.num=2`` once iteration 0 is done: the new generator joins the
    running fleet after the iteration in flight, with no restart. Then ``reward.num=2``: the driver
    writes a checkpoint and resumes from it on the new split in the same process. Every iteration
    equals the uninterrupted run's (a row's noise is its own, whichever generator draws it)."""
    out = tmp_path / "scaled"
    out.mkdir()
    # The first request is left before the driver starts (as one made while no driver runs): it is
    # taken after iteration 0 whatever the machine's speed. The second is made while the driver
    # waits for the new generator to start, and is taken after iteration 1.
    (out / "scale.json").write_text(json.dumps({"overrides": ["generators.num=2"]}))
    proc = _train(out, [*RUN_ARGS, "stop.iterations=4"])
    _wait_for(lambda: proc.poll() is not None or not (out / "scale.json").exists())  # taken
    assert main(["scale", str(out), "reward.num=2"]) == 0
    _, stderr = proc.communicate(timeout=400)
    assert proc.returncode == 0, stderr[-3000:]
    said = stderr + (out / "logs" / "driver.log").read_text()
    assert "rayppo scale: generators.num 1 -> 2 after iteration" in said and "join the fleet" in said
    assert "generator 1 joined the fleet at iteration" in said
    assert "rayppo scale: reward.num 1 -> 2 after iteration" in said and "resume on the new split" in said
    assert not (out / "scale.json").exists()  # each taken once
    records = _records(out)
    assert [r["iteration"] for r in records] == [0, 1, 2, 3]
    assert [r["fleet/generators"] for r in records] == [1, 2, 2, 2]  # joined, and stayed after the restart
    assert load_config(out / "config.yaml", paths_relative_to_file=False).generators.num == 2  # as --resume reads it
    assert _worst_gap(uninterrupted, records) < RELATIVE


def test_a_failed_final_export_keeps_the_trained_state_and_resume_exports_it(tmp_path, small_overrides, capsys):
    """The final export fails (a file stands where the policy folder goes): the trained state was
    checkpointed before the export began, even with periodic checkpoints off, the error is one line
    naming the checkpoint and the command, and that command exports the same policy."""
    out = tmp_path / "run"
    out.mkdir()
    (out / "policy").write_text("in the way")
    assert main(["train", "--no-progress", *small_overrides, "output.checkpoint_every=0"]) == 2
    err = capsys.readouterr().err
    line = next(line for line in err.splitlines() if "final export" in line)
    assert f"rayppo train --resume {out}" in line and "iter_000002" in line and "Traceback" not in err
    assert latest_checkpoint(out).name == "iter_000002"
    (out / "policy").unlink()
    assert main(["train", "--no-progress", "--resume", str(out)]) == 0
    from transformers import AutoModelForCausalLM

    assert AutoModelForCausalLM.from_pretrained(out / "policy").num_parameters() > 0
    assert len(_records(out)) == 2  # the resume trained nothing more


def _run_folder(tmp_path: Path, overrides: list[str]) -> Path:
    """A run folder as ``rayppo train`` leaves it: its config.yaml."""
    import yaml

    from rayppo.config.schema import to_dict

    out = tmp_path / "run"
    out.mkdir(parents=True)
    (out / "config.yaml").write_text(yaml.safe_dump(to_dict(load_config(None, overrides + [f"output.dir={out}"]))))
    return out


def test_a_scale_request_changes_only_the_split_names_what_it_refuses_and_is_taken_once(tmp_path):
    from rayppo.run.scale import pending, request_scale, take_request

    out = _run_folder(tmp_path, ["cluster.num_cpus=2"])
    refusals = {"ppo.lr=0.1": r"ppo\.lr: not part of the split over actors .*rayppo train --resume",
                "learner.zero_stage=3": r"learner\.zero_stage: cannot change on --resume \(2 -> 3\)",
                "generators.num=0": r"generators\.num"}
    for override, refusal in refusals.items():
        with pytest.raises(ConfigError, match=refusal):
            request_scale(out, [override])
    with pytest.raises(CheckpointError, match="is not a rayppo run folder"):
        request_scale(tmp_path / "elsewhere", ["generators.num=2"])
    assert not (out / "scale.json").exists()  # nothing refused is left for the driver
    assert request_scale(out, ["generators.num=2"]) == "generators.num 1 -> 2"
    assert request_scale(out, ["learner.num_ranks=1", "generators.num=3"]) == (
        "learner.num_ranks 2 -> 1, generators.num 1 -> 3")  # merged with the request still waiting
    assert pending(out) == ["generators.num=3", "learner.num_ranks=1"]
    assert take_request(out) == ["generators.num=3", "learner.num_ranks=1"] and take_request(out) is None
    assert request_scale(out, ["reward.cpus=0.5"]) == "reward.cpus 0.25 -> 0.5"  # a role's resources too
    take_request(out)
    inprocess = _run_folder(tmp_path / "one", ["trainer=reference"])
    with pytest.raises(ConfigError, match="runs in one process"):
        request_scale(inprocess, ["generators.num=2"])


def test_only_more_generators_join_the_running_fleet_anything_else_restarts_from_a_checkpoint():
    from rayppo.run.scale import grows_fleet_only

    base = ["generators.num=2", "learner.num_ranks=2"]

    def grows(*changes: str, start: tuple[str, ...] = ()) -> bool:
        return grows_fleet_only(load_config(None, [*base, *start]), load_config(None, [*base, *start, *changes]))

    assert grows("generators.num=4") and grows("generators.num=3", "generators.min_num=2")
    assert not grows("generators.num=1")  # fewer: the reserved bundles go back through a restart
    assert not grows("generators.num=3", "learner.num_ranks=1") and not grows("reward.num=2")
    assert not grows("generators.num=2", start=("cluster.colocate_all=true",))  # in the learner's bundles
    assert not grows()


def test_rayppo_status_of_a_run_folder_says_where_it_stands(tmp_path, small_overrides, capsys):
    from rayppo.run.scale import request_scale

    out = tmp_path / "run"
    assert main(["train", "--no-progress", *small_overrides, "output.checkpoint_every=1"]) == 0
    capsys.readouterr()
    assert main(["status", str(out)]) == 0
    said = capsys.readouterr().out.splitlines()
    assert said[0].startswith("iterations: 2 of 2 (last: reward/mean ") and said[1] == f"checkpoint: {out}/checkpoints/iter_000002"
    (out / "fleet.json").write_text(json.dumps({"generators": 4, "active": [0, 1, 3], "waiting": [2], "min_num": 2,
                                                "lost": 1, "iteration": 7}))
    with pytest.raises(ConfigError):
        request_scale(out, ["generators.num=2"])  # an in-process run has no split: nothing waits
    assert main(["status", str(out)]) == 0
    assert ("generators: 3 of 4 sampling (1 waiting for a place: 2), at least 2; lost 1 time"
            in capsys.readouterr().out)
    assert main(["status", str(tmp_path)]) == 2  # a folder that holds no run
    assert "is not a rayppo run folder" in capsys.readouterr().err


def test_the_driver_refuses_a_split_that_does_not_fit_and_goes_on(tmp_path, capsys):
    """Taken between two iterations: a request for more CPUs than the machine has is refused on
    one line (the run keeps its split); one that fits stops the loop for the resume on it."""
    from rayppo.run.scale import request_scale
    from rayppo.train import _Loop

    out = _run_folder(tmp_path, ["cluster.num_cpus=2"])
    cfg = load_config(out / "config.yaml", paths_relative_to_file=False)
    loop = _Loop(cfg, trainer=None, out=out, logger=None, bar=None, stop=None, it=3)
    request_scale(out, ["generators.num=9"])
    assert not loop._take_rescale() and loop.rescale is None
    assert re.search(r"rayppo scale generators\.num=9: refused \(it does not fit: .*CPU.*\); the run goes on as it is",
                     capsys.readouterr().err)
    request_scale(out, ["generators.num=2", "learner.num_ranks=1"])
    assert loop._take_rescale() and (loop.rescale.generators.num, loop.rescale.learner.num_ranks) == (2, 1)
    assert "rayppo scale: learner.num_ranks 2 -> 1, generators.num 1 -> 2 after iteration 2" in capsys.readouterr().err


@pytest.mark.slow
def test_a_lora_run_with_adapter_sync_resumes_as_it_would_have_gone_on(tmp_path):
    """LoRA with adapter sync and the base as the reference: a run stopped after its checkpoint
    at iteration 2 and resumed serves the restored adapter to a fresh generator (the weight check
    passes at the resume's sync) and trains iteration 2 as the run that never stopped did. The
    stopped run is the uninterrupted one's folder cut back to that checkpoint (one process start
    fewer than running it again; the resume cannot tell)."""
    lora = [*RUN_ARGS, "learner.lora_rank=4", "learner.lora_alpha=32", "ppo.lr=0.01", "ppo.kl_coef=0.05"]
    whole, stopped = tmp_path / "whole", tmp_path / "stopped"
    proc = _train(whole, [*lora, "stop.iterations=3"])
    assert proc.wait(timeout=400) == 0, proc.communicate()[1][-3000:]
    # The run stopped after its checkpoint at iteration 2 is the whole run's folder as it stood then:
    # its checkpoint of iteration 2 (checkpoint_every=1) named the latest, the later one gone.
    shutil.copytree(whole, stopped)
    shutil.rmtree(stopped / "checkpoints" / "iter_000003")
    (stopped / "checkpoints" / "latest").write_text("iter_000002\n")
    shutil.rmtree(stopped / "logs")  # what the driver says below is the resumed run's own
    config = stopped / "config.yaml"  # the folder's own name in its config, as a run there would have
    config.write_text(config.read_text().replace(str(whole), str(stopped)))
    resumed = _train(stopped, ["--resume", str(stopped), "stop.iterations=3"])
    _, stderr = resumed.communicate(timeout=400)
    assert resumed.returncode == 0, stderr[-3000:]
    assert "LoRA sync: only the LoRA adapter travels (r=4)" in stderr + (stopped / "logs" / "driver.log").read_text()
    records = _records(stopped)
    assert [r["iteration"] for r in records] == [0, 1, 2]
    assert all(r["sync/verified"] == 1.0 for r in records)
    assert records[2]["kl/ref_mean"] > 1e-4  # the restored adapter, not a fresh one, measured against the base
    assert _worst_gap(_records(whole)[2:], records[2:]) < RELATIVE
