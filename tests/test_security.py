"""Secure defaults, tested with real processes: the local Ray instance ``rayppo train`` starts
refuses clients without its token; model folders never run code or unpickle weights."""

from __future__ import annotations

import json
import os
import shutil
import stat
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import pytest

from rayppo.config.load import load_config
from rayppo.plan.inputs import check_inputs

# The head: a local Ray instance started exactly as `rayppo train` starts it (RaySession), with
# the user's environment (no RAY_AUTH_MODE), holding on until told to stop.
HEAD = """
import sys, time
from rayppo.cluster.session import RaySession
import ray
session = RaySession(None, 1).__enter__()
print("GCS " + ray._private.worker.global_worker.node.address, flush=True)
sys.stdin.readline()
session.close()
"""
CLIENT = """
import sys, ray
try:
    ray.init(address=sys.argv[1], log_to_driver=False)
    print("ANSWER", ray.get(ray.remote(lambda: 42).remote(), timeout=60))
except Exception as exc:
    print("REFUSED", type(exc).__name__)
"""


def _python(code: str, home: Path, env: dict[str, str], *args: str, **kw) -> subprocess.Popen:
    base = {k: v for k, v in os.environ.items() if not k.startswith("RAY_AUTH")}  # the tests' own opt-out
    return subprocess.Popen([sys.executable, "-c", code, *args], env={**base, "HOME": str(home), **env},
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, **kw)


def _said(client: subprocess.Popen) -> str:
    """The client's ``ANSWER 42`` or ``REFUSED <error>``."""
    out, _ = client.communicate(timeout=120)
    return next(line for line in out.splitlines() if line.startswith(("ANSWER", "REFUSED")))


@pytest.mark.slow
def test_the_local_ray_instance_refuses_clients_without_its_token(tmp_path):
    """Its GCS is reachable on the machine's network address; without the token (none, or a
    wrong one) a client is refused; with the token Ray generated for it, it gets an answer."""
    home, stranger = tmp_path / "user", tmp_path / "stranger"
    head = _python(HEAD, home, {}, stdin=subprocess.PIPE)
    try:
        line = head.stdout.readline()
        assert line.startswith("GCS "), head.stderr.read()
        address = line.split()[1]
        assert not address.startswith("127."), "the GCS address should be the node's network address"
        token = home / ".ray" / "auth_token"
        assert token.is_file()  # generated for this cluster
        # readable by this user only: whoever reads it can run code in the cluster as them
        assert stat.S_IMODE(token.stat().st_mode) == 0o600, oct(token.stat().st_mode)
        assert stat.S_IMODE(token.parent.stat().st_mode) == 0o700, oct(token.parent.stat().st_mode)
        # The three clients at once: a refused one spends most of its time waiting for Ray's answer.
        clients = [_python(CLIENT, stranger, {"RAY_AUTH_MODE": "disabled"}, address),
                   _python(CLIENT, stranger, {"RAY_AUTH_MODE": "token", "RAY_AUTH_TOKEN": "0" * 32}, address),
                   _python(CLIENT, home, {"RAY_AUTH_MODE": "token"}, address)]
        said = [_said(client) for client in clients]
        assert said[0].startswith("REFUSED") and said[1].startswith("REFUSED") and said[2] == "ANSWER 42", said
    finally:
        head.stdin.write("\n")
        head.stdin.flush()
        head.wait(timeout=60)


def test_an_existing_world_readable_token_is_tightened_and_a_new_one_is_private(tmp_path, monkeypatch):
    """A token Ray wrote earlier with the umask (0644 in a 0755 folder) becomes 0600 in a 0700
    folder, keeping its value; a missing one is created 0600 holding 256 bits of hex."""
    from rayppo.cluster.session import private_token_file
    for name in ("RAY_AUTH_TOKEN", "RAY_AUTH_TOKEN_PATH"):
        monkeypatch.delenv(name, raising=False)
    old, new = tmp_path / "old", tmp_path / "new"
    (old / ".ray").mkdir(parents=True, mode=0o755)
    os.chmod(old / ".ray", 0o755)
    (old / ".ray" / "auth_token").write_text("ab" * 32)
    os.chmod(old / ".ray" / "auth_token", 0o644)
    for home in (old, new):
        monkeypatch.setenv("HOME", str(home))
        token = private_token_file()
        assert token == home / ".ray" / "auth_token"
        assert stat.S_IMODE(token.stat().st_mode) == 0o600
        assert stat.S_IMODE(token.parent.stat().st_mode) == 0o700
    assert (old / ".ray" / "auth_token").read_text() == "ab" * 32
    fresh = (new / ".ray" / "auth_token").read_text()
    assert len(fresh) == 64 and int(fresh, 16) >= 0


