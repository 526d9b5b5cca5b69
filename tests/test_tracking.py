"""Experiment tracking: TensorBoard, W&B (offline) and MLflow (local folder) runs written through
the real libraries and read back; the package check; sample picking and rendering; the plot."""

from __future__ import annotations

import json
import math
import subprocess
import sys
import time
from pathlib import Path

import pytest

from rayppo.config.load import load_config
from rayppo.config.schema import to_dict
from rayppo.run.metrics import GOLD_FIGURE, MetricsLogger, read_metrics
from rayppo.run.samples import Sample, format_samples, pick_samples
from rayppo.run.tracking import check_trackers, make_trackers, mlflow_key, mlflow_tracking_uri

SAMPLES = [Sample("say 7 :", "7 7 3 7", 0.75), Sample("say 2 :", "2 | 2\n2", 1.0)]


def _cfg(out: Path, *overrides: str):
    return load_config(None, [f"output.dir={out}", "output.tensorboard=false", *overrides])


def _log_run(cfg, iterations: range, resume_at: int | None = None, offset: float = 0.0, gold: bool = False) -> None:
    """A run's records through MetricsLogger and the trackers the config asks for; ``gold``: with
    a gold scorer's figures, held out at the even iterations (the evaluations)."""
    trackers = make_trackers(cfg, to_dict(cfg), resume=resume_at is not None)
    logger = MetricsLogger(cfg.output.dir, trackers, resume_at=resume_at)
    for it in iterations:
        metrics = {"reward/mean": it / 10 + offset, "kl/ref_mean": 0.5 + it}
        if gold:
            metrics["reward/gold_mean"] = 0.3 - it / 20
        if it % 2 == 0:
            metrics["eval/pass@4"] = 0.25 * it
            if gold:
                metrics |= {"eval/reward/mean": it / 10, "eval/gold/mean": 0.3 - it / 20}
        logger.log(it, metrics)
    logger.log_samples(iterations[-1], SAMPLES)
    logger.close()


# --- TensorBoard ------------------------------------------------------------------------------


def _tb(log_dir: Path):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    acc = EventAccumulator(str(log_dir), size_guidance={"scalars": 0, "tensors": 0})
    acc.Reload()
    return acc


def test_tensorboard_scalars_text_and_purge_on_resume(tmp_path):
    cfg = _cfg(tmp_path, "output.tensorboard=true")
    _log_run(cfg, range(4))
    acc = _tb(tmp_path / "tb")
    assert [(e.step, round(e.value, 6)) for e in acc.Scalars("reward/mean")] == [(0, 0), (1, 0.1), (2, 0.2), (3, 0.3)]
    text = acc.Tensors("samples/text_summary")[0]
    assert text.step == 3
    table = text.tensor_proto.string_val[0].decode()
    assert "| 0.75 | say 7 : | 7 7 3 7 |" in table and "2 \\| 2<br>2" in table

    _log_run(cfg, range(2, 4), resume_at=2, offset=1.0)  # iterations 2, 3 redone with other values
    acc = _tb(tmp_path / "tb")
    assert [(e.step, round(e.value, 6)) for e in acc.Scalars("reward/mean")] == [(0, 0), (1, 0.1), (2, 1.2), (3, 1.3)]
    assert [r["reward/mean"] for r in read_metrics(tmp_path / "metrics.jsonl")] == [0, 0.1, 1.2, 1.3]


def test_metrics_logger_rewind_drops_later_records(tmp_path):
    cfg = _cfg(tmp_path, "output.tensorboard=true")
    logger = MetricsLogger(tmp_path, make_trackers(cfg, to_dict(cfg), resume=False))
    for it in range(3):
        logger.log(it, {"reward/mean": float(it)})
    # TensorBoard reads event files in name order, and a name starts with the second it was
    # created in, then a per-process counter compared as text (".10" before ".9"): a rewind's
    # new file must start in a later second to be read after the first one, as in a real run.
    time.sleep(1.05)
    logger.rewind(1)
    logger.log(1, {"reward/mean": 10.0})
    logger.close()
    assert [(r["iteration"], r["reward/mean"]) for r in read_metrics(tmp_path / "metrics.jsonl")] == [(0, 0), (1, 10)]
    assert [(e.step, e.value) for e in _tb(tmp_path / "tb").Scalars("reward/mean")] == [(0, 0), (1, 10)]


