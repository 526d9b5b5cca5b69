"""The HTTP reward endpoint: a real local server, retries, and clear errors."""

from __future__ import annotations

import json
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest

from rayppo.actors.reward import HttpEndpoint, RewardEngine, RewardError
from rayppo.config.load import load_config
from rayppo.config.schema import ConfigError
from rayppo.data.rollout import Rollout
from rayppo.tasks import digits


class Scorer(BaseHTTPRequestHandler):
    failures_left = 0  # answer 503 this many times first (to exercise retries)
    wrong_count = False
    bodies: list[dict] = []  # every request body received, in order

    def do_POST(self):  # noqa: N802 - the http.server API
        body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
        cls = type(self)
        cls.bodies.append(body)
        if cls.failures_left > 0:
            cls.failures_left -= 1
            self.send_response(503)
            self.end_headers()
            return
        scores = [digits.reward(p, r) for p, r in zip(body["prompts"], body["responses"])]
        payload = json.dumps({"scores": scores[:-1] if cls.wrong_count else scores}).encode()
        self.send_response(200)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(payload)))
        self.end_headers()
        self.wfile.write(payload)

    def log_message(self, *args):
        pass


@pytest.fixture
def server():
    httpd = ThreadingHTTPServer(("127.0.0.1", 0), Scorer)
    thread = threading.Thread(target=httpd.serve_forever, daemon=True)
    thread.start()
    Scorer.failures_left, Scorer.wrong_count, Scorer.bodies = 0, False, []
    yield f"http://127.0.0.1:{httpd.server_address[1]}/score"
    httpd.shutdown()


def rollout(prompts, responses):
    n = len(prompts)
    return Rollout([[1]] * n, [[1]] * n, [[0.0]] * n, ["stop"] * n, prompts, responses)


def test_http_scores_in_batches_and_retries(server):
    Scorer.failures_left = 2
    engine = RewardEngine(HttpEndpoint(server, timeout_s=5, retries=3, batch_size=2))
    r = rollout(["say 7 :", "say 1 :", "give 2 :"], ["7 7 7 1", "1", "3 3"])
    assert engine.scores(r) == [0.75, 0.25, 0.0]


def test_http_body_carries_each_rows_conversation_and_columns(server):
    chat = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "say 7 :"}]
    r = rollout(["say 7 : (rendered from a chat)", "say 1 :", "give 2 :"], ["7 7 7 1", "1", "3 3"])
    r.prompt_messages = [json.dumps(chat), "", ""]
    r.prompt_fields = [json.dumps({"answer": "7"}), "{}", json.dumps({"answer": "2", "tests": [1]})]
    engine = RewardEngine(HttpEndpoint(server, timeout_s=5, retries=1, batch_size=2))
    assert engine.scores(r) == [0.75, 0.25, 0.0]
    assert Scorer.bodies == [
        {"prompts": r.prompt_text[:2], "responses": r.response_text[:2], "messages": [chat, None],
         "rows": [{"answer": "7"}, {}]},
        {"prompts": r.prompt_text[2:], "responses": r.response_text[2:], "messages": [None],
         "rows": [{"answer": "2", "tests": [1]}]},
    ]
    engine.scores(rollout(["say 1 :"], ["1"]))  # a rollout without the prompt columns
    assert Scorer.bodies[-1] == {"prompts": ["say 1 :"], "responses": ["1"], "messages": [None], "rows": [{}]}


def test_http_gives_up_with_a_clear_error(server):
    Scorer.failures_left = 5
    engine = RewardEngine(HttpEndpoint(server, timeout_s=5, retries=2))
    with pytest.raises(RewardError, match=r"failed 2 times for the batch starting with prompt 'say 7 :'"):
        engine.scores(rollout(["say 7 :"], ["7"]))
    Scorer.failures_left, Scorer.wrong_count = 0, True
    with pytest.raises(RewardError, match=r"returned \[\] for 1 responses"):
        engine.scores(rollout(["say 7 :"], ["7"]))


def test_config_wants_exactly_one_reward_source():
    with pytest.raises(ConfigError, match="exactly one of reward.function, reward.model and reward.url"):
        load_config(None, ["reward.function=rayppo.tasks.digits:reward", "reward.url=http://x/score"])
    reward = load_config(None, ["reward.url=http://x/score"]).reward  # the url clears the default verifier
    assert (reward.function, reward.url) == (None, "http://x/score")
    assert load_config(None, ["reward.function=null", "reward.url=http://x/score"]).reward.url == "http://x/score"
