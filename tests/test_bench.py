"""rayppo bench: the figures it derives, and a short real run of the tiny workload."""

from __future__ import annotations

import importlib.util
import json
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from rayppo.config.load import load_config
from rayppo.errors import RayppoError

BENCH = Path(__file__).resolve().parents[1] / "benchmarks" / "bench.py"


@pytest.fixture(scope="module")
def bench():
    spec = importlib.util.spec_from_file_location("rayppo_benchmarks_test", BENCH)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    return module


def record(iteration, generate, learn, sync, length=32.0):
    return {"time/iteration": iteration, "time/generate": generate, "time/reference": 0.1, "time/reward": 0.05,
            "time/learn": learn, "time/sync": sync, "time/sync_verify": sync / 4, "sync/bytes": 2e6,
            "response/length_mean": length}


def test_summary_ratios(bench):
    cfg = load_config(None, ["rollout.batch_size=64", "rollout.max_new_tokens=32"])
    records = [record(1.0, 0.5, 0.3, 0.05), record(2.0, 1.0, 0.6, 0.1), record(1.5, 0.7, 0.5, 0.15)]
    alone = {"generate": 0.6, "reference": 0.1, "reward": 0.2, "learn": 0.4}
    trl = [{"wall_s": 2.048, "gc_s": 1.024}] * 3
    arithmetic = {"learn_gflop": 100.0, "matmul_gflop_per_s": 250.0, "matmul_shape": [8, 4, 2], "matmul_threads": 2}
    s = bench.summarize("tiny", cfg, records, {"learner": 1}, alone, trl, arithmetic=arithmetic)
    assert s["learn_gflop_per_s"] == pytest.approx(100 / 0.5)  # the median learn stage
    assert s["learn_efficiency"] == pytest.approx(100 / 0.5 / 250)
    assert s["end_to_end_tokens_per_s"] == pytest.approx(2048 / 1.5)
    assert s["overhead_ratio"] == pytest.approx(1.5 / (0.6 + 0.2 + 0.4))  # reference and reward overlap
    assert s["sync_share"] == pytest.approx(0.05)
    assert s["sync_verify_share"] == pytest.approx(0.25)
    assert s["sync_gb_per_s"] == pytest.approx(2e6 / 0.1 / 1e9)
    assert s["trl_end_to_end_tokens_per_s"] == pytest.approx(1000.0)
    assert s["ratio_vs_trl"] == pytest.approx(2048 / 1.5 / 1000)
    assert s["ratio_vs_trl_without_gc"] == pytest.approx(2048 / 1.5 / 2000)
    assert s["idle_s"]["generators"]["max"] == pytest.approx(1.0)
    # Medians of idle / iteration: generators 0.5, 0.5, 0.53; learners 0.7, 0.7, 0.67.
    assert s["idle_share"] == pytest.approx({"generators": 0.5, "learners": 0.7})
    # Overlapped, the iteration (median 1.5 s) shrinks at best to its busiest stage, generate
    # (median 0.7 s); the learner (median 0.5 s) then still waits 2/7 of the time.
    assert s["busiest_stage"] == "generate" and s["overlap_bound"] == pytest.approx(1.5 / 0.7)
    assert s["idle_floor"] == pytest.approx({"generators": 0.0, "learners": 1 - 0.5 / 0.7})
    # Measured synchronously, the bound counts the pi_prox pass asynchronous mode adds to the learner.
    s = bench.summarize("tiny", cfg, records, {"learner": 1}, None, None,
                        arithmetic=arithmetic | {"proximal_flops_ratio": 1.6})
    assert s["busiest_stage"] == "learn" and s["overlap_bound"] == pytest.approx(1.5 / 0.8)
    assert s["idle_floor"] == pytest.approx({"generators": 1 - 0.7 / 0.8, "learners": 0.0})
    # Groups: 16 prompts x 4 samples generate 64 x 32 tokens, the same as 64 x 1.
    groups = load_config(None, ["rollout.batch_size=16", "rollout.samples_per_prompt=4", "rollout.max_new_tokens=32"])
    s = bench.summarize("tiny", groups, records, {"learner": 1}, None, trl, arithmetic=arithmetic)
    assert s["tokens_per_iteration"] == 2048 and s["end_to_end_tokens_per_s"] == pytest.approx(2048 / 1.5)


