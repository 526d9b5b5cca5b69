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
    from rayppo.models.embedded import embedded_model_dir

    return embedded_model_dir()


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
