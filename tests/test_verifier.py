"""A verifier reward function that hangs or runs away on one response: its call is stopped at
``reward.timeout_s`` (a real child process, really killed), the run is told or goes on."""

from __future__ import annotations

import time

import pytest

from rayppo.actors.reward import RewardEngine, RewardError
from rayppo.data.rollout import Rollout

VERIFIER = '''
import time

def reward(prompt, response):
    if "7" in prompt:
        while True:  # a runaway check on this one prompt
            time.sleep(0.01)
    return 1.0

def crash(prompt, response):
    raise SystemExit(3)  # kills its process
'''


def _rollout(prompts: list[str]) -> Rollout:
    n = len(prompts)
    return Rollout([[1]] * n, [[1]] * n, [[0.0]] * n, ["stop"] * n, prompts, ["7"] * n)


@pytest.fixture
def hanging_module(tmp_path, monkeypatch) -> str:
    (tmp_path / "slow_verifier.py").write_text(VERIFIER)
    monkeypatch.syspath_prepend(str(tmp_path))
    return "slow_verifier"


def test_a_hanging_verifier_call_is_stopped_and_named(hanging_module):
    engine = RewardEngine(function=f"{hanging_module}:reward", timeout_s=1.5)
    start = time.perf_counter()
    with pytest.raises(RewardError, match=r"ran past reward.timeout_s=1.5 s on prompt 'say 7 :'"):
        engine.scores(_rollout(["give 1 :", "say 7 :", "write 3 :"]))
    assert time.perf_counter() - start < 1.5 + 10  # the deadline, plus starting the child process
    assert engine.scores(_rollout(["give 1 :"])) == [1.0]  # a new child serves the next call


def test_with_a_timeout_score_the_run_goes_on(hanging_module):
    engine = RewardEngine(function=f"{hanging_module}:reward", timeout_s=1.0, timeout_score=-1.0)
    assert engine.scores(_rollout(["give 1 :", "say 7 :", "write 3 :"])) == [1.0, -1.0, 1.0]


def test_a_verifier_that_kills_its_process_is_a_clear_error(hanging_module):
    engine = RewardEngine(function=f"{hanging_module}:crash", timeout_s=5)
    with pytest.raises(RewardError, match=r"failed on prompt 'give 1 :'.*exited with code 3"):
        engine.scores(_rollout(["give 1 :"]))