def test_summary_reports_every_stages_flop_rate_and_mfu(bench, capsys):
    """Per stage that runs a model: its GFLOP over its median seconds, and that over the matmul rate;
    a stage without a model (a reward function: 0 GFLOP) has neither; learn_efficiency is learn's MFU."""
    cfg = load_config(None, ["rollout.batch_size=64", "rollout.max_new_tokens=32"])
    records = [record(1.0, 0.5, 0.3, 0.05), record(2.0, 1.0, 0.6, 0.1), record(1.5, 0.7, 0.5, 0.15)]
    arithmetic = {"learn_gflop": 100.0, "matmul_gflop_per_s": 250.0, "matmul_shape": [8, 4, 2], "matmul_threads": 2,
                  "stage_gflop": {"generate": 35.0, "reference": 5.0, "reward": 0.0, "learn": 100.0}}
    s = bench.summarize("tiny", cfg, records, {"learner": 1}, None, None, arithmetic=arithmetic)
    # Medians: generate 0.7 s, reference 0.1 s, learn 0.5 s.
    assert s["stage_gflop_per_s"] == pytest.approx({"generate": 50.0, "reference": 50.0, "learn": 200.0})
    assert s["stage_mfu"] == pytest.approx({"generate": 0.2, "reference": 0.2, "learn": 0.8})
    assert s["learn_efficiency"] == s["stage_mfu"]["learn"] and s["stage_gflop"] == arithmetic["stage_gflop"]
    bench.print_table(s)
    table = capsys.readouterr().out
    assert "GFLOP/s" in table and "MFU" in table and "0.80" in table


def test_summary_counts_real_tokens_and_what_padding_costs(bench):
    """Variable lengths: rates count the responses' real tokens (rows x mean length), per iteration;
    bench.json gives the length distribution and, per stage, processed against real tokens."""
    from rayppo.data.rollout import Rollout

    cfg = load_config(None, ["rollout.batch_size=4", "rollout.max_new_tokens=8", "reference.micro_batch_tokens=0",
                             "reward.batch_size=2", "reward.micro_batch_tokens=0"])
    records = [record(1.0, 0.5, 0.3, 0.05, length=2.0), record(2.0, 1.0, 0.6, 0.1, length=6.0),
               record(4.0, 0.7, 0.5, 0.15, length=5.0)]
    records[-1] |= {"tokens/learn_real": 30.0, "tokens/learn_processed": 45.0}
    prompts, responses = [[5, 6], [5, 6, 7], [5], [5, 6]], [[9] * 8, [9] * 1, [9] * 3, [9] * 8]
    n = len(prompts)
    rollout = Rollout(prompts, responses, [[0.0] * len(r) for r in responses], ["length", "stop", "stop", "length"],
                      [""] * n, [""] * n, [0] * n, [0] * n, list(range(n)), [[0.0] * len(r) for r in responses], [0.0] * n)
    s = bench.summarize("tiny", cfg, records, {"learner": 1}, None, None, rollout=rollout)
    assert s["tokens_per_iteration"] == 4 * 5.0  # the median of 8, 24, 20 real tokens
    assert s["end_to_end_tokens_per_s"] == pytest.approx(8.0)  # the median of 8/1, 24/2, 20/4
    assert [p["response_tokens"] for p in s["per_iteration"]] == [8, 24, 20]
    assert s["lengths"] == {"mean": 5.0, "p50": 8, "p90": 8, "max": 8, "truncated_share": 0.5}
    t = s["stage_tokens"]
    assert t["generate"] == {"real": 20, "processed": 20, "padding_factor": 1.0}
    # The reference (a Llama on SDPA: the sequences end to end in one row, attention per sequence)
    # processes its 28 real tokens, not 4 rows x (the longest prompt 3 + the longest response 8).
    assert t["reference"] == {"real": 28, "processed": 28, "layout": "varlen", "padding_factor": 1.0}
    # The reward model: runs of 2 whole texts, (10, 4) then (4, 10) tokens, each padded to 10.
    assert t["reward"]["processed"] == 2 * 10 + 2 * 10
    assert t["learn"] == {"real": 30.0, "processed": 45.0, "layout": "padded", "padding_factor": 1.5}


