"""The arithmetic of an iteration's stages: useful floating-point operations of one rollout.

Counted as a matmul-bound model is (forward = 2 FLOP per multiply-add, backward = 2 x forward):

- a decoder layer's projections: ``2 x sum(in x out)`` per token (q, k, v, o, gate, up, down);
- causal attention: ``QK^T`` and ``AV`` over the positions before each token, ``2 x 2 x i x d``
  for the token at position i (i = 1..L) per layer, d = heads x head_dim;
- the vocabulary projection ``2 x h x V`` for each *response* token only (no other position's
  logits are needed); the value head ``2 x h`` for every token.

Padding, recomputation (gradient checkpointing, the chunked head's backward) and element-wise
work are not useful FLOPs: they lower ``learn_efficiency`` (and ``perf/mfu/*``), as they should.

The other stages (``stage_flops``) are forward passes counted the same way: generation is the
causal forward over every prompt and response position (the prefill over the prompt, then one
decode step per response token attending to the prefix before it) with the vocabulary head once
per generated token; the reference pass the same forward with the reference model; the reward
pass the reward model's forward over every token and its score head on the last one of each row.
A prefix cache's or a finished row's savings are not subtracted: useful is what the math needs.
json + math only.
"""

from __future__ import annotations

from dataclasses import dataclass, fields

from rayppo.models.shape import ModelShape, linears


@dataclass
class Sequences:
    """The token counts of one rollout."""

    lengths: list[int]
    """Prompt + response tokens of each row."""
    response_tokens: int
    """Response tokens of all rows together."""


def backbone_forward_flops(s: ModelShape, seq: Sequences) -> float:
    """FLOPs of the decoder layers' forward over every token of every row (no head)."""
    projections = 2 * sum(a * b for a, b in linears(s)) * sum(seq.lengths)
    attention = sum(2 * length * (length + 1) * s.heads * s.head_dim for length in seq.lengths)
    return s.layers * projections + s.layers * attention


def learn_flops(policy: ModelShape, critic: ModelShape | None, seq: Sequences, epochs: int, minibatches: int,
                proximal: bool = False) -> float:
    """Useful FLOPs of one learner stage: the critic's value pass for the experience, then per
    epoch the policy's and the critic's forward + backward (and the proximal policy's forward
    once, in asynchronous mode). The first minibatch's value forward is the experience pass's
    (``Experience.first_values``), so it counts once: 1/M of a critic forward comes off (rows of
    equal length assumed, as in the benchmark workloads). ``critic`` None: a critic-free
    estimator, the policy's passes only."""
    tokens = sum(seq.lengths)
    policy_forward = backbone_forward_flops(policy, seq) + 2 * policy.hidden * policy.vocab * seq.response_tokens
    if critic is None:
        return epochs * 3 * policy_forward + (policy_forward if proximal else 0.0)
    critic_forward = backbone_forward_flops(critic, seq) + 2 * critic.hidden * tokens
    reused = critic_forward / minibatches
    return critic_forward + epochs * 3 * (policy_forward + critic_forward) - reused + (policy_forward if proximal else 0.0)


def generate_flops(policy: ModelShape, seq: Sequences) -> float:
    """Useful FLOPs of sampling the rollout: the prefill's forward over the prompt tokens and one
    decode step per response token (its projections, its attention over the prefix before it), the
    vocabulary head for each generated token only."""
    return backbone_forward_flops(policy, seq) + 2 * policy.hidden * policy.vocab * seq.response_tokens


def reference_flops(reference: ModelShape, seq: Sequences) -> float:
    """Useful FLOPs of log pi_ref: the reference model's forward over every token, its vocabulary
    head on the response tokens only (no other position's log-prob is read)."""
    return backbone_forward_flops(reference, seq) + 2 * reference.hidden * reference.vocab * seq.response_tokens


def reward_flops(reward: ModelShape, seq: Sequences) -> float:
    """Useful FLOPs of r_phi: the reward model's forward over every token and its score head
    (``hidden x labels``) on each row's last token."""
    return backbone_forward_flops(reward, seq) + 2 * reward.hidden * max(reward.labels, 1) * len(seq.lengths)


@dataclass
class StageFlops:
    """Useful FLOPs of each stage of one iteration for one rollout; 0 for a stage that runs no model."""

    generate: float
    """Sampling the responses with the policy (``generate_flops``)."""
    reference: float
    """log pi_ref (``reference_flops``); 0 without a reference model (``ppo.kl_coef = 0``)."""
    reward: float
    """r_phi (``reward_flops``); 0 for a reward function or endpoint (no model here)."""
    learn: float
    """The learner's update (``learn_flops``)."""

    def as_dict(self) -> dict[str, float]:
        """``{stage: FLOPs}``, in the iteration's order."""
        return {f.name: getattr(self, f.name) for f in fields(self)}


def stage_flops(policy: ModelShape, reference: ModelShape | None, reward: ModelShape | None,
                critic: ModelShape | None, seq: Sequences, epochs: int, minibatches: int,
                proximal: bool = False) -> StageFlops:
    """Every stage's useful FLOPs for one rollout; a model that is None is a stage that does not
    run (``reference``), or runs none (``reward``: a function), or a critic-free learner."""
    return StageFlops(generate=generate_flops(policy, seq),
                      reference=reference_flops(reference, seq) if reference is not None else 0.0,
                      reward=reward_flops(reward, seq) if reward is not None else 0.0,
                      learn=learn_flops(policy, critic, seq, epochs, minibatches, proximal))
