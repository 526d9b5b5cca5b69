"""The reward role: r_phi(x, y) per response, from a verifier function, an HF reward model or an
HTTP endpoint."""

from __future__ import annotations

import json
import math
import time
import urllib.error
import urllib.request
from dataclasses import dataclass
from typing import Any

import torch

from rayppo.actors.verifier import VerifierError, VerifierProcess, VerifierTimeoutError, load_reward_function
from rayppo.data.micro_batches import scoring_batches
from rayppo.data.reward_texts import reward_text, templated
from rayppo.data.rollout import Rollout
from rayppo.errors import RayppoError
from rayppo.machine.role_resources import Engine, Resources, model_size
from rayppo.models.reward_stats import RewardStats
from rayppo.models.sequence_scores import shared_prefix_scores, shared_scoring


class RewardError(RayppoError, RuntimeError):
    """The reward could not be computed for a response; the message names the prompt."""


@dataclass
class HttpEndpoint:
    """A remote scorer: POST JSON batches, with a timeout and retries."""

    url: str
    timeout_s: float = 30.0
    retries: int = 3
    batch_size: int = 32
    """Rows per request (``reward.batch_size``)."""

    def scores(self, prompts: list[str], responses: list[str], messages: list[list[dict] | None] | None = None,
               rows: list[dict[str, Any]] | None = None) -> list[float]:
        """``[B]`` scores of one batch. The body is ``{"prompts", "responses", "messages", "rows"}``:
        each prompt's conversation (null for a plain prompt) and its row's other columns."""
        body = json.dumps({"prompts": prompts, "responses": responses,
                           "messages": messages if messages is not None else [None] * len(prompts),
                           "rows": rows if rows is not None else [{} for _ in prompts]}).encode()
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
        for prompt, x in zip(prompts, scores):
            if isinstance(x, bool) or not isinstance(x, (int, float)):
                raise RewardError(f"reward endpoint {self.url} returned {x!r}, not a number, for prompt {prompt!r}")
        return [float(x) for x in scores]


@dataclass(frozen=True)
class Verifier:
    """A verifier function, each call in a child process with a deadline (``verifier.py``)."""

    function: str
    """``module:function`` (``reward.function``; the gold scorer's: ``reward.gold_function``)."""
    timeout_s: float = 30.0
    """Seconds a call may run before its process is killed (``reward.timeout_s``)."""
    timeout_score: float | None = None
    """The score of a call past ``timeout_s``; None: the run stops with the error (``reward.timeout_score``)."""


@dataclass(frozen=True)
class ModelScorer:
    """An HF reward model (``reward.model``), re-fed each prompt and response as text."""

    path: str
    """Its folder, or a built-in model's name (resolved where the engine runs)."""
    dtype: str = "float32"
    """``model.dtype``."""
    batch_size: int = 32
    """Rows per pass (``reward.batch_size``) where ``micro_batch_tokens`` is 0."""
    micro_batch_tokens: int = 0
    """Padded tokens per pass, about equal (``reward.micro_batch_tokens``); 0: ``batch_size`` rows."""
    normalize: bool = True
    """Its scores served as (r − mean) / std by its ``reward_stats.json`` (``reward.normalize``)."""


Scorer = Verifier | ModelScorer | HttpEndpoint
"""Where a reward comes from: exactly one of a verifier, a reward model and an HTTP endpoint."""


def _started(verifier: Verifier) -> VerifierProcess:
    """The verifier's child process; a bad name fails here, at start, with the field named."""
    load_reward_function(verifier.function)
    return VerifierProcess(verifier.function, verifier.timeout_s)