def test_sweep_points(bench):
    points = bench.sweep_points(["generators.num=1,2", "learner.num_ranks=1,2"])
    assert points == [{"generators.num": "1", "learner.num_ranks": "1"}, {"generators.num": "1", "learner.num_ranks": "2"},
                      {"generators.num": "2", "learner.num_ranks": "1"}, {"generators.num": "2", "learner.num_ranks": "2"}]
    with pytest.raises(ValueError, match="expected key=v1,v2"):
        bench.sweep_points(["generators.num"])


def test_sweep_points_move_joined_keys_together(bench):
    points = bench.sweep_points(["learner.num_ranks:learner.threads=1:2,2:1", "generators.threads=1,2"])
    assert points == [{"learner.num_ranks": "1", "learner.threads": "2", "generators.threads": "1"},
                      {"learner.num_ranks": "1", "learner.threads": "2", "generators.threads": "2"},
                      {"learner.num_ranks": "2", "learner.threads": "1", "generators.threads": "1"},
                      {"learner.num_ranks": "2", "learner.threads": "1", "generators.threads": "2"}]
    with pytest.raises(ValueError, match="has 1 values for 2 keys"):
        bench.sweep_points(["learner.num_ranks:learner.threads=1:2,2"])


def test_workloads_file_defines_the_required_presets(bench):
    workloads = bench.load_workloads()
    assert {"tiny", "small", "small-bf16", "gpu-0.5b", "gpu-1.5b"} <= set(workloads)
    # small-bf16 is small in another dtype: the same model shape and workload
    assert workloads["small-bf16"].model == workloads["small"].model
    assert workloads["small-bf16"].config == {**workloads["small"].config, "model.dtype": "bfloat16"}
    assert workloads["tiny"].config["rollout.batch_size"] == 64 and workloads["tiny"].config["rollout.max_new_tokens"] == 32
    assert workloads["small"].config["rollout.batch_size"] == 256 and workloads["small"].config["rollout.max_new_tokens"] == 128
    # The group presets are small's shape and rows (32 prompts x 8 = 256 responses), GRPO without a critic.
    for name, dtype in (("small-grpo", "float32"), ("small-grpo-bf16", "bfloat16")):
        c = workloads[name].config
        assert workloads[name].model == workloads["small"].model and c.get("model.dtype", "float32") == dtype
        assert c["rollout.batch_size"] * c["rollout.samples_per_prompt"] == 256 and c["ppo.advantage"] == "grpo"
    # The long-tailed preset and its fixed-length reference share one model (lengths are its property)
    # at small's rows; the reference's fixed length is the long tail's mean.
    varlen, fixed = workloads["small-varlen"], workloads["small-fixed35"]
    assert varlen.model == fixed.model and varlen.model["eos_mean_length"] <= fixed.config["rollout.max_new_tokens"]
    assert varlen.config["rollout.ignore_eos"] is False and fixed.config["rollout.ignore_eos"] is True
    assert varlen.model["eos_length_cap"] == varlen.config["rollout.max_new_tokens"]
    for w in workloads.values():  # every preset's overrides are valid config
        load_config(None, [f"{k}={v}" for k, v in w.config.items()])


