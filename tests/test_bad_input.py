"""Every bad input a new user can give, answered the same way: exit code 2, one line naming the
culprit (field, file and row, function, URL), no Python traceback, no Ray process left behind.

Each case runs ``rayppo train`` as a real process. Inputs that can be checked before Ray starts
are also checked before torch, transformers, Ray, vLLM or DeepSpeed are imported (the process
reports which it imported): that is what keeps those answers under two seconds, whatever the
machine's load (the time itself is measured in ``benchmarks/bad_input.py``, not asserted).
"""

from __future__ import annotations

import http.server
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import dataclass
from pathlib import Path

import pytest

HEAVY = ("torch", "transformers", "ray", "vllm", "deepspeed")
# Runs rayppo's command line and reports (on stdout) which heavy modules it imported.
RUNNER = (f"import sys; from rayppo.cli import main; rc = main(sys.argv[1:]); "
          f"print('IMPORTED=' + ','.join(m for m in {HEAVY!r} if m in sys.modules)); sys.exit(rc)")
# The smallest in-process run, and the smallest distributed one (Ray, actors): half the cases
# that show only once the run goes use each, so both paths answer the same way.
LOCAL = ["trainer=reference", "rollout.batch_size=4", "rollout.max_new_tokens=4", "ppo.minibatches=1",
         "stop.iterations=1", "reward.retries=1", "output.save_model=false"]
RUN = ["generators.backend=hf", "generators.num=1", *LOCAL[1:]]

VERIFIERS = '''
# Each fails only on a real response: the check before start-up calls it with an empty one.
def raises(prompt, response):
    if response:
        raise ValueError("no digits in " + response)
    return 0.0

def nan(prompt, response):
    return float("nan") if response else 0.0

def text(prompt, response):
    return "high" if response else 0.0

# Each wrong from the start: answered before anything starts.
def wants_label(prompt, response, label):
    return float(response == label)

def takes_one(response):
    return 1.0

def says_yes(prompt, response, answer):
    return "yes"

def always_nan(prompt, response):
    return float("nan")

def crashes(prompt, response, answer):
    return {"1": 1.0}[response]

def hangs(prompt, response):
    import time
    time.sleep(3600)

not_callable = 3
'''


@dataclass
class Case:
    args: list[str]
    says: str
    """A piece of the one line of error: the culprit's name (field, file, row, function, URL)."""
    before_ray: bool = True
    """Checkable before Ray starts: then no heavy module may have been imported."""


@pytest.fixture(scope="module")
def inputs(tmp_path_factory, embedded_dir) -> Path:
    """Bad files of every kind, written once."""
    d = tmp_path_factory.mktemp("bad")
    (d / "broken.yaml").write_text("ppo:\n  lr: [0.1, 0.2\n")
    (d / "list.yaml").write_text("- ppo\n- rollout\n")
    (d / "typed.yaml").write_text("rollout:\n  batch_size: many\n")
    (d / "section.yaml").write_text("ppo: 3\n")
    (d / "empty.jsonl").write_text("")
    (d / "notjson.jsonl").write_text('{"prompt": "add 1 2 :"}\nadd 2 3\n')
    (d / "fake.parquet").write_text("prompt\nadd 1 2 :\n")
    (d / "column.jsonl").write_text('{"text": "add 1 2 :"}\n')
    (d / "emptyrow.jsonl").write_text('{"prompt": "add 1 2 :"}\n{"prompt": "a"}\n{"prompt": "  "}\n')
    (d / "number.jsonl").write_text('{"prompt": 12}\n')
    (d / "long.jsonl").write_text('{"prompt": "add 1 2 :"}\n' + json.dumps({"prompt": "7 " * 5000}) + "\n")
    (d / "prompts.csv").write_text("prompt\nadd 1 2 :\n")
    (d / "answers.jsonl").write_text('{"prompt": "say 1 :", "answer": "1"}\n{"prompt": "say 2 :", "answer": "2"}\n')
    import pyarrow as pa
    import pyarrow.parquet as pq

    pq.write_table(pa.table({"question": ["add 1 2 :"]}), d / "column.parquet")
    (d / "notamodel").mkdir()
    (d / "notamodel" / "README.md").write_text("weights elsewhere")
    (d / "badconfig").mkdir()
    (d / "badconfig" / "config.json").write_text("{")
    pickled = d / "pickled"
    shutil.copytree(embedded_dir, pickled)
    for f in pickled.glob("*.safetensors"):
        f.rename(f.with_name("pytorch_model.bin"))
    other = d / "othervocab"
    shutil.copytree(embedded_dir, other)
    tok = json.loads((other / "tokenizer.json").read_text())
    vocab = tok["model"]["vocab"]
    first, second = list(vocab)[5:7]
    vocab[first], vocab[second] = vocab[second], vocab[first]  # same size, different ids
    (other / "tokenizer.json").write_text(json.dumps(tok))
    _broken_model_folders(d, embedded_dir)
    (d / "bad_verifiers.py").write_text(VERIFIERS)
    (d / "norun").mkdir()
    return d


