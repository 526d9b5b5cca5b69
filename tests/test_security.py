"""Secure defaults, tested with real processes: the local Ray instance ``rayppo train`` starts
refuses clients without its token; model folders never run code or unpickle weights."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
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


def _client(address: str, home: Path, env: dict[str, str]) -> str:
    out, _ = _python(CLIENT, home, env, address).communicate(timeout=120)
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
        assert (home / ".ray" / "auth_token").is_file()  # generated for this cluster
        assert _client(address, stranger, {"RAY_AUTH_MODE": "disabled"}).startswith("REFUSED")
        assert _client(address, stranger, {"RAY_AUTH_MODE": "token", "RAY_AUTH_TOKEN": "0" * 32}).startswith("REFUSED")
        assert _client(address, home, {"RAY_AUTH_MODE": "token"}) == "ANSWER 42"
    finally:
        head.stdin.write("\n")
        head.stdin.flush()
        head.wait(timeout=60)


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