class RewardEngine(Engine):
    """Scores responses with one ``Scorer``: a verifier function (``Verifier``), a reward model
    folder (``ModelScorer``) or an HTTP endpoint (``HttpEndpoint``).

    A reward model is re-fed *text* (prompt + response) through its own tokenizer, so it may use
    a different vocabulary from the policy; with its own chat template when it has one. A verifier
    and an endpoint also get each prompt row's conversation and other columns.
    """

    def __init__(self, scorer: Scorer, gold: Verifier | None = None, resources: Resources = Resources()):
        """``gold``: a gold scorer run beside the reward (``gold_scores``)."""
        self.set_threads(resources.threads)
        self.init_device(resources.gpus, "reward")
        if not isinstance(scorer, (Verifier, ModelScorer, HttpEndpoint)):
            raise ValueError(f"RewardEngine needs a Verifier, a ModelScorer or an HttpEndpoint, got {scorer!r}")
        self.scorer, self.gold_verifier = scorer, gold
        self.stats: RewardStats | None = None  # a reward model's offset and unit (reward.normalize)
        self.function = _started(scorer) if isinstance(scorer, Verifier) else None
        self.gold = _started(gold) if gold else None
        self.http = scorer if isinstance(scorer, HttpEndpoint) else None
        self.name = scorer.function if isinstance(scorer, Verifier) else (
            scorer.path if isinstance(scorer, ModelScorer) else scorer.url)
        if isinstance(scorer, ModelScorer):
            self._load_model(scorer)

    def _load_model(self, scorer: ModelScorer) -> None:
        from rayppo.models.loading import load_reward_model, load_tokenizer, resolve_model_path

        model = str(resolve_model_path(scorer.path))
        self.model = load_reward_model(model, scorer.dtype).to(self.device).eval().requires_grad_(False)
        self.stats = RewardStats.read(model) if scorer.normalize else None
        self.tokenizer = load_tokenizer(model)
        self.tokenizer.padding_side = "right"
        # a group's shared prompt run once (models/sequence_scores.py), where the family allows
        self.shared_prefix = shared_scoring(self.model)

    def describe(self) -> str:
        if isinstance(self.scorer, Verifier):
            return f"verifier {self.name} in a child process (reward.timeout_s={self.scorer.timeout_s:g})"
        if self.http:
            return f"HTTP endpoint {self.http.url}"
        served = (f", served as (r - {self.stats.mean:.3g}) / {self.stats.std:.3g} (its reward_stats.json)"
                  if self.stats is not None else "")
        return f"reward model {self.name}, {model_size(self.model)}, {self.device_info()}{served}"

    def scores(self, rollout: Rollout) -> list[float]:
        """``[B]`` r_phi(x, y); raises ``RewardError`` naming the prompt on failure or non-finite."""
        if self.function is not None and isinstance(self.scorer, Verifier):
            values = self._verifier_scores(rollout, self.function, self.scorer)
        elif self.http:
            values = self._http_scores(rollout)
        else:
            values = self._model_scores(rollout)
        for prompt, value in zip(rollout.prompt_text, values):
            if not math.isfinite(value):
                raise RewardError(f"reward {self.name} returned {value} for prompt {prompt!r}")
        return values

    def _http_scores(self, rollout: Rollout) -> list[float]:
        messages, rows = rollout.conversations(), rollout.row_fields()
        out: list[float] = []
        assert self.http is not None  # scores() calls this only with an endpoint
        for start in range(0, len(rollout), self.http.batch_size):
            part = slice(start, start + self.http.batch_size)
            out.extend(self.http.scores(rollout.prompt_text[part], rollout.response_text[part], messages[part],
                                        rows[part]))
        return out

    def gold_scores(self, rollout: Rollout) -> list[float]:
        """``[B]`` the gold scorer's scores of the rows (``reward.gold_function``); ``RewardError``
        naming the prompt on failure, as for the reward."""
        if self.gold is None or self.gold_verifier is None:
            raise RewardError("gold_scores called on a reward actor without reward.gold_function")
        return self._verifier_scores(rollout, self.gold, self.gold_verifier)

    def _verifier_scores(self, rollout: Rollout, function: VerifierProcess, verifier: Verifier) -> list[float]:
        """``function``'s scores (the process of ``verifier``: the reward's, or the gold scorer's)."""
        out = []
        name, timeout_s, timeout_score = verifier.function, verifier.timeout_s, verifier.timeout_score
        rows = zip(rollout.prompt_text, rollout.response_text, rollout.row_fields(), rollout.conversations())
        for prompt, response, fields, messages in rows:
            try:
                out.append(float(function(prompt, response, fields, messages)))
            except VerifierTimeoutError:
                if timeout_score is None:
                    raise RewardError(f"reward function {name} ran past reward.timeout_s={timeout_s:g} s on "
                                      f"prompt {prompt!r} (response {response!r}); set reward.timeout_score to score "
                                      "such responses instead of stopping") from None
                out.append(timeout_score)
            except Exception as exc:  # noqa: BLE001 - any failure of user code is reported the same way
                what = str(exc) if isinstance(exc, VerifierError) else f"{type(exc).__name__}: {exc}"  # named already
                raise RewardError(f"reward function {name} failed on prompt {prompt!r} (response {response!r}): "
                                  f"{what}") from exc
        return out

    def _model_texts(self, rollout: Rollout) -> tuple[list[str], bool]:
        """``([B] texts the reward model scores, whether they carry their special tokens)``, by the
        rule it was trained with (``data/reward_texts.py``)."""
        chat = templated(self.tokenizer)  # without a template a conversation's rendered prompt text is read
        prompts = [(conversation or prompt) if chat else prompt
                   for conversation, prompt in zip(rollout.conversations(), rollout.prompt_text)]
        texts = []
        for prompt, response in zip(prompts, rollout.response_text):
            try:
                texts.append(reward_text(self.tokenizer, prompt, response))
            except Exception as exc:  # noqa: BLE001 - the template is the model folder's Jinja code: any failure
                raise RewardError(f"reward model {self.name}'s chat template failed on prompt {prompt!r}: "
                                  f"{type(exc).__name__}: {exc}") from None
        return texts, chat

    @torch.no_grad()
    def _model_scores(self, rollout: Rollout) -> list[float]:
        texts, templated = self._model_texts(rollout)
        ids = self.tokenizer(texts, add_special_tokens=not templated)["input_ids"]
        lengths = [len(row) for row in ids]
        out = [0.0] * len(texts)
        # Micro-batches of about equal padded tokens (``reward.micro_batch_tokens``), or fixed runs of rows.
        scorer = self.scorer
        assert isinstance(scorer, ModelScorer)  # scores() calls this only with a reward model
        for rows in scoring_batches([0] * len(texts), lengths, scorer.micro_batch_tokens, scorer.batch_size):
            if self.shared_prefix:  # the rows of one prompt share their common prefix's columns
                groups: dict[str, list[int]] = {}
                for j, i in enumerate(rows):
                    groups.setdefault(rollout.prompt_text[i], []).append(j)
                values = shared_prefix_scores(self.model, [ids[i] for i in rows], list(groups.values()),
                                              self.tokenizer.pad_token_id)
            else:
                enc = self.tokenizer([texts[i] for i in rows], return_tensors="pt", padding=True,
                                     add_special_tokens=not templated).to(self.device)
                values = self.model(**enc).logits[:, 0].float().tolist()  # [b, 1] logits
            for i, value in zip(rows, values):
                out[i] = value
        if self.stats is not None:  # r_phi in units of its own spread on held-out responses, centred
            out = [(x - self.stats.mean) / self.stats.std for x in out]
        return out