def _broken_model_folders(d: Path, embedded_dir: Path) -> None:
    """Copies of the embedded model, each broken in one way a disk, a copy or a user breaks one."""
    def copy(name: str) -> Path:
        shutil.copytree(embedded_dir, d / name)
        return d / name

    weights = copy("truncated") / "model.safetensors"
    with weights.open("r+b") as f:
        f.truncate(weights.stat().st_size // 2)  # a copy interrupted half-way
    (copy("garbage") / "model.safetensors").write_bytes(b"<html>404 Not Found</html>" * 4)
    for name in ("tokenizer.json", "tokenizer_config.json"):
        (copy("notokenizer") if name == "tokenizer.json" else d / "notokenizer").joinpath(name).unlink()
    for name, key, value in (("widerconfig", "hidden_size", 256), ("deeperconfig", "num_hidden_layers", 4)):
        config = json.loads((copy(name) / "config.json").read_text())
        config[key] = value
        (d / name / "config.json").write_text(json.dumps(config))


CASES: dict[str, Case] = {
    # ---- configs
    "yaml_malformed": Case(["--config", "{d}/broken.yaml"], "broken.yaml is not valid YAML (line 3"),
    "yaml_not_a_mapping": Case(["--config", "{d}/list.yaml"], "list.yaml must hold a mapping of sections"),
    "config_file_missing": Case(["--config", "{d}/nope.yaml"], "file not found: {d}/nope.yaml"),
    "unknown_field_suggested": Case(["ppo.clip_epsilon=0.1"], "ppo.clip_epsilon: unknown field (did you mean ppo.clip_eps?)"),
    "unknown_section_suggested": Case(["rollot.batch_size=8"], "rollot: unknown section (did you mean rollout?)"),
    "wrong_type_override": Case(["ppo.lr=fast"], "ppo.lr: expected a number"),
    "wrong_type_in_yaml": Case(["--config", "{d}/typed.yaml"], "rollout.batch_size: expected an integer"),
    "section_not_a_mapping": Case(["--config", "{d}/section.yaml"], "ppo: expected a mapping of fields"),
    "out_of_range": Case(["ppo.gamma=1.5"], "ppo.gamma"),
    "override_without_value": Case(["ppo.lr"], "ppo.lr: an override must look like section.field=value"),
    # ---- prompt files
    "prompts_missing": Case(["data.prompts={d}/nope.jsonl"], "{d}/nope.jsonl: prompt file not found"),
    "prompts_empty": Case(["data.prompts={d}/empty.jsonl"], "{d}/empty.jsonl: no prompts"),
    "prompts_not_json": Case(["data.prompts={d}/notjson.jsonl"], "notjson.jsonl: row 2: not valid JSON"),
    "prompts_not_parquet": Case(["data.prompts={d}/fake.parquet"], "fake.parquet: not a Parquet file"),
    "prompts_unsupported_type": Case(["data.prompts={d}/prompts.csv"], "prompts.csv: unsupported prompt file type"),
    "prompts_missing_field": Case(["data.prompts={d}/column.jsonl"], "column.jsonl: row 1: missing field 'prompt'"),
    "prompts_missing_column": Case(["data.prompts={d}/column.parquet"], "column.parquet: no column 'prompt'"),
    "prompts_empty_row": Case(["data.prompts={d}/emptyrow.jsonl"], "emptyrow.jsonl: row 3: field 'prompt' is empty"),
    "prompts_not_a_string": Case(["data.prompts={d}/number.jsonl"], "number.jsonl: row 1: field 'prompt' is empty or not a string"),
    "prompts_overlong_row": Case(["data.prompts={d}/long.jsonl"], "long.jsonl: row 2: prompt is"),
    # ---- model folders
    "model_missing": Case(["model.policy={d}/nomodel"], "model.policy: {d}/nomodel: folder not found"),
    "model_not_a_model": Case(["model.policy={d}/notamodel"], "model.policy: {d}/notamodel has no config.json"),
    "model_config_corrupt": Case(["model.reference={d}/badconfig"], "model.reference: {d}/badconfig/config.json is not valid JSON"),
    "model_pickle_weights_only": Case(["model.policy={d}/pickled"], "model.policy: {d}/pickled has no .safetensors weights"),
    "tokenizer_mismatch": Case(["model.reference={d}/othervocab"], "model.reference: {d}/othervocab's tokenizer differs from model.policy's"),
    "weights_truncated": Case(["model.policy={d}/truncated"], "model.policy: {d}/truncated/model.safetensors is truncated"),
    "weights_not_safetensors": Case(["model.reference={d}/garbage"], "model.reference: {d}/garbage/model.safetensors is not a safetensors file"),
    "tokenizer_files_missing": Case(["model.policy={d}/notokenizer"], "model.policy: {d}/notokenizer has no tokenizer files"),
    "config_wider_than_weights": Case(["model.policy={d}/widerconfig"], "model.policy: {d}/widerconfig/config.json says vocab_size="),
    "config_deeper_than_weights": Case(["model.reference={d}/deeperconfig"], "config.json says num_hidden_layers=4, but the weights hold 2 layers"),
    "reward_model_not_a_classifier": Case(["reward.model={d}/othervocab"], "reward.model: {d}/othervocab holds a LlamaForCausalLM, not a reward model"),
    # ---- reward functions and endpoints
    "reward_function_not_importable": Case(["reward.function=no_such_module:score"], "reward.function: cannot import module 'no_such_module'"),
    "reward_function_missing": Case(["reward.function=bad_verifiers:nothing"], "reward.function: module 'bad_verifiers' has no 'nothing'"),
    "reward_function_not_callable": Case(["reward.function=bad_verifiers:not_callable"], "reward.function: 'bad_verifiers:not_callable' is not callable"),
    "reward_function_wrong_signature": Case(["reward.function=bad_verifiers:takes_one"], "reward.function: bad_verifiers:takes_one(response) cannot be called on embedded prompts row 1: too many positional arguments"),
    "reward_function_column_missing": Case(["reward.function=bad_verifiers:wants_label", "data.prompts={d}/answers.jsonl", "rollout.batch_size=2"], "reward.function: bad_verifiers:wants_label(prompt, response, label) cannot be called on {d}/answers.jsonl row 1: missing a required argument: 'label' (rayppo calls it as fn(prompt, response, **the row's columns it names), plus messages= for a conversation; the row's other columns: answer)"),
    "reward_function_not_a_number": Case(["reward.function=bad_verifiers:says_yes", "data.prompts={d}/answers.jsonl", "rollout.batch_size=2"], "reward.function: bad_verifiers:says_yes failed on {d}/answers.jsonl row 1 (prompt 'say 1 :', a placeholder empty response): TypeError: returned 'yes' (str), not a number"),
    "reward_function_not_finite": Case(["reward.function=bad_verifiers:always_nan"], "reward.function: bad_verifiers:always_nan returned nan on embedded prompts row 1"),
    "reward_function_crashes": Case(["reward.function=bad_verifiers:crashes", "data.prompts={d}/answers.jsonl", "rollout.batch_size=2"], "reward.function: bad_verifiers:crashes failed on {d}/answers.jsonl row 1 (prompt 'say 1 :', a placeholder empty response): KeyError: ''"),
    "reward_function_hangs": Case(["reward.function=bad_verifiers:hangs", "reward.timeout_s=1"], "reward.function: bad_verifiers:hangs did not answer within reward.timeout_s=1 s on embedded prompts row 1"),
    "reward_url_not_http": Case(["reward.function=null", "reward.url=file:///etc/passwd"], "reward.url: must be an http:// or https:// URL"),
    "reward_function_raises": Case(["reward.function=bad_verifiers:raises", *RUN], "reward function bad_verifiers:raises failed on prompt", False),
    "reward_function_raises_said_once": Case(["reward.function=bad_verifiers:raises", *LOCAL], "): ValueError: no digits in", False),
    "reward_function_nan": Case(["reward.function=bad_verifiers:nan", *LOCAL], "reward bad_verifiers:nan returned nan for prompt", False),
    "reward_function_string": Case(["reward.function=bad_verifiers:text", *LOCAL], "reward function bad_verifiers:text failed on prompt", False),
    "endpoint_refuses": Case(["reward.function=null", "reward.url=http://127.0.0.1:{closed}/score", *LOCAL], "reward endpoint http://127.0.0.1:{closed}/score failed", False),
    "endpoint_times_out": Case(["reward.function=null", "reward.url={server}/slow", "reward.timeout_s=1", *RUN], "reward endpoint {server}/slow failed", False),
    "endpoint_garbage": Case(["reward.function=null", "reward.url={server}/garbage", *LOCAL], "reward endpoint {server}/garbage failed", False),
    "endpoint_not_numbers": Case(["reward.function=null", "reward.url={server}/words", *LOCAL], "reward endpoint {server}/words returned 'yes', not a number, for prompt", False),
    "endpoint_wrong_count": Case(["reward.function=null", "reward.url={server}/short", *LOCAL], "reward endpoint {server}/short returned [1.0] for 4 responses", False),
    # ---- resources and runs
    "job_bigger_than_cluster": Case(["generators.num=64"], "this job does not fit"),
    "resume_without_checkpoint": Case(["--resume", "{d}/norun"], "{d}/norun is not a rayppo run folder"),
}


class _Scorer(http.server.BaseHTTPRequestHandler):
    """A reward endpoint gone wrong in four ways, by path."""

    def do_POST(self) -> None:  # noqa: N802 - the http.server API
        n = len(json.loads(self.rfile.read(int(self.headers["Content-Length"])))["prompts"])
        if self.path == "/slow":
            time.sleep(5)
        scores = ["yes"] * n if self.path == "/words" else [1.0] * (1 if self.path == "/short" else n)
        body = b"<html>502 Bad Gateway</html>" if self.path == "/garbage" else json.dumps({"scores": scores}).encode()
        self.send_response(200)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, *args) -> None:
        pass