def fake_venv(bench, path: Path, python: bool = True, packages: bool = True, pins=None) -> Path:
    """A virtual environment's layout as venv and pip leave it, nothing installed: ``python``
    False is an interrupted ``python -m venv``, ``packages`` False a failed pip install; ``pins``
    (TRL 1.12's by default) the requirements whose dist-info folders it holds."""
    site = path / "lib" / "python3.11" / "site-packages"
    site.mkdir(parents=True)
    (path / "pyvenv.cfg").write_text("home = /usr/bin\n")
    (path / "bin").mkdir()
    if python:
        (path / "bin" / "python").symlink_to(sys.executable)
    for requirement in (pins or bench.TRL_PPO).requirements if packages else []:
        name, version = requirement.split("==")
        (site / f"{name}-{version}{'+cpu' if name == 'torch' else ''}.dist-info").mkdir()
    return path


@pytest.fixture
def read_only_dir(tmp_path):
    """A folder nothing can be made in: mode 555, or for root (whom modes do not stop) /proc."""
    folder = tmp_path / "read-only"
    folder.mkdir()
    folder.chmod(0o555)
    try:
        (folder / "probe").mkdir()
        (folder / "probe").rmdir()
        refusing = Path("/proc")  # root: procfs refuses new entries to everyone
    except PermissionError:
        refusing = folder
    yield refusing
    folder.chmod(0o755)


def test_trl_venv_states(bench, tmp_path):
    ppo = bench.TRL_PPO
    assert bench.venv_state(tmp_path / "nothing", ppo) == "missing"
    (tmp_path / "dangling").symlink_to(tmp_path / "gone")
    assert bench.venv_state(tmp_path / "dangling", ppo) == "a dangling symlink"
    (tmp_path / "file").write_text("")
    assert bench.venv_state(tmp_path / "file", ppo) == "a file"
    no_python = fake_venv(bench, tmp_path / "no-python", python=False)
    assert bench.venv_state(no_python, ppo) == "half-made (no bin/python)"
    no_trl = fake_venv(bench, tmp_path / "no-trl", packages=False)  # pip failed or was interrupted
    assert bench.venv_state(no_trl, ppo) == f"half-made (no {ppo.requirements[0]})"
    assert bench.venv_state(fake_venv(bench, tmp_path / "ready"), ppo) == "ready"
    (tmp_path / "link").symlink_to(tmp_path / "ready")
    assert bench.venv_state(tmp_path / "link", ppo) == "ready"


def test_trl_venvs_one_per_trainer_each_ready_by_its_own_pins(bench, tmp_path):
    """PPO is compared with TRL 1.12 (the last release with its value-head PPOTrainer), GRPO with
    1.16: each environment is ready only with its own list installed."""
    ppo, grpo = bench.TRL_PPO, bench.TRL_GRPO
    assert (ppo.trl, grpo.trl) == ("1.12.0", "1.16.0")
    assert bench.TRL_SCRIPTS == {"gae": ("trl_ppo.py", ppo), "grpo": ("trl_grpo.py", grpo)}
    for pins in (ppo, grpo):  # exact pins, torch the same on both sides
        assert all("==" in r for r in pins.requirements) and "torch==2.13.0" in pins.requirements
    assert len({ppo.folder, grpo.folder}) == 2 and len({ppo.env, grpo.env}) == 2
    old = fake_venv(bench, tmp_path / "old", pins=ppo)
    new = fake_venv(bench, tmp_path / "new", pins=grpo)
    assert bench.venv_state(old, ppo) == "ready" and bench.venv_state(new, grpo) == "ready"
    assert bench.venv_state(old, grpo) == "half-made (no trl==1.16.0)"
    assert bench.venv_state(new, ppo) == "half-made (no trl==1.12.0)"


