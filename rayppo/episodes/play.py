"""A generator's batch of prompts as multi-turn episodes, returned as one ``Rollout``.

The generator engine calls ``play_episodes`` with its backend's sampler; this module holds what is
between the prompt rows and the episode loop (``loop.run_episodes``): the conversations the
episodes start from, and the record the learner trains on (``Rollout.action_mask``,
``turn_ends``, ``turn_rewards``).
"""

from __future__ import annotations

from rayppo.data.prompts import PromptBatch
from rayppo.data.rollout import Rollout
from rayppo.episodes.environment import EnvironmentPool, Episode
from rayppo.episodes.turn_loop import EpisodeSettings, Sampler, run_episodes
from rayppo.models.chat_tokens import TemplateError


def play_episodes(sample: Sampler, tokenizer, pool: EnvironmentPool, settings: EpisodeSettings,
                  prompts: PromptBatch, end_ids: list[int]) -> Rollout:
    """One episode per prompt row (a group's rows are separate episodes). The rows must be chat
    conversations: an observation is a message of the same conversation."""
    fields = prompts.fields or [{} for _ in range(len(prompts))]
    starts = []
    for i, (text, ids) in enumerate(zip(prompts.texts, prompts.ids)):
        messages = prompts.messages[i] if prompts.messages else None
        if not messages:
            raise TemplateError(f"rollout.environment needs chat prompts (a list of messages per row); prompt {text!r} "
                                "is plain text")
        starts.append((Episode(i, text, fields[i], messages), ids, messages))
    states = run_episodes(sample, tokenizer, pool, settings, starts, end_ids)
    response_ids = [s.response_ids for s in states]
    return Rollout(
        prompt_ids=[list(p) for p in prompts.ids],
        response_ids=response_ids,
        logprobs=[s.logprobs for s in states],
        finish_reason=[s.finish_reason for s in states],
        prompt_text=list(prompts.texts),
        # The transcript with its role markers, so a reward function can read the turns.
        response_text=tokenizer.batch_decode(response_ids, skip_special_tokens=False),
        group_id=list(prompts.groups),
        prompt_messages=prompts.messages_json(),
        prompt_fields=prompts.fields_json(),
        action_mask=[s.action_mask for s in states],
        turn_ends=[s.turn_ends for s in states],
        turn_rewards=[s.turn_rewards for s in states],
        environment_seconds=[s.environment_seconds for s in states],
    )
