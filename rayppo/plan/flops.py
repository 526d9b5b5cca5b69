"""The arithmetic of the learner's stage: useful floating-point operations per PPO iteration.

Counted as a matmul-bound model is (forward = 2 FLOP per multiply-add, backward = 2 x forward):

- a decoder layer's projections: ``2 x sum(in x out)`` per token (q, k, v, o, gate, up, down);
- causal attention: ``QK^T`` and ``AV`` over the positions before each token, ``2 x 2 x i x d``
  for the token at position i (i = 1..L) per layer, d = heads x head_dim;
- the vocabulary projection ``2 x h x V`` for each *response* token only (no other position's
  logits are needed); the value head ``2 x h`` for every token.

Padding, recomputation (gradient checkpointing, the chunked head's backward) and element-wise
work are not useful FLOPs: they lower ``learn_efficiency``, as they should. json + math only.
"""

from __future__ import annotations

from dataclasses import dataclass

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