def test_trl_venv_goes_beside_the_repo_else_named_else_in_the_cache(bench, tmp_path, monkeypatch, read_only_dir):
    monkeypatch.setenv("RAYPPO_CACHE", str(tmp_path / "cache"))
    repo = tmp_path / "repo"
    repo.mkdir()
    ppo, grpo = bench.TRL_PPO, bench.TRL_GRPO
    assert bench.choose_trl_venv(ppo, repo, {}) == bench.TrlVenv(repo / ".venv-trl", "beside the repository", ppo)
    assert bench.choose_trl_venv(grpo, repo, {}) == bench.TrlVenv(repo / ".venv-trl-1.16", "beside the repository",
                                                                  grpo)
    mine = {"RAYPPO_TRL_VENV": str(tmp_path / "mine"), "RAYPPO_TRL_GRPO_VENV": str(tmp_path / "mine-1.16")}
    assert bench.choose_trl_venv(ppo, repo, mine) == bench.TrlVenv(tmp_path / "mine", "from RAYPPO_TRL_VENV", ppo)
    assert bench.choose_trl_venv(grpo, repo, mine) == bench.TrlVenv(tmp_path / "mine-1.16",
                                                                    "from RAYPPO_TRL_GRPO_VENV", grpo)
    assert bench.choose_trl_venv(ppo, read_only_dir, {}) == bench.TrlVenv(tmp_path / "cache" / "venv-trl",
                                                                           f"{read_only_dir} is not writable", ppo)
    assert bench.choose_trl_venv(grpo, read_only_dir, {}).path == tmp_path / "cache" / "venv-trl-1.16"
    assert list(repo.iterdir()) == []  # the writability probe leaves nothing behind


def test_trl_venv_leftovers_are_replaced_and_nothing_else_is(bench, tmp_path, capsys):
    repo = tmp_path / "repo"
    repo.mkdir()
    venv = bench.choose_trl_venv(bench.TRL_PPO, repo, {})
    link = venv.path
    link.symlink_to(tmp_path / "gone")
    bench.clear_leftovers(venv, venv.state)
    assert not link.is_symlink() and not link.exists()
    fake_venv(bench, link, python=False)  # an interrupted python -m venv
    bench.clear_leftovers(venv, venv.state)
    assert not link.exists()
    elsewhere = fake_venv(bench, tmp_path / "elsewhere", packages=False)
    link.symlink_to(elsewhere)  # a link to a half-made environment: the link goes, its target stays
    bench.clear_leftovers(venv, venv.state)
    assert not link.exists() and (elsewhere / "bin" / "python").exists()
    fake_venv(bench, link, python=False)
    (link / "notes.txt").write_text("someone's")
    with pytest.raises(RayppoError, match="holds more than a virtual environment; move it, or set RAYPPO_TRL_VENV"):
        bench.clear_leftovers(venv, venv.state)
    assert (link / "notes.txt").exists()
    shutil.rmtree(link)
    link.write_text("")
    with pytest.raises(RayppoError, match=r"\.venv-trl \(beside the repository\) is a file"):
        bench.clear_leftovers(venv, venv.state)
    link.unlink()
    fake_venv(bench, link)
    assert bench.ensure_trl_venv(venv) == link / "bin" / "python"  # ready: used as it is, silently
    assert capsys.readouterr().err == ""
    line = bench.install_line(venv, "a dangling symlink")
    assert line == (f"TRL 1.12.0's environment: {link} (beside the repository): it was a dangling symlink, so it is "
                    f"rebuilt: a one-time install of {' '.join(bench.TRL_PPO.requirements)}, reused by later "
                    "--compare trl runs")
    grpo = bench.choose_trl_venv(bench.TRL_GRPO, repo, {})  # the other environment: its own folder and pins
    assert bench.install_line(grpo, "missing") == (
        f"TRL 1.16.0's environment: {repo / '.venv-trl-1.16'} (beside the repository): a one-time install of "
        f"{' '.join(bench.TRL_GRPO.requirements)}, reused by later --compare trl runs")
    fake_venv(bench, grpo.path, pins=bench.TRL_GRPO)
    assert bench.ensure_trl_venv(grpo) == grpo.path / "bin" / "python"
    assert capsys.readouterr().err == ""


