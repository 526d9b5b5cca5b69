"""Many multi-turn episodes advanced turn by turn: one batched sampling call per turn for every
active episode, then every environment step of that turn at once (``EnvironmentPool``).

An episode's record (docs/multi-turn.md, "Token-in, token-out"): the response is everything after the
prompt, the policy's turns (action tokens, exactly as sampled, with their log-probs) and the
observations between them (``episodes.tokens.observation_ids``, log-prob 0, action mask 0).
It ends when the environment says done (finish reason ``stop``), or is cut (``length``: the
truncation rule applies) when a turn runs out of tokens before its end-of-turn token, when the
episode's token budget (``rollout.max_new_tokens``, every token after the prompt) has no room for
the next observation or turn, or after ``rollout.max_turns`` turns.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from rayppo.episodes.environment import EnvironmentFailedError, EnvironmentPool, Episode, Step
from rayppo.errors import RayppoError
from rayppo.models.chat_tokens import Message, observation_ids

Sampler = Callable[[list[list[int]], list[int], int, list[int]], tuple[list[list[int]], list[list[float]], list[str]]]
"""``sample(contexts, limits, turn, rows) -> (ids, logprobs, finish reasons)``: one batched call of
a generator backend for turn ``turn``, each context continued by at most its limit of tokens
(``stop``: it ended on an end-of-turn token, which its ids include); ``rows``: each context's
episode (its place in ``starts``), whose seed it samples with."""


@dataclass(frozen=True)
class EpisodeSettings:
    """The multi-turn fields of the rollout section (``rollout.environment`` and its budgets)."""

    environment: str
    """``module:Class`` of the environment."""
    max_turns: int = 4
    """Turns (policy messages) per episode at most; an episode still going after them is cut."""
    turn_tokens: int = 0
    """Tokens per policy turn at most (0: the episode's budget left)."""
    max_tokens: int = 64
    """The episode's budget of tokens after the prompt, actions and observations together."""
    timeout_s: float = 30.0
    """Seconds per environment step (or start) before its process is killed."""
    timeout_reward: float | None = None
    """A step that fails or runs past ``timeout_s`` ends its episode with this turn reward; None: the
    run stops with the error."""
    workers: int = 4
    """Environment processes per generator; the steps of a turn run on them at the same time."""
    observation_role: str = "user"
    """The chat role of an observation message (``tool`` for tool results, if the template has it)."""
    max_seconds: float = 0.0
    """Seconds an episode may run (from the call's start); one still going after a turn that ends
    past them is cut there. 0: no limit."""


@dataclass
class EpisodeState:
    """One episode in progress."""

    episode: Episode
    context: list[int]
    """prompt + response so far: what the next turn is sampled from."""
    history: list[Message]
    """The conversation so far (the prompt's, then the turns and observations as messages)."""
    response_ids: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    action_mask: list[int] = field(default_factory=list)
    turn_ends: list[int] = field(default_factory=list)
    turn_rewards: list[float] = field(default_factory=list)
    environment_seconds: float = 0.0
    """Seconds its environment's steps took."""
    finish_reason: str = ""
    """"" while it is going; ``stop`` (done) or ``length`` (cut) once it ended."""

    def add_turn(self, ids: list[int], logprobs: list[float]) -> None:
        self.response_ids += ids
        self.logprobs += logprobs
        self.action_mask += [1] * len(ids)
        self.context += ids
        self.turn_ends.append(len(self.response_ids) - 1)
        self.turn_rewards.append(0.0)

    def add_observation(self, ids: list[int]) -> None:
        self.response_ids += ids
        self.logprobs += [0.0] * len(ids)
        self.action_mask += [0] * len(ids)
        self.context += ids


class EmptyTurnError(RayppoError, RuntimeError):
    """A generator sampled a turn with no tokens; the message names the prompt."""


@dataclass(frozen=True)
class EpisodeRun:
    """What one call's episodes are played with, turn after turn."""

    sample: Sampler
    """The generator backend's batched sampling."""
    tokenizer: Any
    """The policy's tokenizer: a turn's text for the environment, an observation's tokens."""
    pool: EnvironmentPool
    """The environments' processes."""
    settings: EpisodeSettings
    """The turn and token budgets, the failed step's rule."""
    end_ids: list[int]
    """The end-of-turn tokens the chat template renders (``chat_tokens.check_template``)."""
    deadline: float | None
    """``time.monotonic()`` past which an episode is cut after its turn (``max_seconds``); None: no limit."""


@dataclass(frozen=True)
class SampledTurn:
    """One episode's turn as the sampler returned it."""

    ids: list[int]
    """Its tokens (ending on the stop token that ended it, if one did)."""
    logprobs: list[float]
    """log pi_old of each token."""
    reason: str
    """``stop``: it ended on a stop token; ``length``: it ran out of tokens."""


def run_episodes(sample: Sampler, tokenizer, pool: EnvironmentPool, settings: EpisodeSettings,
                 starts: list[tuple[Episode, list[int], list[Message]]], end_ids: list[int]) -> list[EpisodeState]:
    """Play ``starts`` (each an episode, its prompt ids and its conversation) to their ends.
    ``end_ids``: the end-of-turn tokens the chat template renders (``chat_tokens.check_template``);
    a turn that stops on another stop token ends its episode as cut."""
    states = [EpisodeState(e, list(ids), list(history)) for e, ids, history in starts]
    deadline = time.monotonic() + settings.max_seconds if settings.max_seconds else None
    run = EpisodeRun(sample, tokenizer, pool, settings, end_ids, deadline)
    try:
        pool.start([s.episode for s in states])  # a class that cannot start stops the call (checked at start-up)
        for turn in range(1, settings.max_turns + 1):
            active = [s for s in states if not s.finish_reason]
            if not active:
                break
            _play_turn(run, active, turn)
        for state in states:
            state.finish_reason = state.finish_reason or "length"  # still going after max_turns: cut
    finally:
        pool.end([s.episode for s in states])
    return states


def _play_turn(run: EpisodeRun, active: list[EpisodeState], turn: int) -> None:
    """One turn of every active episode: sample, then step the environments of the turns that
    ended on an end-of-turn token, then append their observations."""
    settings = run.settings
    ids, logprobs, reasons = run.sample([s.context for s in active], [turn_limit(s, settings) for s in active], turn,
                                        [s.episode.id for s in active])
    stepping: list[tuple[EpisodeState, str]] = []
    for state, turn_ids, turn_logprobs, reason in zip(active, ids, logprobs, reasons):
        text = take_turn(state, SampledTurn(turn_ids, turn_logprobs, reason), run.end_ids, run.tokenizer, turn)
        if text is not None:
            stepping.append((state, text))
    if not stepping:
        return
    steps = run.pool.step([s.episode for s, _ in stepping], [text for _, text in stepping], turn)
    for (state, text), step in zip(stepping, steps):
        # rollout.max_turns or rollout.episode_seconds: cut after this turn, no observation to answer.
        last_turn = turn == settings.max_turns or (run.deadline is not None and time.monotonic() > run.deadline)
        answer_turn(state, text, step, run.tokenizer, settings, last_turn)


def turn_limit(state: EpisodeState, settings: EpisodeSettings) -> int:
    """Tokens the episode's next turn may sample: what is left of its budget, at most
    ``turn_tokens``."""
    left = settings.max_tokens - len(state.response_ids)
    return min(left, settings.turn_tokens) if settings.turn_tokens else left


def take_turn(state: EpisodeState, sampled: SampledTurn, end_ids: list[int], tokenizer, turn: int) -> str | None:
    """Add a sampled turn to its episode. Returns the turn's text for the environment, or None
    when the turn ran out of tokens before an end-of-turn token (the episode is then cut)."""
    ids = sampled.ids
    if not ids:
        raise EmptyTurnError(f"a generator returned an empty turn {turn} for prompt {state.episode.prompt!r}")
    state.add_turn(ids, sampled.logprobs)
    if sampled.reason != "stop" or ids[-1] not in end_ids:
        state.finish_reason = "length"  # out of tokens inside the turn: no end-of-turn to answer
        return None
    return tokenizer.decode(ids[:-1], skip_special_tokens=False)


def answer_turn(state: EpisodeState, text: str, step: Step | Exception, tokenizer, settings: EpisodeSettings,
                last_turn: bool) -> None:
    """Apply the environment's answer to the turn ``text`` (or the run's rule for a failed step):
    the turn's reward, then the end of the episode or its observation's tokens."""
    _apply_step(state, text, _step_or_rule(step, settings), tokenizer, settings, last_turn)


def _step_or_rule(step: Step | Exception, settings: EpisodeSettings) -> Step:
    """The environment's answer, or, for a failed step, the run's rule: stop with the error, or
    end the episode with ``timeout_reward``."""
    if not isinstance(step, Exception):
        return step
    if settings.timeout_reward is None or not isinstance(step, EnvironmentFailedError):
        raise step
    return Step(None, settings.timeout_reward, True)


def _apply_step(state: EpisodeState, text: str, step: Step, tokenizer, settings: EpisodeSettings,
                last_turn: bool) -> None:
    state.turn_rewards[-1] = step.reward
    state.environment_seconds += step.seconds
    if step.done:
        state.finish_reason = "stop"
        return
    if last_turn:
        state.finish_reason = "length"
        return
    end_text = tokenizer.decode(state.response_ids[-1:], skip_special_tokens=False)
    message = {"role": settings.observation_role, "content": step.observation}
    added = observation_ids(tokenizer, state.history, end_text, message)
    state.history += [{"role": "assistant", "content": text}, message]
    if len(state.response_ids) + len(added) >= settings.max_tokens:
        state.finish_reason = "length"  # no room for the observation and one more token of a turn
        return
    state.add_observation(added)


def episode_stats(action_mask: list[list[int]], turn_ends: list[list[int]], reasons: list[str],
                  max_turns: int, environment_seconds: list[float]) -> dict[str, float]:
    """The per-iteration figures of a batch of episodes: turns (mean, max), action and observation
    tokens, environment seconds, and the shares of episodes cut (all, by ``max_turns``, by the
    token and time budgets)."""
    turns = [len(t) for t in turn_ends]
    actions = [sum(m) for m in action_mask]
    cut = [r == "length" for r in reasons]
    n = max(len(turns), 1)
    return {
        "episode/turns_mean": sum(turns) / n,
        "episode/turns_max": float(max(turns, default=0)),
        "episode/action_tokens_mean": sum(actions) / n,
        "episode/observation_tokens_mean": sum(len(m) - a for m, a in zip(action_mask, actions)) / n,
        "episode/environment_seconds_mean": sum(environment_seconds) / n,
        "episode/cut_frac": sum(cut) / n,
        "episode/cut_by_turns_frac": sum(c and t >= max_turns for c, t in zip(cut, turns)) / n,
        "episode/cut_by_budget_frac": sum(c and t < max_turns for c, t in zip(cut, turns)) / n,
    }
