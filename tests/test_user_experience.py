"""What a user meets before and around a run: the run folder, config paths, the reward default,
the command line's manners, submitted working directories, evaluation figures, log routing."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from rayppo.config.load import load_config
from rayppo.config.schema import ConfigError
from rayppo.run.folder import claim_output_dir
from rayppo.tasks import digits
from rayppo.trainers.evaluation import EvalPlan, due, eval_metrics, eval_source, held_out_result

PYTHON = sys.executable


# ------------------------------------------------------------------------------- run folder
def test_a_second_run_into_a_run_folder_is_refused_and_overwrite_replaces_only_run_outputs(tmp_path):
    out = tmp_path / "run"
    cfg = load_config(None, [f"output.dir={out}"])
    claim_output_dir(cfg)  # empty: fine
    (out / "metrics.jsonl").write_text('{"iteration": 0}\n')
    (out / "tb").mkdir()
    (out / "notes.txt").write_text("mine")
    with pytest.raises(ConfigError, match=r"output.dir: .* already holds a run \(metrics.jsonl\).*--resume"):
        claim_output_dir(cfg)
    claim_output_dir(load_config(None, [f"output.dir={out}", "output.overwrite=true"]))
    assert not (out / "metrics.jsonl").exists() and not (out / "tb").exists()
    assert (out / "notes.txt").read_text() == "mine"  # the user's own files stay


def test_output_dir_that_is_a_file_is_refused(tmp_path):
    (tmp_path / "f").write_text("x")
    with pytest.raises(ConfigError, match="is not a folder"):
        claim_output_dir(load_config(None, [f"output.dir={tmp_path / 'f'}"]))


# ------------------------------------------------------------------------------- config
def test_input_paths_in_a_config_file_are_relative_to_the_file(tmp_path, monkeypatch):
    project = tmp_path / "project"
    (project / "data").mkdir(parents=True)
    (project / "data" / "p.jsonl").write_text('{"prompt": "say 1 :"}\n')
    (project / "job.yaml").write_text("data:\n  prompts: data/p.jsonl\noutput:\n  dir: runs/x\n")
    monkeypatch.chdir(tmp_path)
    cfg = load_config(project / "job.yaml")
    assert Path(cfg.data.prompts).resolve() == (project / "data" / "p.jsonl").resolve()
    assert not Path(cfg.data.prompts).is_absolute()  # still relative: a submitted job ships the folder
    assert cfg.output.dir == "runs/x"  # outputs go where the command runs
    # On the command line a path is relative to the current directory.
    assert load_config(project / "job.yaml", ["data.prompts=other.jsonl"]).data.prompts == "other.jsonl"


def test_choosing_a_reward_model_or_url_replaces_the_default_function():
    assert load_config(None, ["reward.url=http://127.0.0.1:9/score"]).reward.function is None
    assert load_config(None, ["reward.model=/models/rm"]).reward.function is None
    with pytest.raises(ConfigError, match="set exactly one of"):
        load_config(None, ["reward.url=http://127.0.0.1:9/score", "reward.function=m:f"])


def test_eval_and_tracking_fields_are_checked():
    with pytest.raises(ConfigError, match="eval.samples"):
        load_config(None, ["eval.greedy=false", "eval.samples=0"])
    with pytest.raises(ConfigError, match="output.wandb_mode"):
        load_config(None, ["output.wandb_mode=sometimes"])


# ------------------------------------------------------------------------------- command line
def test_config_listing_into_a_closed_pipe_ends_quietly():
    shell = f"{PYTHON} -m rayppo.cli config | head -1"
    result = subprocess.run(["bash", "-c", shell], capture_output=True, text=True, timeout=60)
    assert result.stdout.startswith("seed = 0")
    assert "Traceback" not in result.stderr and "BrokenPipe" not in result.stderr, result.stderr


def test_train_help_names_verbose_and_the_log_folder():
    result = subprocess.run([PYTHON, "-m", "rayppo.cli", "train", "--help"], capture_output=True, text=True, timeout=60)
    assert "--verbose" in result.stdout and "logs/" in result.stdout


def _on_a_terminal(code: str) -> str:
    """What ``python -c code`` writes to a terminal (a pseudo-terminal: libraries that draw
    progress bars only on a tty draw them here)."""
    import pty

    leader, follower = pty.openpty()
    proc = subprocess.Popen([PYTHON, "-c", code], stdout=follower, stderr=follower, close_fds=True)
    os.close(follower)
    out = b""
    while True:
        try:
            chunk = os.read(leader, 1 << 16)
        except OSError:  # the child closed the terminal (EIO)
            break
        if not chunk:
            break
        out += chunk
    os.close(leader)
    assert proc.wait(timeout=120) == 0, out[-2000:]
    return out.decode(errors="replace")


def test_building_the_embedded_tokenizer_draws_no_progress_bars_on_the_terminal():
    """tokenizers' trainer draws four "Pre-processing sequences" bars on a tty, the next line glued on."""
    shown = _on_a_terminal("from rayppo.models.embedded import build_tokenizer; build_tokenizer(['say', '1']); "
                           "print('next line')")
    assert "Pre-processing" not in shown and shown.strip().endswith("next line"), shown[-500:]