def test_the_proxy_and_gold_figure_reaches_every_tracker_at_each_gold_evaluation(tmp_path, monkeypatch):
    """TensorBoard plots scalars against the iteration only: the proxy-and-gold-against-KL panel
    goes to the trackers as a figure at each evaluation with a gold scorer, and not without one."""
    monkeypatch.setenv("MLFLOW_ALLOW_FILE_STORE", "")
    monkeypatch.delenv("MLFLOW_ALLOW_FILE_STORE")
    from mlflow.tracking import MlflowClient

    out, store = tmp_path / "gold", tmp_path / "mlruns"
    cfg = _cfg(out, "output.tensorboard=true", f"output.mlflow_uri={store}", "output.wandb_project=rayppo-tests",
               "output.wandb_mode=offline")
    _log_run(cfg, range(4), gold=True)
    images = _tb(out / "tb").Images(GOLD_FIGURE)
    assert [e.step for e in images] == [0, 2] and all(e.encoded_image_string[:4] == b"\x89PNG" for e in images)
    _, _, rows = _wandb_run(out)
    assert [r["iteration"] for r in rows if r.get(f"{GOLD_FIGURE}/_type") == "image-file"] == [0, 2]
    client = MlflowClient(tracking_uri=store.as_uri())
    run_id = (out / "mlflow_run_id").read_text().strip()
    assert [f.path for f in client.list_artifacts(run_id, GOLD_FIGURE)] == [
        f"{GOLD_FIGURE}/iter_000000.png", f"{GOLD_FIGURE}/iter_000002.png"]

    plain = tmp_path / "plain"
    _log_run(_cfg(plain, "output.tensorboard=true"), range(4))
    assert GOLD_FIGURE not in _tb(plain / "tb").Tags()["images"]


# --- Weights & Biases (offline) ---------------------------------------------------------------


def _wandb_records(run_dir: Path) -> list:
    """The protobuf records of an offline run's ``run-<id>.wandb`` file: a ``:W&B`` header, then
    LevelDB-log framing (32 KiB blocks; per chunk crc32c, little-endian length, type)."""
    from wandb.proto import wandb_internal_pb2 as pb

    (path,) = run_dir.glob("run-*.wandb")
    data, block = path.read_bytes(), 32 * 1024
    assert data[:4] == b":W&B"
    records, pos, chunks = [], 7, b""
    while pos + 7 <= len(data):
        if block - pos % block < 7:  # a block's tail too short for a chunk header is padding
            pos += block - pos % block
            continue
        length, kind = int.from_bytes(data[pos + 4:pos + 6], "little"), data[pos + 6]
        if pos + 7 + length > len(data):  # a chunk still being written
            break
        chunks += data[pos + 7:pos + 7 + length]
        pos += 7 + length
        if kind in (1, 4):  # FULL or LAST: a whole record
            records.append(pb.Record.FromString(chunks))
            chunks = b""
    return records


def _complete_wandb_records(run_dir: Path, deadline_s: float = 60.0) -> list:
    """The run's records once its ``exit`` record is on disk. wandb's service process buffers
    the file and writes it as the run finishes, which can land just after ``finish()`` returns
    on a loaded machine (CI once read a file holding only its header)."""
    deadline = time.monotonic() + deadline_s
    while True:
        records = _wandb_records(run_dir)
        if any(r.WhichOneof("record_type") == "exit" for r in records) or time.monotonic() > deadline:
            return records
        time.sleep(0.05)


def _history_value(item):
    kind = item.WhichOneof("value")
    return json.loads(item.value_json) if kind is None else getattr(item, kind)


def _wandb_run(out: Path) -> tuple[dict, dict, list[dict]]:
    """(run record fields, config, history rows) of the newest offline run folder (wandb links it
    as ``latest-run``; a resumed run gets a folder of its own)."""
    run_dir = (out / "wandb" / "latest-run").resolve()
    records = _complete_wandb_records(run_dir)
    run = next(r.run for r in records if r.WhichOneof("record_type") == "run")
    config = {c.key: json.loads(c.value_json) for c in run.config.update}
    rows = [{i.key or "/".join(i.nested_key): _history_value(i) for i in r.history.item}
            for r in records if r.WhichOneof("record_type") == "history"]
    return {"id": run.run_id, "project": run.project, "name": run.display_name, "run_dir": run_dir}, config, rows


