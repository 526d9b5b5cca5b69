"""The roles' settings from the config: how a generator samples, its multi-turn episodes, its
seed; the scorers' constructor arguments (the same for an actor and the in-process trainer)."""

from __future__ import annotations

from typing import Any

from rayppo.actors.hf_backend import SamplingSettings
from rayppo.actors.reward import HttpEndpoint, ModelScorer, Scorer, Verifier
from rayppo.actors.teacher import TeacherScoring
from rayppo.config.schema import Config
from rayppo.episodes.turn_loop import EpisodeSettings
from rayppo.machine.role_resources import Resources


def sampling_settings(cfg: Config) -> SamplingSettings:
    """How a generator samples: the response budget, the temperature, whether EOS ends a response."""
    r = cfg.rollout
    return SamplingSettings(r.max_new_tokens, r.temperature, r.ignore_eos)


def episode_settings(cfg: Config) -> EpisodeSettings | None:
    """The multi-turn settings of ``rollout.environment``; None for single-turn responses."""
    r = cfg.rollout
    if r.environment is None:
        return None
    return EpisodeSettings(r.environment, r.max_turns, r.turn_tokens, r.max_new_tokens, r.environment_timeout_s,
                           r.environment_timeout_reward, r.environment_workers, r.observation_role, r.episode_seconds)


def generator_seed(seed: int, generator_id: int) -> int:
    """The seed of generator ``generator_id``'s engine, fixed by the run's seed. No response draws
    from it: each row carries its own seed (``hf_backend.sample_seeds``)."""
    return (seed * 1_000_003 + 104_729 * (generator_id + 1)) % 2**31


def reference_args(cfg: Config, gpus: float, num_threads: int | None = None,
                   model_path: str | None = None) -> dict[str, Any]:
    """``ReferenceEngine``'s constructor arguments; the model ``model.reference`` (else the
    policy's) unless ``model_path`` gives it resolved."""
    m = cfg.model
    return dict(model_path=model_path or m.reference or m.policy, temperature=cfg.rollout.temperature, dtype=m.dtype,
                micro_batch_tokens=cfg.reference.micro_batch_tokens, resources=Resources(num_threads, gpus))


def teacher_args(cfg: Config, gpus: float, num_threads: int | None = None,
                 model_path: str | None = None) -> dict[str, Any]:
    """``TeacherEngine``'s constructor arguments: ``distill.teacher`` (unless ``model_path`` gives it
    resolved), scored at the sampling temperature and held out as the generators sample."""
    d = cfg.distill
    return dict(model_path=model_path or d.teacher, sampling=sampling_settings(cfg), dtype=cfg.model.dtype,
                scoring=TeacherScoring(d.micro_batch_tokens, d.topk), resources=Resources(num_threads, gpus),
                episodes=episode_settings(cfg))


def reward_args(cfg: Config, gpus: float, num_threads: int | None = None, model: str | None = None) -> dict[str, Any]:
    """``RewardEngine``'s constructor arguments: the scorer of ``reward.function``, ``reward.model``
    (unless ``model`` gives it resolved) or ``reward.url`` (None where the config has none: an
    environment's turn rewards are the reward, and no reward actor starts), and the gold scorer."""
    r = cfg.reward
    gold = Verifier(r.gold_function, r.timeout_s, r.timeout_score) if r.gold_function else None
    return dict(scorer=reward_scorer(cfg, model), gold=gold, resources=Resources(num_threads, gpus))


def reward_scorer(cfg: Config, model: str | None = None) -> Scorer | None:
    """The one scorer the reward section names (``checks.validate`` allows no more than one)."""
    r = cfg.reward
    if r.function:
        return Verifier(r.function, r.timeout_s, r.timeout_score)
    path = model or r.model
    if path:
        return ModelScorer(path, cfg.model.dtype, r.batch_size, r.micro_batch_tokens, r.normalize)
    if r.url:
        return HttpEndpoint(r.url, r.timeout_s, r.retries, r.batch_size)
    return None