def test_summary_line_grammar(tmp_path):
    from rayppo.train import TrainResult

    one = TrainResult(1, "completed", 0.3, 0.3, tmp_path, None, 2.0).summary()
    assert "1 iteration in" in one and "(last)" in one and "held-out" not in one
    many = TrainResult(40, "completed", 0.35, 0.92, tmp_path, 0.97, 30.0).summary()
    assert "40 iterations in 30 s" in many and "mean of the last 5" in many and "held-out 0.970" in many
    resumed = TrainResult(40, "completed", 0.35, 0.92, tmp_path, 0.97, 17.0, resumed_at=13).summary()
    assert resumed.startswith("completed: 40 iterations (27 after resuming at 13) in 17 s;"), resumed


# ------------------------------------------------------------------------------- submit
def test_submitted_working_dir_ships_the_project_but_not_what_stays_behind(tmp_path, monkeypatch):
    from rayppo.cluster.jobs import _staging_dir

    project = tmp_path / "project"
    for folder in (".git", ".venv", "runs/old", "data", "out"):
        (project / folder).mkdir(parents=True)
    (project / "my_reward.py").write_text("def score(prompt, response):\n    return float(len(response))\n")
    (project / "data" / "p.jsonl").write_text('{"prompt": "hi"}\n')
    (project / ".git" / "HEAD").write_text("ref")
    (project / "out" / "metrics.jsonl").write_text("{}")
    monkeypatch.chdir(project)
    cfg = load_config(None, ["reward.function=my_reward:score", "data.prompts=data/p.jsonl", "output.dir=out"])
    staging = _staging_dir(cfg, ship_code=True, with_benchmarks=False, working_dir=project)
    shipped = {p.relative_to(staging).as_posix() for p in staging.rglob("*")}
    assert {"my_reward.py", "data/p.jsonl", "job.yaml", "rayppo/cli/__init__.py"} <= shipped
    assert not any(p.startswith((".git", ".venv", "runs", "out")) for p in shipped), shipped
    # The job starts in that folder: the reward module imports there as it does here.
    code = ("from rayppo.actors.verifier import load_reward_function; "
            "print(load_reward_function('my_reward:score')('p', 'abc'))")
    env = {**os.environ, "PYTHONPATH": ""}
    result = subprocess.run([PYTHON, "-c", code], cwd=staging, capture_output=True, text=True, env=env, timeout=60)
    assert result.stdout.strip() == "3.0", result.stderr


# ------------------------------------------------------------------------------- evaluation
def test_embedded_held_out_split_is_disjoint_from_training():
    train, held_out = set(digits.prompts()), digits.eval_prompts()
    assert len(held_out) == 8 and not train & set(held_out)
    assert len({digits.target_digit(p) for p in held_out}) == 8  # each asked for in a wording never trained
    assert len(train) == 40 - 8  # every other (verb, digit) pair is trained on


def test_eval_metrics_greedy_sampled_and_pass_at_k():
    plan = EvalPlan(greedy=True, samples=2, temperature=1.0, pass_threshold=1.0, verifier=True)
    assert plan.passes() == [(0.0, 1), (1.0, 2)]
    got = eval_metrics(plan, [1.0, 0.5, 0.0, 1.0], [[0.0, 1.0], [0.2, 0.4], [1.0, 1.0], [0.0, 0.0]])
    assert got == {"eval/greedy/reward/mean": 0.625, "eval/greedy/pass_rate": 0.5,
                   "eval/reward/mean": pytest.approx(3.6 / 8), "eval/pass_rate": 3 / 8, "eval/pass@2": 0.5}
    greedy_only = EvalPlan(True, 0, 1.0, 1.0, verifier=True)
    assert eval_metrics(greedy_only, [1.0, 0.0], None) == {
        "eval/greedy/reward/mean": 0.5, "eval/greedy/pass_rate": 0.5, "eval/reward/mean": 0.5, "eval/pass_rate": 0.5}
    no_verifier = EvalPlan(False, 1, 1.0, 1.0, verifier=False)
    assert eval_metrics(no_verifier, None, [[2.0], [-1.0]]) == {"eval/reward/mean": 0.5}