@pytest.fixture(scope="module")
def endpoints():
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), _Scorer)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    from rayppo.learner.broadcast_sender import free_port

    yield {"server": f"http://127.0.0.1:{server.server_address[1]}", "closed": str(free_port())}
    server.shutdown()


def _ray_processes(marker: str) -> list[str]:
    out = subprocess.run(["pgrep", "-af", marker], capture_output=True, text=True).stdout
    return [line for line in out.splitlines() if "pgrep" not in line]


@pytest.mark.parametrize("name", [n for n, c in CASES.items() if c.before_ray])
def test_bad_input_before_ray(name, inputs, tmp_path):
    _check(CASES[name], inputs, tmp_path, {})


@pytest.mark.slow
@pytest.mark.parametrize("name", [n for n, c in CASES.items() if not c.before_ray])
def test_bad_input_during_the_run(name, inputs, tmp_path, endpoints):
    _check(CASES[name], inputs, tmp_path, endpoints)


def _check(case: Case, inputs: Path, tmp_path: Path, where: dict[str, str]) -> None:
    fill = {"d": str(inputs), **where}
    args = [a.format(**fill) for a in case.args]
    # This run's Ray sessions live here (short: Ray's socket paths must fit in 107 bytes), so any
    # process it leaves behind is found by the folder in its command line.
    ray_tmp = Path(tempfile.mkdtemp(prefix="rp-", dir="/tmp"))
    env = {**os.environ, "PYTHONPATH": str(inputs), "RAY_TMPDIR": str(ray_tmp)}
    out = [] if "--resume" in args else [f"output.dir={tmp_path / 'run'}"]
    proc = subprocess.run([sys.executable, "-c", RUNNER, "train", "--no-progress", *args, *out],
                          capture_output=True, text=True, env=env, timeout=600)
    errors = [line for line in proc.stderr.splitlines() if line.startswith("rayppo: error:")]
    assert proc.returncode == 2, proc.stderr[-3000:]
    assert "Traceback" not in proc.stderr + proc.stdout, proc.stderr[-3000:]
    assert len(errors) == 1 and "\n" not in errors[0], proc.stderr[-3000:]
    assert case.says.format(**fill) in errors[0]
    assert "ray::" not in errors[0] and "\x1b" not in errors[0], errors[0]  # what failed, not Ray's wrapping
    imported = next(line for line in proc.stdout.splitlines() if line.startswith("IMPORTED="))[len("IMPORTED="):]
    if case.before_ray:
        assert proc.stderr.strip() == errors[0]  # nothing else printed
        assert imported == "", f"imported {imported} before answering"
    if not case.before_ray and "generators.backend=hf" in args:  # an actor's error: then where its log is
        assert re.search(r" \(details: \S+/logs/reward-0\.log\)$", errors[0]), errors[0]
    if not case.before_ray and "--resume" not in args:  # a run that completed no iteration: nothing to resume, the folder not claimed
        assert "--resume" not in proc.stderr and not (tmp_path / "run" / "checkpoints").exists(), proc.stderr[-3000:]
        from rayppo.config.load import load_config
        from rayppo.run.folder import claim_output_dir

        claim_output_dir(load_config(None, [f"output.dir={tmp_path / 'run'}"]))  # the next try is not refused
    assert _ray_processes(str(ray_tmp)) == []  # no raylet, GCS or worker of this run is left
