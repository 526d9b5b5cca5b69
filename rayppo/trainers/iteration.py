"""What every trainer's iteration shares: the KL controller, the
generators' shares of a batch, and the rollout figures of the metrics line. (A generator's own
settings and seed are ``actors/settings.py``'s.)"""

from __future__ import annotations

from rayppo.data.prompts import PromptBatch
from rayppo.data.rollout import Rollout, split_evenly
from rayppo.episodes.turn_loop import episode_stats
from rayppo.learner.ppo import AdaptiveKLController, FixedKLController


def make_kl_controller(kl_coef: float, adaptive: bool, target: float, horizon: float):
    """beta: fixed, or adapted towards ``target`` nats per response."""
    return AdaptiveKLController(kl_coef, target, horizon) if adaptive else FixedKLController(kl_coef)


def group_shares(prompts: PromptBatch, generators: int, samples_per_prompt: int) -> list[PromptBatch]:
    """Each generator's contiguous share of the batch's prompts, each prompt repeated
    ``samples_per_prompt`` times as one group (its id: the prompt's place in the batch), so that a
    group is sampled by one engine, whose prefix cache holds its prompt once."""
    return [prompts.select(rows).groups_of(samples_per_prompt, rows.start)
            for rows in split_evenly(len(prompts), generators)]


def rollout_stats(rollout: Rollout, seconds: float, max_turns: int = 0) -> dict[str, float]:
    """Reward (mean, population std, min, max), length and throughput figures of one rollout batch."""
    lengths = [len(r) for r in rollout.response_ids]
    rewards = rollout.total_rewards()  # an episode's turn rewards count too
    mean = sum(rewards) / len(rollout)
    return {
        "reward/mean": mean,
        "reward/std": (sum((s - mean) ** 2 for s in rewards) / len(rollout)) ** 0.5,
        "reward/min": min(rewards),
        "reward/max": max(rewards),
        "response/length_mean": sum(lengths) / len(lengths),
        "response/truncated_frac": sum(r == "length" for r in rollout.finish_reason) / len(rollout),
        "throughput/tokens_per_s": sum(lengths) / max(seconds, 1e-9),
        **(episode_stats(rollout.action_mask, rollout.turn_ends, rollout.finish_reason, max_turns,
                         rollout.environment_seconds or [0.0] * len(rollout)) if rollout.action_mask else {}),
        # The gold scorer's mean on the same rows, beside the (proxy) reward it is compared with.
        **({"reward/gold_mean": sum(rollout.gold_score) / len(rollout)} if rollout.gold_score else {}),
        **(distill_stats(rollout) if rollout.teacher_logprobs else {}),
    }


def distill_stats(rollout: Rollout) -> dict[str, float]:
    """The reverse KL to the teacher on the student's samples: per token, k1 = log mu - log pi_T
    (the generator's log-probs) over the action tokens, its mean and 90th percentile
    (``distill/reverse_kl_mean``, ``_p90``), and its sum per response (``distill/reverse_kl_per_response``)."""
    masks = rollout.action_mask or [[1] * len(ids) for ids in rollout.response_ids]
    per_row = [[lp - tp for lp, tp, m in zip(row, teacher, mask) if m]
               for row, teacher, mask in zip(rollout.logprobs, rollout.teacher_logprobs, masks)]
    tokens = sorted(x for row in per_row for x in row)
    if not tokens:
        return {}
    return {"distill/reverse_kl_mean": sum(tokens) / len(tokens),
            "distill/reverse_kl_p90": tokens[min(len(tokens) - 1, int(0.9 * len(tokens)))],
            "distill/reverse_kl_per_response": sum(sum(row) for row in per_row) / len(per_row)}