def test_held_out_result_regroups_prompt_major_scores():
    plan = EvalPlan(greedy=False, samples=3, temperature=0.7, pass_threshold=1.0, verifier=True)
    calls = []

    def score_pass(temperature: float, k: int) -> tuple[list[float], list[float]]:
        calls.append((temperature, k))
        return [0, 0, 1, 0, 0, 0], []  # prompt 0 passes on its third sample, prompt 1 never; no gold scorer

    got = held_out_result(plan, 2, score_pass).figures
    assert calls == [(0.7, 3)] and got["eval/pass@3"] == 0.5 and got["time/eval"] >= 0
    assert "eval/gold/mean" not in got  # nothing invented without a gold scorer


def test_held_out_result_reports_the_gold_mean_of_the_headline_pass():
    plan = EvalPlan(greedy=True, samples=2, temperature=0.7, pass_threshold=1.0, verifier=False)

    def score_pass(temperature: float, k: int) -> tuple[list[float], list[float]]:
        rewards = [0.5] * 2 * k
        return rewards, ([1.0] * 2 if k == 1 else [0.0, 1.0, 0.0, 0.0])  # greedy, then the sampled pass

    got = held_out_result(plan, 2, score_pass).figures
    assert got["eval/gold/mean"] == 0.25  # the sampled pass's, as eval/reward/mean is


def test_eval_schedule_and_source():
    assert [i for i in range(25) if due(10, i, 25)] == [9, 19, 24]
    assert not any(due(0, i, 25) for i in range(25))
    assert eval_source(load_config(None, [])) == ("embedded", "test")
    assert eval_source(load_config(None, ["data.prompts=p.jsonl"])) is None
    assert eval_source(load_config(None, ["data.prompts=p.jsonl", "eval.prompts=e.jsonl"])) == ("e.jsonl", "test")
    assert eval_source(load_config(None, ["eval.every=0"])) is None


# ------------------------------------------------------------------------------- logs
def test_an_actor_process_writes_its_output_to_its_log_file(tmp_path):
    """rayppo.machine.role_resources redirects file descriptors 1 and 2 when RAYPPO_LOG_FILE is set, so
    what C++ code and child processes print lands there too, not on the terminal."""
    log = tmp_path / "logs" / "generator-0.log"
    code = ("import os, sys; import rayppo.machine.role_resources; print('from python'); sys.stdout.flush(); "
            "os.system('echo from a child process'); os.write(2, b'from fd 2\\n')")
    result = subprocess.run([PYTHON, "-c", code], capture_output=True, text=True, timeout=120,
                            env={**os.environ, "RAYPPO_LOG_FILE": str(log)})
    assert result.returncode == 0 and result.stdout == "" and result.stderr == "", (result.stdout, result.stderr)
    assert log.read_text().splitlines() == ["from python", "from a child process", "from fd 2"]