@pytest.mark.slow
def test_bench_tiny_writes_json_and_plot_with_a_quiet_terminal(tmp_path):
    """...and the terminal of train: phases, a bar, the table; vLLM's, DeepSpeed's and Ray's
    output in the bench folder's logs/ (the stages-alone child's included)."""
    out = tmp_path / "bench"
    result = subprocess.run([sys.executable, "-m", "rayppo.cli", "bench", "--workload", "tiny", "--warmup", "1",
                             "--iters", "2", "--output", str(out), "generators.enforce_eager=true"],
                            capture_output=True, text=True, timeout=900, cwd=tmp_path)
    assert result.returncode == 0, result.stderr[-3000:]
    terminal = (result.stdout + result.stderr).splitlines()
    assert not any("INFO" in line or "Initializing a V1 LLM engine" in line or "[WARNING]" in line
                   for line in terminal), "\n".join(terminal)
    assert len(terminal) <= 46, "\n".join(terminal)  # phases, 4 ready lines, the table (~21 lines with the mismatch)
    assert any("(learn_efficiency: the learner's FLOP rate over a plain matmul's" in line for line in terminal)
    logs = out / "logs"
    assert "Initializing a V1 LLM engine" in (logs / "generator-0.log").read_text()
    assert (logs / "stages-alone.log").stat().st_size > 0 and (logs / "driver.log").exists()
    assert (out / "placement.json").is_file()
    summary = json.loads((out / "bench.json").read_text())
    for key in ("workload", "end_to_end_tokens_per_s", "overhead_ratio", "sync_share", "stage_s", "peak_memory_bytes",
                "learn_efficiency"):
        assert key in summary, key
    assert summary["learn_gflop"] > 0 and summary["matmul_gflop_per_s"] > 0
    assert summary["workload"] == "tiny" and len(summary["per_iteration"]) == 2
    assert summary["end_to_end_tokens_per_s"] > 0 and summary["overhead_ratio"] > 0.5
    # rayppo plan's peak-memory estimate is within 25% of the measured peak RSS of every role
    assert set(summary["plan_ratio"]) == {"generators", "reference", "reward", "learner"}
    assert all(0.75 <= ratio <= 1.25 for ratio in summary["plan_ratio"].values()), summary["plan_ratio"]
    assert (out / "stages.png").stat().st_size > 1000


def _load_benchmark(name: str):
    """A script of ``benchmarks/`` as a module (the folder is not a package)."""
    spec = importlib.util.spec_from_file_location(f"rayppo_{name[:-3]}_test", BENCH.parent / name)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up there
    spec.loader.exec_module(module)
    return module


def test_time_to_reward_is_the_first_moving_mean_at_the_target():
    module = _load_benchmark("async_learning.py")
    rewards = [0.3, 0.9, 0.9, 0.8, 0.9, 0.95]  # moving means of 3: -, -, 0.70, 0.867, 0.867, 0.883
    records = [{"iteration": i, "time/iteration": 2.0, "reward/mean": r} for i, r in enumerate(rewards)]
    assert module.time_to_target(records, target=0.85, window=3) == (8.0, 4)
    assert module.time_to_target(records, target=0.99, window=3) == (None, None)



def test_time_to_reward_summary_averages_the_seeds_that_reached_it_and_counts_the_rest():
    module = _load_benchmark("async_learning.py")
    curve = [(i, 0.5, 0.9) for i in range(4)]  # four iterations of 0.5 s
    runs = [{"name": "sync", "seed": 0, "seconds_to_target": 3.0, "iterations_to_target": 6, "total_seconds": 2.0,
             "curve": curve},
            {"name": "sync", "seed": 1, "seconds_to_target": None, "iterations_to_target": None, "total_seconds": 4.0,
             "curve": curve},
            {"name": "sync", "seed": 2, "seconds_to_target": 5.0, "iterations_to_target": 10, "total_seconds": 2.0,
             "curve": curve}]
    [row] = module.summary(runs)
    assert row["seconds"] == [3.0, None, 5.0] and (row["reached"], row["runs"]) == (2, 3)
    assert row["mean_seconds"] == 4.0 and row["mean_iterations"] == 8.0
    assert row["seconds_per_iteration"] == (0.5 + 1.0 + 0.5) / 3