def test_wandb_offline_run_holds_metrics_config_and_samples(tmp_path, capfd):
    out = tmp_path / "exp1"
    cfg = _cfg(out, "output.wandb_project=rayppo-tests", "output.wandb_mode=offline", "ppo.clip_eps=0.15")
    _log_run(cfg, range(3))
    run_id = (out / "wandb_run_id").read_text().strip()
    run, config, rows = _wandb_run(out)
    assert (run["id"], run["project"], run["name"]) == (run_id, "rayppo-tests", "exp1")
    assert config["ppo"]["clip_eps"] == 0.15 and config["output"]["dir"] == str(out)
    metric_rows = [r for r in rows if "reward/mean" in r]
    assert [(r["iteration"], r["reward/mean"]) for r in metric_rows] == [(0, 0), (1, 0.1), (2, 0.2)]
    assert [r["eval/pass@4"] for r in metric_rows if "eval/pass@4" in r] == [0, 0.5]
    (table_row,) = [r for r in rows if r.get("samples/_type") == "table-file"]  # nested keys come as a/b
    assert table_row["iteration"] == 2
    table = json.loads((run["run_dir"] / "files" / table_row["samples/path"]).read_text())
    assert table["columns"] == ["iteration", "reward", "prompt", "response"]
    assert table["data"] == [[2, 0.75, "say 7 :", "7 7 3 7"], [2, 1.0, "say 2 :", "2 | 2\n2"]]
    captured = capfd.readouterr()
    assert "wandb" not in captured.out + captured.err  # no banners or summaries in the terminal


def test_wandb_resume_continues_the_same_run(tmp_path):
    out = tmp_path / "run"
    cfg = _cfg(out, "output.wandb_project=rayppo-tests", "output.wandb_mode=offline")
    _log_run(cfg, range(2))
    first_id = (out / "wandb_run_id").read_text().strip()
    _log_run(cfg, range(2, 4), resume_at=2)
    assert (out / "wandb_run_id").read_text().strip() == first_id
    run, _, rows = _wandb_run(out)
    assert run["id"] == first_id and len(list((out / "wandb").glob(f"offline-run-*{first_id}*"))) == 2
    assert [r["iteration"] for r in rows if "reward/mean" in r] == [2, 3]
    _log_run(cfg, range(1))  # a new run (not resumed) gets a new id
    assert (out / "wandb_run_id").read_text().strip() != first_id


# --- MLflow (local folder) --------------------------------------------------------------------


def test_mlflow_local_folder_run_holds_params_metrics_and_samples(tmp_path, monkeypatch):
    # Unset for this test (setenv first so that monkeypatch restores "unset" afterwards): rayppo
    # must allow the file store itself.
    monkeypatch.setenv("MLFLOW_ALLOW_FILE_STORE", "")
    monkeypatch.delenv("MLFLOW_ALLOW_FILE_STORE")
    from mlflow.tracking import MlflowClient

    out, store = tmp_path / "exp2", tmp_path / "mlruns"
    cfg = _cfg(out, f"output.mlflow_uri={store}", "output.run_name=first try", "ppo.clip_eps=0.15")
    _log_run(cfg, range(3))
    run_id = (out / "mlflow_run_id").read_text().strip()
    client = MlflowClient(tracking_uri=store.as_uri())
    run = client.get_run(run_id)
    assert run.info.run_name == "first try" and run.info.status == "FINISHED"
    assert client.get_experiment(run.info.experiment_id).name == "rayppo"
    assert run.data.params["ppo.clip_eps"] == "0.15" and run.data.params["output.mlflow_uri"] == str(store)
    assert run.data.params["output.wandb_project"] == "null"
    history = [(m.step, m.value) for m in client.get_metric_history(run_id, "reward/mean")]
    assert history == [(0, 0), (1, 0.1), (2, 0.2)]
    assert [(m.step, m.value) for m in client.get_metric_history(run_id, "eval/pass_at_4")] == [(0, 0), (2, 0.5)]
    text = Path(client.download_artifacts(run_id, "samples/iter_000002.txt", str(tmp_path))).read_text()
    assert "reward: 0.75\nprompt:\nsay 7 :\nresponse:\n7 7 3 7\n" in text and "2 | 2\n2" in text

    _log_run(cfg, range(3, 4), resume_at=3)
    assert (out / "mlflow_run_id").read_text().strip() == run_id
    assert [m.step for m in client.get_metric_history(run_id, "reward/mean")] == [0, 1, 2, 3]
    assert client.get_run(run_id).info.status == "FINISHED"


def test_mlflow_names_and_uris(tmp_path):
    assert mlflow_key("eval/pass@4") == "eval/pass_at_4"
    assert mlflow_key("a//b/./c/../d!") == "a/b/c/__/d_"
    assert mlflow_tracking_uri("http://mlflow:5000") == "http://mlflow:5000"
    folder = tmp_path / "store"
    assert mlflow_tracking_uri(str(folder)) == folder.resolve().as_uri() and folder.is_dir()


