"""Shared fixtures: the embedded model (built once per cache) and small configs."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
# Every Ray instance the tests start (local ray.init, `ray start` nodes, job subprocesses) runs on
# loopback with token authentication off. Ray reads this once per process, so it is set for the
# whole session: mixing modes in one process makes later clusters reject the test's client.
os.environ["RAY_AUTH_MODE"] = "disabled"


@pytest.fixture(scope="session")
def embedded_dir() -> Path:
    from rayppo.models.paths import builtin_model_dir

    return builtin_model_dir()


@pytest.fixture(scope="session")
def guess_dir() -> Path:
    """The embedded multi-turn model (``embedded-guess``), built once per cache."""
    from rayppo.models.loading import resolve_model_path

    return resolve_model_path("embedded-guess")


@pytest.fixture(scope="module")
def local_ray(embedded_dir):
    """One local Ray instance (2 logical CPUs, like this machine) for a test module that asks for
    it (the embedded model is built first, outside Ray); private (``address="local"``) even when a
    ``ray start`` cluster runs on the machine, or its leftover address file does."""
    import ray

    ray.init(address="local", num_cpus=2, include_dashboard=False, log_to_driver=False,
             runtime_env={"env_vars": {"TOKENIZERS_PARALLELISM": "false"}})
    yield
    ray.shutdown()


@pytest.fixture(scope="session")
def tokenizer(embedded_dir):
    from rayppo.models.loading import load_tokenizer

    return load_tokenizer(embedded_dir)


@pytest.fixture(scope="session")
def reward_model_dir(tmp_path_factory) -> Path:
    from rayppo.models.embedded import build_tiny_reward_model

    return build_tiny_reward_model(tmp_path_factory.mktemp("reward_model"))


@pytest.fixture
def small_overrides(tmp_path) -> list[str]:
    """A fast configuration of the embedded default (a few seconds per run, in-process)."""
    return [
        "trainer=reference",
        "rollout.batch_size=16",
        "ppo.minibatches=2",
        "ppo.epochs=1",
        "stop.iterations=2",
        f"output.dir={tmp_path / 'run'}",
    ]


@pytest.fixture
def copy_model(embedded_dir, tmp_path):
    """``copy_model(name, edit=None, **generation)``: a copy of the embedded model folder (tokenizer
    included) with ``generation_config`` fields set and the model optionally edited in place."""
    from transformers import AutoModelForCausalLM

    def make(name: str, edit=None, **generation) -> Path:
        model = AutoModelForCausalLM.from_pretrained(embedded_dir)
        for key, value in generation.items():
            setattr(model.generation_config, key, value)
        if edit is not None:
            edit(model)
        model.save_pretrained(tmp_path / name)
        for file in ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json"):
            if (embedded_dir / file).exists():
                (tmp_path / name / file).write_bytes((embedded_dir / file).read_bytes())
        return tmp_path / name

    return make


@pytest.fixture(scope="session")
def digits_teacher(embedded_dir, tmp_path_factory) -> Path:
    """A distillation teacher of the embedded student's tokenizer that knows the digit task better
    than it does: the embedded model after 20 in-process iterations of the default run (held-out
    ~0.8 against the student's ~0.4), saved as a run's ``policy/`` (the run folder is returned)."""
    from rayppo.config.load import load_config
    from rayppo.train import train

    out = tmp_path_factory.mktemp("digits_teacher")
    train(load_config(None, ["trainer=reference", "stop.iterations=20", "eval.every=0", f"output.dir={out}"]),
          progress=False)
    return out