def test_mean_curve_averages_the_seeds_per_iteration_up_to_the_shortest_run():
    module = _load_benchmark("async_learning.py")
    runs = [{"curve": [(0, 1.0, 0.2), (1, 1.0, 0.4)]}, {"curve": [(0, 3.0, 0.4), (1, 1.0, 0.8), (2, 1.0, 0.9)]}]
    xs, ys, spread = module.mean_curve(runs)
    assert xs == [2.0, 3.0]  # cumulative seconds (1, 2) and (3, 4), averaged
    assert ys == pytest.approx([0.3, 0.6]) and spread == pytest.approx([0.1, 0.2])


def test_the_reward_model_workload_times_rayppos_bradley_terry_steps(bench, tmp_path):
    """``kind: reward-model`` runs ``rayppo reward-model``'s step on the task's pairs (here on the
    embedded model: the workload's model overridden) and reports its median step; the arithmetic
    pairs it makes are right against wrong by the task's own verifier."""
    from rayppo.data.pairs import read_pairs
    from rayppo.tasks.arithmetic import reward

    w = bench.load_workloads()["smollm2-reward-model-bf16"]
    assert w.kind == "reward-model" and w.model == "smollm2-135m-instruct"
    summary = bench.run(w.name, str(tmp_path / "out"), None, 1, 2, [], ["model.policy=embedded",
                        "preference.batch_pairs=4", "preference.micro_pairs=2", "model.dtype=float32"])
    written = json.loads((tmp_path / "out" / "bench.json").read_text())
    assert written == summary and summary["kind"] == "reward-model" and "trl_step_s" not in summary
    assert len(summary["rayppo_steps_s"]) == 2 and summary["rayppo_step_s"] > 0
    pairs = read_pairs(tmp_path / "out" / "pairs.jsonl")
    assert len(pairs) == 3 * 4
    rows = [json.loads(line) for line in (tmp_path / "out" / "pairs.jsonl").read_text().splitlines()]
    for row in rows:
        a, b = (int(x) for x in re.findall(r"\d+", row["prompt"]))
        assert row["chosen"].startswith(f"{a} + {b} = ") and row["rejected"].startswith(f"{a} + {b} = ")
        assert reward("", row["chosen"], str(a + b)) == 1.0 and reward("", row["rejected"], str(a + b)) == 0.0
    with pytest.raises(RayppoError, match="--sweep: not for a reward-model workload"):
        bench.run(w.name, str(tmp_path / "sweep"), None, 1, 1, ["preference.lr=1e-5,2e-5"], [])


DISTILL_ON_THE_EMBEDDED_MODEL = ["model.policy=embedded", "model.dtype=float32", "data.prompts=embedded",
                                 "reward.function=rayppo.tasks.digits:reward", "rollout.max_new_tokens=12",
                                 "rollout.temperature=1.0", "distill.topk=8"]
"""The distillation workload on the embedded student and its digit task (the teacher: ``digits_teacher``;
its top 8 of a 19-token vocabulary)."""


def _trl_distill_ready() -> bool:
    """Whether TRL 1.16's environment (``bench_trl_venv.TRL_GRPO``) has been made."""
    venvs = _load_benchmark("bench_trl_venv.py")
    return venvs.choose_trl_venv(venvs.TRL_GRPO).state == "ready"