@pytest.mark.parametrize("verbose", [False, True])
def test_a_library_run_in_the_commands_own_process_writes_to_its_log_unless_verbose(tmp_path, verbose):
    """``rayppo pairs`` runs vLLM in its own process: inside ``Console.captured`` what Python, C++
    (fd 2) and child processes print goes to logs/pairs.log, while rayppo's own lines still reach
    the terminal; afterwards the process prints to the terminal again. ``--verbose``: nothing moves."""
    code = (f"import os, sys\nfrom rayppo.console import console\nconsole.setup({str(tmp_path)!r}, {verbose}, 'pairs')\n"
            "with console.captured():\n"
            "    print('from python'); sys.stdout.flush(); os.system('echo from a child process')\n"
            "    os.write(2, b'from fd 2\\n'); console.write('rayppo says')\n"
            "print('after')")
    result = subprocess.run([PYTHON, "-c", code], capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr
    log = tmp_path / "logs" / "pairs.log"
    library = ["from python", "from a child process", "from fd 2"]
    if verbose:
        assert result.stdout.splitlines() == ["from python", "from a child process", "after"]
        assert result.stderr.splitlines() == ["from fd 2", "rayppo says"] and log.read_text() == ""
    else:
        assert (result.stdout, result.stderr) == ("after\n", "rayppo says\n")
        assert log.read_text().splitlines() == library


def test_local_instance_is_sized_to_the_roles_up_to_four_cpus_per_core():
    from rayppo.cluster.placement import MAX_OVERSUBSCRIPTION, local_cpus

    cores = os.cpu_count() or 1
    assert local_cpus(0.5) == cores
    assert local_cpus(cores + 0.5) == cores + 1  # whole CPUs: Ray refuses fractions
    assert local_cpus(1000 * cores) == MAX_OVERSUBSCRIPTION * cores


# ------------------------------------------------------------------------------- own model, default task
def _model_folder(folder: Path, words: list[str]) -> Path:
    """A model folder whose tokenizer knows only ``words`` (and [UNK])."""
    from tokenizers import Tokenizer
    from tokenizers.models import WordLevel
    from tokenizers.pre_tokenizers import Whitespace

    folder.mkdir()
    tokenizer = Tokenizer(WordLevel({"[UNK]": 0, **{w: i + 1 for i, w in enumerate(words)}}, unk_token="[UNK]"))
    tokenizer.pre_tokenizer = Whitespace()
    tokenizer.save(str(folder / "tokenizer.json"))
    (folder / "config.json").write_text('{"model_type": "llama", "max_position_embeddings": 64}')
    (folder / "model.safetensors").write_bytes((2).to_bytes(8, "little") + b"{}")  # whole, holding no tensor
    return folder


def test_own_model_whose_tokenizer_cannot_write_the_embedded_task_is_refused(tmp_path):
    from rayppo.plan.inputs import check_inputs

    folder = _model_folder(tmp_path / "mine", ["hello", "world"])
    with pytest.raises(ConfigError, match=r"data.prompts: embedded .* unknown tokens; give your own data.prompts"):
        check_inputs(load_config(None, [f"model.policy={folder}"]))


def test_own_model_with_the_embedded_task_gets_a_warning(tmp_path, caplog):
    from rayppo.plan.inputs import check_inputs

    folder = _model_folder(tmp_path / "mine", [*digits.VERBS, *digits.DIGITS, ":"])
    with caplog.at_level("WARNING", logger="rayppo.plan.inputs"):
        check_inputs(load_config(None, [f"model.policy={folder}"]))
    assert "embedded digit task" in caplog.text


def test_a_prompt_file_smaller_than_the_batch_gets_a_warning(tmp_path, caplog):
    from rayppo.plan.inputs import check_inputs

    path = tmp_path / "p.jsonl"
    path.write_text("".join(f'{{"prompt": "say {d} :"}}\n' for d in range(5)))
    with caplog.at_level("WARNING", logger="rayppo.plan.inputs"):
        check_inputs(load_config(None, [f"data.prompts={path}", "rollout.batch_size=8", "ppo.minibatches=1"]))
    assert "holds 5 prompts, fewer than rollout.batch_size=8" in caplog.text


def test_an_actors_error_is_told_by_what_failed_not_by_rays_wrapping():
    """A generator's death seen through a call that read its output reaches the driver as Ray's
    RayTaskError(ActorDiedError), whose text starts with a coloured ``ray::...() (pid=, ip=,
    actor_id=, repr=)`` header: the messages keep the original exception and drop the header."""
    import ray.exceptions

    from rayppo.errors import brief, plain

    died = ray.exceptions.RayTaskError("GeneratorEngine.load_weights", "Traceback (most recent call last): ...",
                                       ray.exceptions.ActorDiedError(), pid=4907, ip="192.0.2.2",
                                       actor_repr="<GeneratorEngine object at 0x7f5b>", actor_id="2d90")
    for exc in (died, died.as_instanceof_cause()):
        assert brief(exc) == "ActorDiedError: The actor died unexpectedly before finishing this task."
    header = ("\x1b[36mray::RewardEngine.scores()\x1b[39m (pid=3109, ip=192.0.2.2, actor_id=2d90, "
              "repr=<rayppo.actors.reward.RewardEngine object at 0x7f5b>)\n  reward function says no")
    assert plain(header) == "reward function says no"
