"""What a forward pass keeps alive: a learner's saved tensors for backward, a scorer's one layer.

json + math only (``rayppo plan`` never imports torch). The learner's count is tensor by tensor,
as transformers 5.19's Llama-style decoder layer and rayppo's attention save them for backward
(counted with ``torch.autograd.graph.saved_tensors_hooks`` on SmolLM2-135M's shape in fp32 and
bf16 to the byte; ``tests/test_plan_memory.py`` keeps the two equal on a small model). Per decoder layer:

- each of its two RMSNorms: its input in fp32 (``hidden_states.to(torch.float32)``: the input
  itself in fp32, a copy in bf16), 1/rms (one fp32 a position), the normalised value and the
  weighted output in the model's dtype p: ``4h + 4 + 2hp`` bytes a position;
- o_proj's input (``q p``) and the MLP's gate, silu(gate), up and their product (``4i p``; an
  ungated MLP's up and its activation, ``2i p``; a mixture-of-experts layer's for each of a
  token's experts and the shared one);
- attention, run per sequence on each row's own positions (``models/varlen_attention.py``): the
  fused kernel keeps q, k, v and its output, ``(2q + 2kv) p``, and a log-sum-exp per head in fp32;
  on CPU in bf16, sequences of at most ``MATH_ATTENTION_MAX_LENGTH`` tokens run as plain matmuls
  that keep q and k in fp32 (k repeated to the query heads), v repeated (``q p``) and the
  probabilities in fp32 and in p (``heads x L`` a position: quadratic in the length), plus the
  causal mask.

Which positions: under ``varlen`` packing (``learner.packing`` auto or packed, the families of
``VARLEN_MODELS``, no sliding window) a GRPO group's prompt runs once
(``models/shared_prompts.py``): the layer's tensors outside attention are over ``prompts x P +
rows x R`` positions, attention's over every row's ``P + R``. Other layouts run every row's prompt.
In fp32 without a shared prompt this is ``6h + 3q + 2kv + 4i`` elements a token (``layer_elements``)
and a few bytes, as before: 2278 MiB counted, 2238 MiB alive after the small bench model's policy and
critic forward of 32 x 132 tokens. On the real model's GRPO workload (16 prompts of 47 tokens x 4
samples of 32, a rank's 32 rows) a pass runs 1,776 positions, not 2,528; a rank's peak over its
steady state, freed memory returned (``MALLOC_MMAP_THRESHOLD_=1048576``), measured 2.63 GiB in fp32
(2.46 counted + 0.16 of logits) and 2.13 in bf16 (1.83 + 0.16).
"""

from __future__ import annotations

from dataclasses import dataclass

from rayppo.config.schema import Config
from rayppo.models.shape import VARLEN_MODELS, ModelShape


@dataclass(frozen=True)
class Pass:
    """The positions of one forward pass of a learner rank."""

    rows: float
    """Sequences in the pass (a whole number unless a token budget cuts a row's worth)."""
    length: int
    """P + R: a sequence's positions (the longest prompt and response assumed)."""
    positions: float
    """Positions the decoder runs: ``rows x length``, less a shared prompt's repeats."""

    @property
    def row_tokens(self) -> float:
        return self.rows * self.length


def varlen_packing(cfg: Config, models: tuple[ModelShape, ...]) -> bool:
    """Whether the learner runs ``varlen`` packing (``models.packing.pack_mode``: ``auto`` or
    ``packed`` on SDPA, a family of ``VARLEN_MODELS`` without a sliding window), for every
    trained model: a policy and critic that disagree run padded."""
    return cfg.learner.packing in ("auto", "packed") and all(
        s.family in VARLEN_MODELS and not s.sliding_window for s in models)


def learner_pass(cfg: Config, rows: int, prompt_tokens: int, budget: int, varlen: bool) -> Pass:
    """The largest pass over ``rows`` rows of ``prompt_tokens`` + ``rollout.max_new_tokens``
    positions, cut by the token ``budget`` (``pass_tokens``); under ``varlen`` packing with
    ``rollout.samples_per_prompt`` > 1 each distinct prompt once: at most one a row, and at most
    ``rollout.batch_size`` of them (a rank's rows of a group need not be together, so no fewer)."""
    length = prompt_tokens + cfg.rollout.max_new_tokens
    in_pass = pass_tokens(rows, length, budget) / length
    prompts = min(in_pass, cfg.rollout.batch_size) if varlen and cfg.rollout.samples_per_prompt > 1 else in_pass
    return Pass(in_pass, length, prompts * prompt_tokens + in_pass * cfg.rollout.max_new_tokens)


def pass_tokens(rows: int, length: int, budget: int) -> int:
    """Padded tokens of the largest forward pass over ``rows`` rows of at most ``length`` tokens
    when passes are cut by a token budget (``data.micro_batches.token_batches``: at most ``budget``,
    or one row longer than it); ``budget`` 0: all rows in one pass."""
    return rows * length if budget <= 0 else min(rows * length, max(budget, length))


def mlp_elements(s: ModelShape) -> int:
    """The MLP's saved elements a position: gate, silu(gate), up and their product (4i), an
    ungated MLP's up and its activation (2i), for each of a token's experts and the shared one."""
    return (4 if s.gated else 2) * (s.intermediate * max(s.experts_per_token, 1) + s.shared_expert)


def layer_elements(s: ModelShape) -> int:
    """Elements a position that one decoder layer holds in the model's dtype (module docstring's
    terms with p for every tensor): the norms' input, normalised value and output (6h), rotated q
    (q), k and v (2 kv), attention output and o_proj's input (2q), the MLP's. What a scorer's
    forward without gradients holds of its busiest layer (the reference, the reward model, the
    critic's experience pass, vLLM's profile run)."""
    return 6 * s.hidden + 3 * s.heads * s.head_dim + 2 * s.kv_heads * s.head_dim + mlp_elements(s)


def layer_saved_bytes(s: ModelShape, p: Pass, dtype_bytes: int, math_attention: bool) -> float:
    """Bytes one decoder layer saves for backward over the pass ``p`` (module docstring);
    ``math_attention``: attention as plain matmuls (CPU, bf16, short sequences)."""
    h, q, kv = s.hidden, s.heads * s.head_dim, s.kv_heads * s.head_dim
    norms = 2 * (4 * h + 4 + 2 * h * dtype_bytes)
    outside = p.positions * (norms + (q + mlp_elements(s)) * dtype_bytes)
    if math_attention:  # q and k in fp32, v repeated, probabilities in fp32 and p, the causal mask
        scores = p.rows * s.heads * p.length ** 2 * (4 + dtype_bytes) + p.length ** 2
        return outside + p.row_tokens * (2 * q * 4 + q * dtype_bytes) + scores
    return outside + p.row_tokens * ((2 * q + 2 * kv) * dtype_bytes + 4 * s.heads)


def activation_bytes(s: ModelShape, p: Pass, dtype_bytes: int, checkpointing: bool, math_attention: bool) -> float:
    """Saved activations of one forward with grad: every layer's set, or with checkpointing one
    hidden state per layer and position plus the one layer being recomputed."""
    layer = layer_saved_bytes(s, p, dtype_bytes, math_attention)
    if checkpointing:
        return s.layers * p.positions * s.hidden * dtype_bytes + layer
    return s.layers * layer