def test_the_distillation_workload_times_each_step_records_its_prompts_and_saves_the_student(bench, tmp_path,
                                                                                             digits_teacher):
    """``kind: distill`` runs the recipe on the distributed system (here the embedded student and a
    teacher of its tokenizer), times each iteration around the trainer's call (at least the sum of
    its stage timers), records the prompts each drew (what TRL is given, in order), saves the
    student and scores the start, the teacher and the student on the held-out problems."""
    w = bench.load_workloads()["smollm2-distill"]
    assert w.kind == "distill" and w.model == "smollm2-135m-instruct"
    summary = bench.run(w.name, str(tmp_path / "out"), None, 1, 1, [],
                        [*DISTILL_ON_THE_EMBEDDED_MODEL, f"distill.teacher={digits_teacher}"])
    assert json.loads((tmp_path / "out" / "bench.json").read_text()) == summary
    assert summary["kind"] == "distill" and summary["steps"] == 2 and "trl" not in summary
    steps = summary["rayppo"]["steps"]
    assert len(steps) == 2 and all(s["wall_s"] >= s["stage_sum_s"] > 0 and s["completion_tokens"] > 0 for s in steps)
    assert all(s["reverse_kl"] > 0 for s in steps)  # the teacher's term was there
    batch_size = load_config(bench.HERE.parent / "examples" / "distill_arithmetic.yaml").rollout.batch_size
    assert [len(b) for b in summary["prompt_batches"]] == [batch_size] * 2
    rates = [summary["start_pass_rate"], summary["teacher_pass_rate"], summary["rayppo"]["held_out_greedy_pass_rate"]]
    assert all(0 <= rate <= 1 for rate in rates)
    assert (tmp_path / "out" / "rayppo_student" / "policy" / "config.json").is_file()


def test_a_distillation_comparison_trl_cannot_be_set_alike_for_is_refused_before_anything_runs(bench, tmp_path):
    """TRL's schedules warm up from 0 and decay to 0: a warm-up or a floor on rayppo's side is refused
    with the fields named, before the teacher, Ray or TRL start."""
    with pytest.raises(RayppoError, match=r"--compare trl: ppo.lr_warmup=1, ppo.lr_end=0.0: .*set both to 0"):
        bench.run("smollm2-distill", str(tmp_path / "out"), "trl", 1, 1, [],
                  ["distill.teacher=" + str(tmp_path / "no-teacher-needed"), "ppo.lr_warmup=1"])
    assert not (tmp_path / "out" / "rayppo").exists()


@pytest.mark.skipif(not _trl_distill_ready(), reason="TRL runs in its own environment "
                    "(.venv-trl-1.16, pinned torch and trl), made once by 'rayppo bench --compare trl' on a GRPO "
                    "or distillation workload; this suite does not install it")
def test_trls_distillation_trainer_runs_on_rayppos_prompts_and_is_scored_beside_it(bench, tmp_path, digits_teacher):
    """With ``--compare trl``: TRL 1.16's ``DistillationTrainer`` takes one step per rayppo
    iteration on the prompts rayppo drew, times each, reports the tokens it generated, and its
    student is scored by the same evaluation; the ratios are in the result."""
    summary = bench.run("smollm2-distill", str(tmp_path / "out"), "trl", 1, 1, [],
                        [*DISTILL_ON_THE_EMBEDDED_MODEL, f"distill.teacher={digits_teacher}"])
    trl = summary["trl"]
    assert trl["trainer"] == "DistillationTrainer" and trl["trl_version"] == bench.TRL_GRPO.trl
    assert len(trl["steps"]) == 2 and trl["seconds_per_step_median"] > 0 and trl["completion_tokens_per_step"] > 0
    assert 0 <= trl["held_out_greedy_pass_rate"] <= 1
    assert summary["speedup_vs_trl"] == pytest.approx(trl["seconds_per_step_median"]
                                                      / summary["rayppo"]["seconds_per_step_median"])
    assert trl["steps_taken"] == summary["steps"]  # one optimiser step per rayppo iteration