def test_mlflow_params_are_truncated_to_the_limit(tmp_path):
    from mlflow.tracking import MlflowClient
    from mlflow.utils.validation import MAX_PARAM_VAL_LENGTH

    out, store = tmp_path / "run", tmp_path / "mlruns"
    long_env = "x" * (MAX_PARAM_VAL_LENGTH + 50)
    cfg = _cfg(out, f"output.mlflow_uri={store}", f"cluster.actor_env={{FOO: {long_env}}}")
    make_trackers(cfg, to_dict(cfg), resume=False)[0].close()
    run = MlflowClient(tracking_uri=store.as_uri()).get_run((out / "mlflow_run_id").read_text().strip())
    assert run.data.params["cluster.actor_env.FOO"] == long_env[:MAX_PARAM_VAL_LENGTH]


# --- the package check ------------------------------------------------------------------------

HIDE_AND_CHECK = """
import sys
from importlib.machinery import PathFinder

hidden = sys.argv[1]


class Hiding(PathFinder):
    # The path finder, blind to one top-level package: as if it were not installed.
    @classmethod
    def find_spec(cls, name, path=None, target=None):
        return None if name.partition(".")[0] == hidden else super().find_spec(name, path, target)


sys.meta_path[sys.meta_path.index(PathFinder)] = Hiding
if hidden:
    try:
        __import__(hidden)
        sys.exit("not hidden")
    except ModuleNotFoundError:
        pass
from rayppo.config.load import load_config
from rayppo.config.schema import ConfigError
from rayppo.run.tracking import check_trackers

try:
    check_trackers(load_config(None, sys.argv[2:]))
except ConfigError as exc:
    print(exc)
    sys.exit(3)
print("ok", "wandb" in sys.modules, "mlflow" in sys.modules)
"""


def _check_in_subprocess(hidden: str, *overrides: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-c", HIDE_AND_CHECK, hidden, *overrides], capture_output=True, text=True,
                          timeout=120)


@pytest.mark.parametrize("hidden, override, message", [
    ("wandb", "output.wandb_project=p",
     "output.wandb_project: the wandb package is not installed (pip install 'rayppo[track]')"),
    ("mlflow", "output.mlflow_uri=runs/mlflow",
     "output.mlflow_uri: the mlflow package is not installed (pip install 'rayppo[track]')"),
])
def test_check_trackers_names_a_missing_package(hidden, override, message):
    result = _check_in_subprocess(hidden, override)
    assert result.returncode == 3, result.stderr
    assert result.stdout.strip() == message


def test_check_trackers_imports_nothing_and_skips_disabled_wandb():
    both = _check_in_subprocess("", "output.wandb_project=p", "output.mlflow_uri=runs/mlflow")
    assert both.stdout.strip() == "ok False False", both.stderr  # found, not imported
    disabled = _check_in_subprocess("wandb", "output.wandb_project=p", "output.wandb_mode=disabled")
    assert disabled.stdout.strip() == "ok False False", disabled.stderr


def test_check_trackers_passes_with_the_packages_installed(tmp_path):
    assert check_trackers(_cfg(tmp_path, "output.wandb_project=p", "output.mlflow_uri=runs/mlflow")) is None


def test_disabled_wandb_and_no_tensorboard_make_no_trackers(tmp_path):
    cfg = _cfg(tmp_path, "output.wandb_project=p", "output.wandb_mode=disabled")
    assert make_trackers(cfg, to_dict(cfg), resume=False) == []
    assert not (tmp_path / "wandb").exists()


# --- samples ----------------------------------------------------------------------------------

REWARDS = [0.5, 0.9, 0.1, 0.7, 0.3, 0.9]
PROMPTS = [f"p{i}" for i in range(len(REWARDS))]
RESPONSES = [f"r{i}" for i in range(len(REWARDS))]


@pytest.mark.parametrize("n, picked", [
    (3, ["p1", "p0", "p2"]),  # highest (first of the tied 0.9s), lower median, lowest
    (2, ["p1", "p2"]),
    (4, ["p1", "p3", "p0", "p2"]),
    (1, ["p0"]),  # the lower median of six
    (6, ["p1", "p5", "p3", "p0", "p4", "p2"]),
    (10, ["p1", "p5", "p3", "p0", "p4", "p2"]),
    (0, []),
])
def test_pick_samples_spreads_over_rewards(n, picked):
    samples = pick_samples(PROMPTS, RESPONSES, REWARDS, n)
    assert [s.prompt for s in samples] == picked
    assert all(s.response == "r" + s.prompt[1:] and s.reward == REWARDS[int(s.prompt[1:])] for s in samples)


