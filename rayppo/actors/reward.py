"""The reward role: r_phi(x, y) per response, from a verifier function, an HF reward model or an
HTTP endpoint."""

from __future__ import annotations

import json
import math
import time
import urllib.error
import urllib.request
from dataclasses import dataclass

import torch

from rayppo.actors.base import Engine
from rayppo.actors.verifier import VerifierProcess, VerifierTimeout, load_reward_function
from rayppo.data.rollout import Rollout
from rayppo.errors import RayppoError



class RewardError(RayppoError, RuntimeError):
    """The reward could not be computed for a response; the message names the prompt."""


@dataclass
class HttpEndpoint:
    """A remote scorer: POST JSON batches, with a timeout and retries."""

    url: str
    timeout_s: float = 30.0
    retries: int = 3

    def scores(self, prompts: list[str], responses: list[str]) -> list[float]:
        body = json.dumps({"prompts": prompts, "responses": responses}).encode()
        error: Exception | None = None
        for attempt in range(self.retries):
            if attempt:
                time.sleep(min(0.5 * 2 ** (attempt - 1), 8.0))
            request = urllib.request.Request(self.url, data=body, headers={"Content-Type": "application/json"})
            try:
                with urllib.request.urlopen(request, timeout=self.timeout_s) as reply:
                    scores = json.loads(reply.read())["scores"]
                break
            except (urllib.error.URLError, TimeoutError, ConnectionError, ValueError, KeyError) as exc:
                error = exc
        else:
            raise RewardError(f"reward endpoint {self.url} failed {self.retries} times for the batch starting "
                              f"with prompt {prompts[0]!r}: {error}")
        if not isinstance(scores, list) or len(scores) != len(prompts):
            raise RewardError(f"reward endpoint {self.url} returned {scores!r} for {len(prompts)} responses "
                              f"(batch starting with prompt {prompts[0]!r})")
        return [float(x) for x in scores]


def endpoint_from(url: str | None, timeout_s: float, retries: int) -> HttpEndpoint | None:
    """The HTTP scorer of ``reward.url``, or None when the reward is a function or a model."""
    return HttpEndpoint(url, timeout_s, retries) if url else None


class RewardEngine(Engine):
    """Scores responses with exactly one of: a verifier function, a reward model folder, or an
    HTTP endpoint (``HttpEndpoint``).

    A reward model is re-fed *text* (prompt + response) through its own tokenizer, so it may use
    a different vocabulary from the policy.
    """

    def __init__(self, function: str | None = None, model: str | None = None, batch_size: int = 32,
                 dtype: str = "float32", num_threads: int | None = None, http: HttpEndpoint | None = None,
                 gpus: float = 0.0, timeout_s: float = 30.0, timeout_score: float | None = None):
        self.set_threads(num_threads)
        self.init_device(gpus, "reward")
        if sum(x is not None for x in (function, model, http)) != 1:
            raise ValueError("RewardEngine needs exactly one of function=, model= and http=")
        self.batch_size = batch_size
        if function:
            load_reward_function(function)  # a bad name fails here, at start, with the field named
        # Each call runs in a child process that is killed past timeout_s (verifier.py).
        self.function = VerifierProcess(function, timeout_s) if function else None
        self.timeout_s, self.timeout_score = timeout_s, timeout_score
        self.http = http
        self.name = function or model or (http.url if http else "")
        if model is not None:
            from rayppo.models.loading import load_reward_model, load_tokenizer, resolve_model_path

            model = str(resolve_model_path(model))
            self.model = load_reward_model(model, dtype).to(self.device).eval().requires_grad_(False)
            self.tokenizer = load_tokenizer(model)
            self.tokenizer.padding_side = "right"

    def scores(self, rollout: Rollout) -> list[float]:
        """``[B]`` r_phi(x, y); raises ``RewardError`` naming the prompt on failure or non-finite."""
        if self.function:
            values = self._verifier_scores(rollout)
        elif self.http:
            values = [x for start in range(0, len(rollout), self.batch_size)
                      for x in self.http.scores(rollout.prompt_text[start:start + self.batch_size],
                                                rollout.response_text[start:start + self.batch_size])]
        else:
            values = self._model_scores(rollout)
        for prompt, value in zip(rollout.prompt_text, values):
            if not math.isfinite(value):
                raise RewardError(f"reward {self.name} returned {value} for prompt {prompt!r}")
        return values

    def _verifier_scores(self, rollout: Rollout) -> list[float]:
        out = []
        for prompt, response in zip(rollout.prompt_text, rollout.response_text):
            try:
                out.append(float(self.function(prompt, response)))
            except VerifierTimeout:
                if self.timeout_score is None:
                    raise RewardError(f"reward function {self.name} ran past reward.timeout_s={self.timeout_s:g} s on "
                                      f"prompt {prompt!r} (response {response!r}); set reward.timeout_score to score "
                                      "such responses instead of stopping") from None
                out.append(self.timeout_score)
            except Exception as exc:  # noqa: BLE001 - any failure of user code is reported the same way
                raise RewardError(
                    f"reward function {self.name} failed on prompt {prompt!r} "
                    f"(response {response!r}): {type(exc).__name__}: {exc}"
                ) from exc
        return out

    @torch.no_grad()
    def _model_scores(self, rollout: Rollout) -> list[float]:
        texts = [f"{p} {r}" for p, r in zip(rollout.prompt_text, rollout.response_text)]
        out: list[float] = []
        for start in range(0, len(texts), self.batch_size):
            enc = self.tokenizer(texts[start : start + self.batch_size], return_tensors="pt", padding=True).to(self.device)
            logits = self.model(**enc).logits  # [b, 1]
            out.extend(logits[:, 0].float().tolist())
        return out
