"""``rayppo`` command line: the end-to-end run and its outputs, early stop, clear errors."""

import json
import subprocess
import sys

from transformers import AutoModelForCausalLM

from rayppo.cli import _collect_overrides, main


def test_train_writes_every_output(tmp_path, small_overrides, capsys):
    out = tmp_path / "run"
    assert main(["train", "--no-progress", *small_overrides, "output.save_rollouts=true"]) == 0
    records = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert [r["iteration"] for r in records] == [0, 1]
    assert {"reward/mean", "kl/ref_mean", "time/iteration"} <= records[0].keys()
    assert (out / "plot.png").stat().st_size > 1000
    assert any((out / "tb").iterdir())
    assert sorted(p.name for p in (out / "rollouts").iterdir()) == ["iter_00000.parquet", "iter_00001.parquet"]
    policy = AutoModelForCausalLM.from_pretrained(out / "policy")
    assert policy.config.model_type == "llama"
    assert (out / "critic" / "value_head.safetensors").is_file()
    assert "completed: 2 iterations" in capsys.readouterr().out
    # The embedded task's held-out split is evaluated after the last iteration.
    assert "eval/reward/mean" not in records[0] and 0.0 <= records[1]["eval/reward/mean"] <= 1.0
    assert (out / "logs" / "driver.log").is_file()
    # One run per folder: a second start into it is refused, naming the ways on.
    assert main(["train", "--no-progress", *small_overrides]) == 2
    assert f"--resume {out}" in capsys.readouterr().err
    assert main(["train", "--no-progress", *small_overrides, "output.overwrite=true", "stop.iterations=1"]) == 0
    assert len((out / "metrics.jsonl").read_text().splitlines()) == 1  # replaced, not appended to


def test_kl_budget_stops_early(tmp_path, small_overrides, capsys):
    overrides = small_overrides + ["stop.iterations=10", "stop.kl_budget=0.001", "ppo.lr=0.01"]
    assert main(["train", "--no-progress", *overrides]) == 0
    captured = capsys.readouterr()
    assert "exceeds stop.kl_budget = 0.001" in captured.err
    assert "kl_budget: 2 iterations" in captured.out  # iteration 0 has KL 0; iteration 1 moved


def test_bad_config_is_a_clear_error(capsys):
    assert main(["train", "ppo.clip_eps=2"]) == 2
    assert "rayppo: error: ppo.clip_eps: must be in (0, 1), got 2" in capsys.readouterr().err


def test_bad_prompt_file_is_a_clear_error(tmp_path, capsys):
    prompts = tmp_path / "p.jsonl"
    prompts.write_text('{"prompt": "say 1 :"}\n{"prompt": ""}\n')
    assert main(["train", f"data.prompts={prompts}", f"output.dir={tmp_path / 'run'}"]) == 2
    assert "row 2: field 'prompt' is empty" in capsys.readouterr().err


def test_override_spellings():
    assert _collect_overrides(["a.b=1", "--c.d=2", "--e.f", "3"]) == ["a.b=1", "c.d=2", "e.f=3"]


def test_console_script_help():
    out = subprocess.run([sys.executable, "-m", "rayppo.cli", "train", "--help"], capture_output=True, text=True)
    assert out.returncode == 0 and "section.field=value" in out.stdout
    listing = subprocess.run([sys.executable, "-m", "rayppo.cli", "config"], capture_output=True, text=True)
    assert "ppo.clip_eps = 0.2" in listing.stdout