def test_a_chat_prompt_is_shown_by_its_last_user_message():
    """Rendered whole, a chat prompt's system message and template tokens fill the line and cut
    the question out; a plain prompt is shown as it is."""
    from rayppo.run.samples import shown_prompt

    messages = [{"role": "system", "content": "answer with a digit ." * 5}, {"role": "user", "content": "say 3 :"},
                {"role": "assistant", "content": "3"}, {"role": "user", "content": "what is 2 + 2 ?"}]
    rendered = "".join(f"<|im_start|>{m['role']}\n{m['content']}<|im_end|>\n" for m in messages)
    assert shown_prompt(rendered, messages) == "what is 2 + 2 ?"
    line = format_samples([Sample(shown_prompt(rendered, messages), "4", 1.0)], width=60)[0]
    assert line.endswith("what is 2 + 2 ?")
    assert shown_prompt("say 7 :", None) == "say 7 :"


def test_pick_samples_ranks_nan_lowest_and_checks_lengths():
    assert [s.prompt for s in pick_samples(["a", "b", "c"], ["x"] * 3, [math.nan, 0.0, 1.0], 2)] == ["c", "a"]
    with pytest.raises(ValueError, match="2 prompts, 1 responses, 2 rewards"):
        pick_samples(["a", "b"], ["x"], [0.0, 1.0], 1)


def test_format_samples_fits_the_width():
    long = "first words " + "blah " * 40 + "final answer"
    samples = [Sample("say 7 :", "7 7\n3\t7", 0.75), Sample("question: " + long, long, -1.5),
               Sample("数学" * 30, "y", 1)]
    lines = format_samples(samples, width=60)
    assert len(lines) == 6
    assert lines[0] == "reward  0.750  say 7 :" and lines[1] == "            -> 7 7⏎3 7"
    assert lines[2].startswith("reward -1.500  question: first") and lines[2].endswith("final answer")
    assert lines[3].startswith("            -> first words") and "…" in lines[3] and lines[3].endswith("answer")
    for line in lines[2:]:
        assert sum(2 if "\u4e00" <= c <= "\u9fff" else 1 for c in line) <= 60


# --- reward statistics and the plot -----------------------------------------------------------


def test_rollout_stats_reward_spread():
    from rayppo.data.rollout import Rollout
    from rayppo.trainers.iteration import rollout_stats

    rollout = Rollout(prompt_ids=[[1]] * 4, response_ids=[[2, 3]] * 4, logprobs=[[0.0, 0.0]] * 4,
                      finish_reason=["stop"] * 4, prompt_text=["p"] * 4, response_text=["r"] * 4,
                      score=[0.0, 1.0, 0.5, 0.5])
    stats = rollout_stats(rollout, 1.0)
    assert stats["reward/mean"] == 0.5 and stats["reward/min"] == 0.0 and stats["reward/max"] == 1.0
    assert stats["reward/std"] == pytest.approx(math.sqrt(0.125))  # population std


def test_a_training_run_logs_to_wandb_and_mlflow(tmp_path, small_overrides, monkeypatch):
    """``rayppo train`` with both trackers on (W&B offline, MLflow in a local folder): the
    run's metrics reach them at every iteration."""
    from mlflow.tracking import MlflowClient

    from rayppo.cli import main

    monkeypatch.delenv("MLFLOW_ALLOW_FILE_STORE", raising=False)
    out = tmp_path / "run"
    assert main(["train", "--no-progress", *small_overrides, "output.wandb_project=ux", "output.wandb_mode=offline",
                 f"output.mlflow_uri={tmp_path / 'mlruns'}"]) == 0
    rewards = [json.loads(line)["reward/mean"] for line in (out / "metrics.jsonl").read_text().splitlines()]
    client = MlflowClient(mlflow_tracking_uri(str(tmp_path / "mlruns")))
    run_id = (out / "mlflow_run_id").read_text().strip()
    history = client.get_metric_history(run_id, "reward/mean")
    assert [(m.step, m.value) for m in history] == [(i, pytest.approx(r)) for i, r in enumerate(rewards)]
    assert client.get_run(run_id).data.params["trainer"] == "reference"
    (run_dir,) = (out / "wandb").glob("offline-run-*")
    logged = [r for r in _wandb_records(run_dir) if r.WhichOneof("record_type") == "history"]
    assert len(logged) >= len(rewards)