@pytest.mark.slow
def test_the_job_commands_answer_a_cluster_that_wants_its_token_in_one_line(tmp_path):
    """A head with token authentication and its dashboard (the Jobs API): rayppo status, logs and
    stop from a client without the token answer with rayppo's one line (Ray's AuthenticationError
    runs to 28 lines); with the token, status lists the (no) jobs; an address with nothing there
    is one line too."""
    from rayppo.learner.broadcast_sender import free_port

    gcs, dashboard, token = free_port(), free_port(), "ab" * 32
    temp = Path(tempfile.mkdtemp(prefix="rp-auth-", dir="/tmp"))  # short: Ray's socket paths
    base = {k: v for k, v in os.environ.items() if not k.startswith("RAY_AUTH")}
    head = subprocess.Popen([str(Path(sys.executable).parent / "ray"), "start", "--head", "--block", f"--port={gcs}",
                             "--include-dashboard=true", "--dashboard-host=127.0.0.1", f"--dashboard-port={dashboard}",
                             "--num-cpus=1", f"--temp-dir={temp}", "--disable-usage-stats"],
                            env={**base, "HOME": str(tmp_path), "RAY_AUTH_MODE": "token", "RAY_AUTH_TOKEN": token},
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    url = f"http://127.0.0.1:{dashboard}"

    def rayppo(*args: str, **env: str) -> subprocess.CompletedProcess:
        return subprocess.run([sys.executable, "-m", "rayppo.cli", *args, "--address", url], capture_output=True,
                              text=True, timeout=120, env={**base, "HOME": str(tmp_path / "client"), **env})

    try:
        deadline = time.monotonic() + 120
        while (listed := rayppo("status", RAY_AUTH_MODE="token", RAY_AUTH_TOKEN=token)).returncode != 0:
            assert time.monotonic() < deadline, listed.stderr[-2000:]
            time.sleep(2)
        assert listed.stdout.strip() == "no jobs on this cluster"
        for command in (["status"], ["status", "raysubmit_x"], ["logs", "raysubmit_x"], ["stop", "raysubmit_x"]):
            result = rayppo(*command)
            assert result.returncode == 2 and result.stdout == "", result
            assert result.stderr == (f"rayppo: error: the Ray cluster at {url} refused this client: it needs the "
                                     "cluster's token (export RAY_AUTH_MODE=token and RAY_AUTH_TOKEN=..., or "
                                     "RAY_AUTH_TOKEN_PATH=FILE)\n"), result.stderr
    finally:
        head.terminate()
        head.wait(timeout=60)
        shutil.rmtree(temp, ignore_errors=True)
    nothing = rayppo("status", "x", RAY_AUTH_MODE="disabled")
    assert nothing.returncode == 2 and len(nothing.stderr.splitlines()) == 1, nothing.stderr
    assert nothing.stderr.startswith(f"rayppo: error: cannot reach the Ray cluster's Jobs API at {url}"), nothing.stderr


EVIL = """
from pathlib import Path
Path(__file__).with_name("RAN").write_text("model folder code ran")
"""


def test_code_in_a_model_folder_never_runs(embedded_dir, tmp_path):
    """A folder whose config and tokenizer config point at its own Python (auto_map) loads as
    the standard architecture; the folder's code is never imported."""
    from rayppo.models.loading import Critic, load_causal_lm, load_tokenizer

    folder = tmp_path / "model"
    shutil.copytree(embedded_dir, folder)
    (folder / "evil.py").write_text(EVIL)
    for name, key in (("config.json", "AutoModelForCausalLM"), ("tokenizer_config.json", "AutoTokenizer")):
        data = json.loads((folder / name).read_text())
        data["auto_map"] = {key: "evil.Evil", "AutoModel": "evil.Evil", "AutoConfig": "evil.Evil"}
        (folder / name).write_text(json.dumps(data))
    check_inputs(load_config(None, [f"model.policy={folder}"]))
    load_tokenizer(folder)
    load_causal_lm(folder)
    Critic.from_pretrained(folder)
    assert not (folder / "RAN").exists()


def test_pickled_weights_are_never_loaded(embedded_dir, tmp_path):
    """Weights as a pickle (.bin) only: the loaders refuse them rather than unpickle."""
    from rayppo.models.loading import load_causal_lm

    folder = tmp_path / "pickled"
    shutil.copytree(embedded_dir, folder)
    for f in folder.glob("*.safetensors"):
        f.rename(f.with_name("pytorch_model.bin"))
    with pytest.raises(OSError, match="safetensors"):
        load_causal_lm(folder)
