"""A generator's settings from the config: how it samples, its multi-turn episodes, its seed."""

from __future__ import annotations

from rayppo.actors.hf_backend import SamplingSettings
from rayppo.config.schema import Config
from rayppo.episodes.loop import EpisodeSettings


def sampling_settings(cfg: Config) -> SamplingSettings:
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
