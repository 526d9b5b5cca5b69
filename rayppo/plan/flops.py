"""The arithmetic of an iteration's stages: useful floating-point operations of one rollout.

Counted as a matmul-bound model is (forward = 2 FLOP per multiply-add, backward = 2 x forward):

- a decoder layer's projections: ``2 x sum(in x out)`` per token (q, k, v, o, gate, up, down);
- causal attention: ``QK^T`` and ``AV`` over the positions before each token, ``2 x 2 x i x d``
  for the token at position i (i = 1..L) per layer, d = heads x head_dim;
- the vocabulary projection ``2 x h x V`` for each *response* token only (no other position's
  logits are needed); the value head ``2 x h`` for every token;
- a LoRA policy's backward (``learner.lora_rank``): its frozen weights get no gradient, so the
  projections and the head cost one forward's worth (the input's gradient), attention still two;
  the adapter's own products (rank r << h) are left out.

Padding, recomputation (gradient checkpointing, the chunked head's backward) and element-wise
work are not useful FLOPs: they lower ``learn_efficiency`` (and ``perf/mfu/*``), as they should.
Nor is a prompt's forward again in another row: its positions are the same numbers in every row
that shares it (causal attention), so each distinct prompt counts once (``Sequences.repeated_prompts``)
in every stage, whether the stage shares it (vLLM's prefix cache, ``models/shared_prompts.py``) or
runs it per row. So a stage counts only work it cannot avoid: an MFU above 1 is the probe's error.

The other stages (``stage_flops``) are forward passes counted the same way: generation is the
causal forward over every prompt and response position (the prefill over the prompt, then one
decode step per response token attending to the prefix before it) with the vocabulary head once
per generated token; the reference pass the same forward with the reference model; the reward
pass the reward model's forward over every token and its score head on the last one of each row.
json + math only.
"""

from __future__ import annotations

from dataclasses import dataclass, field, fields

from rayppo.models.shape import ModelShape, attention_linears, linears


@dataclass
class Sequences:
    """The token counts of one rollout."""

    lengths: list[int]
    """Prompt + response tokens of each row."""
    response_tokens: int
    """Response tokens of all rows together."""
    repeated_prompts: list[int] = field(default_factory=list)
    """The prompt tokens of each row whose prompt an earlier row has (a group's samples after its
    first): not counted again (module docstring)."""

    @property
    def tokens(self) -> int:
        """Every position a pass needs: each row's, a repeated prompt's once."""
        return sum(self.lengths) - sum(self.repeated_prompts)


def causal_attention_flops(s: ModelShape, lengths: list[int]) -> int:
    """``QK^T`` and ``AV`` of one layer over rows of these lengths: 2 x 2 x i x d at position i."""
    return sum(2 * length * (length + 1) * s.heads * s.head_dim for length in lengths)


def projection_flops(s: ModelShape, seq: Sequences) -> float:
    """FLOPs of the decoder layers' linear projections over every position (``Sequences.tokens``)."""
    return s.layers * 2 * sum(a * b for a, b in linears(s)) * seq.tokens


def attention_flops(s: ModelShape, seq: Sequences) -> float:
    """FLOPs of the decoder layers' causal attention, a repeated prompt's positions once: a row's
    responses still attend to its prompt, so what comes off is a forward over the prompt alone."""
    return s.layers * (causal_attention_flops(s, seq.lengths) - causal_attention_flops(s, seq.repeated_prompts))


def backbone_forward_flops(s: ModelShape, seq: Sequences) -> float:
    """FLOPs of the decoder layers' forward over every token of every row (no head)."""
    return projection_flops(s, seq) + attention_flops(s, seq)


def policy_update_flops(policy: ModelShape, seq: Sequences, lora: bool = False) -> float:
    """The policy's forward + backward over the rollout. Full: 3 forwards (the backward takes the
    input's gradient and the weights'). LoRA: the projections and the head once more (the input's
    gradient), but not the first layer's q, k, v, whose input is the frozen embedding's; attention
    twice more (it has two inputs and no weights)."""
    head = 2 * policy.hidden * policy.vocab * seq.response_tokens
    forward = backbone_forward_flops(policy, seq) + head
    if not lora:
        return 3 * forward
    first_qkv = 2 * sum(a * b for a, b in attention_linears(policy)[:3]) * seq.tokens
    return forward + projection_flops(policy, seq) - first_qkv + 2 * attention_flops(policy, seq) + head


@dataclass(frozen=True)
class LearnPasses:
    """How the learner goes over a rollout: the passes its update is made of."""

    epochs: int
    """E: passes over the rollout (``ppo.epochs``)."""
    minibatches: int
    """M: minibatches per epoch (``ppo.minibatches``)."""
    proximal: bool = False
    """The proximal policy's forward once more (asynchronous mode, ``rollout.max_staleness > 0``)."""
    lora: bool = False
    """A LoRA policy (``learner.lora_rank``): no gradient for its frozen weights."""


def learn_flops(policy: ModelShape, critic: ModelShape | None, seq: Sequences, passes: LearnPasses) -> float:
    """Useful FLOPs of one learner stage: the critic's value pass for the experience, then per
    epoch the policy's (``policy_update_flops``; ``lora``: a LoRA policy) and the critic's forward
    + backward (and the proximal policy's forward once, in asynchronous mode). The first
    minibatch's value forward is the experience pass's (``UpdatePlan.first_rows``), so it counts
    once: 1/M of a critic forward comes off (rows of equal length assumed, as in the benchmark
    workloads). ``critic`` None: a critic-free estimator, the policy's passes only."""
    epochs, minibatches, proximal, lora = passes.epochs, passes.minibatches, passes.proximal, passes.lora
    policy_forward = backbone_forward_flops(policy, seq) + 2 * policy.hidden * policy.vocab * seq.response_tokens
    policy_flops = epochs * policy_update_flops(policy, seq, lora) + (policy_forward if proximal else 0.0)
    if critic is None:
        return policy_flops
    critic_forward = backbone_forward_flops(critic, seq) + 2 * critic.hidden * seq.tokens
    reused = critic_forward / minibatches
    return critic_forward + epochs * 3 * critic_forward - reused + policy_flops


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
    teacher: float = 0.0
    """log pi_T of on-policy distillation: ``reference_flops`` with the teacher's shape; 0 without
    a teacher (``distill.teacher``)."""

    def as_dict(self) -> dict[str, float]:
        """``{stage: FLOPs}``, in the iteration's order (the teacher's pass runs beside the reference's)."""
        return {f.name: getattr(self, f.name) for f in fields(self)}


def stage_flops(policy: ModelShape, reference: ModelShape | None, reward: ModelShape | None,
                critic: ModelShape | None, seq: Sequences, passes: LearnPasses) -> StageFlops:
    """Every stage's useful FLOPs for one rollout; a model that is None is a stage that does not
    run (``reference``), or runs none (``reward``: a function), or a critic-free learner."""
    return StageFlops(generate=generate_flops(policy, seq),
                      reference=reference_flops(reference, seq) if reference is not None else 0.0,
                      reward=reward_flops(reward, seq) if reward is not None else 0.0,
                      learn=learn_flops(policy, critic, seq, passes))
