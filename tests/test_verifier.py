"""A verifier reward function in its real child process: a call that hangs or runs away is
stopped at ``reward.timeout_s`` (really killed), the run is told or goes on; the prompt row's
columns and conversation reach the function as it asks; its module is found in the current
directory."""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path

import pytest

from rayppo.actors.reward import RewardEngine, RewardError, Verifier
from rayppo.actors.verifier import VerifierProcess, load_reward_function
from rayppo.data.prompts import load_prompt_set
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
    engine = RewardEngine(Verifier(f"{hanging_module}:reward", timeout_s=1.5))
    start = time.perf_counter()
    with pytest.raises(RewardError, match=r"ran past reward.timeout_s=1.5 s on prompt 'say 7 :'"):
        engine.scores(_rollout(["give 1 :", "say 7 :", "write 3 :"]))
    assert time.perf_counter() - start < 1.5 + 10  # the deadline, plus starting the child process
    assert engine.scores(_rollout(["give 1 :"])) == [1.0]  # a new child serves the next call


def test_with_a_timeout_score_the_run_goes_on(hanging_module):
    engine = RewardEngine(Verifier(f"{hanging_module}:reward", timeout_s=1.0, timeout_score=-1.0))
    assert engine.scores(_rollout(["give 1 :", "say 7 :", "write 3 :"])) == [1.0, -1.0, 1.0]


def test_a_verifier_that_kills_its_process_is_a_clear_error(hanging_module):
    engine = RewardEngine(Verifier(f"{hanging_module}:crash", timeout_s=5))
    with pytest.raises(RewardError, match=r"failed on prompt 'give 1 :'.*exited with code 3"):
        engine.scores(_rollout(["give 1 :"]))


ROW_VERIFIERS = '''
def exact(prompt, response, answer):
    return float(response.strip() == answer)

def keyed(prompt, response, *, answer, tests=()):
    return float(response.strip() == answer) + len(tests)

def everything(prompt, response, **row):
    return 10.0 * len(row) + ("answer" in row)

def chat(prompt, response, messages=None):
    return -1.0 if messages is None else float(len(messages))

def plain(prompt, response):
    return float(len(response))
'''
CHAT = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "say 7 :"}]


@pytest.fixture
def row_verifiers(tmp_path, monkeypatch) -> str:
    (tmp_path / "row_verifiers.py").write_text(ROW_VERIFIERS)
    monkeypatch.syspath_prepend(str(tmp_path))
    return "row_verifiers"


def _row_rollout(responses: list[str], fields: list[dict], messages: list[list | None]) -> Rollout:
    n = len(responses)
    return Rollout([[1]] * n, [[1]] * n, [[0.0]] * n, ["stop"] * n, ["say 7 :"] * n, responses,
                   prompt_messages=[json.dumps(m) if m else "" for m in messages],
                   prompt_fields=[json.dumps(f) for f in fields])


def test_a_verifier_gets_the_columns_it_names(row_verifiers, tmp_path, tokenizer):
    # The rows come from a real prompt file, through load_prompt_set, as a run reads them.
    path = tmp_path / "p.jsonl"
    rows = [{"question": "say 7 :", "answer": "7", "tests": [1, 2]}, {"question": "say 3 :", "answer": "3",
                                                                      "prompt": "a column named like the argument"}]
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    batch = load_prompt_set(str(path), "question", tokenizer, max_tokens=40)
    rollout = Rollout(batch.ids, [[1], [1]], [[0.0], [0.0]], ["stop"] * 2, batch.texts, ["7", "5"],
                      prompt_messages=batch.messages_json(), prompt_fields=batch.fields_json())
    scores = {name: RewardEngine(Verifier(f"{row_verifiers}:{name}", timeout_s=30)).scores(rollout)
              for name in ("exact", "keyed", "everything", "plain")}
    assert scores["exact"] == [1.0, 0.0]  # the answer column reached the child process
    assert scores["keyed"] == [3.0, 0.0]  # keyword-only, and an optional column when the row has it
    assert scores["everything"] == [21.0, 11.0]  # **row: every column but one named like an argument
    assert scores["plain"] == [1.0, 1.0]  # (prompt, response): called as before


def test_a_verifier_naming_messages_gets_the_conversation(row_verifiers):
    engine = RewardEngine(Verifier(f"{row_verifiers}:chat", timeout_s=30))
    assert engine.scores(_row_rollout(["7", "7"], [{}, {}], [CHAT, None])) == [2.0, -1.0]
    process = VerifierProcess(f"{row_verifiers}:exact", timeout_s=30)
    try:
        assert process("say 7 :", "7", {"answer": "7"}, CHAT) == 1.0
        with pytest.raises(ValueError, match="missing 1 required positional argument: 'answer'"):
            process("say 7 :", "7", {})  # a row without the column the verifier needs
    finally:
        process.close()


def test_a_module_in_the_current_directory_is_found_as_python_m_finds_it(tmp_path, monkeypatch):
    (tmp_path / "cwd_rewards.py").write_text("def score(prompt, response, answer):\n"
                                            "    return float(response == answer)\n")
    monkeypatch.chdir(tmp_path)
    # As under the console script: sys.path[0] is the venv's bin folder and the current directory
    # is nowhere on it; with PYTHONSAFEPATH a child `python -m` does not add it either.
    outside = [p for p in sys.path if p not in ("", ".", str(tmp_path))]
    monkeypatch.setattr(sys, "path", [str(Path(sys.executable).parent), *outside])
    monkeypatch.setenv("PYTHONSAFEPATH", "1")
    monkeypatch.delitem(sys.modules, "cwd_rewards", raising=False)
    assert load_reward_function("cwd_rewards:score")("say 7 :", "7", answer="7") == 1.0
    process = VerifierProcess("cwd_rewards:score", timeout_s=30)
    try:
        assert process("say 7 :", "7", {"answer": "7"}) == 1.0
        assert process("say 7 :", "3", {"answer": "7"}) == 0.0
    finally:
        process.close()
    sys.modules.pop("cwd_rewards", None)
