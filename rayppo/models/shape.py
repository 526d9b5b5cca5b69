"""A model's shape from its ``config.json``, under whichever names its family uses.

Families name one quantity differently: the context is ``max_position_embeddings`` (Llama),
``n_positions`` (GPT-2, GPT-J, StarCoder 1) or absent (BLOOM's ALiBi); the width ``n_embd``; the
MLP ``ffn_dim`` (OPT) or ``n_inner`` (GPT-2, None meaning 4h); the experts ``num_experts``
(Qwen2-MoE), ``num_local_experts`` (Mixtral, Qwen3-MoE) or ``n_routed_experts`` (DeepSeek).
transformers' config classes alias these (``attribute_map``, transformers 5.19
``models/*/configuration_*.py``), but importing transformers imports torch, which
``rayppo plan`` never does: this module reads the JSON with the same aliases (json only).

``param_count`` counts the weights of the structures it knows exactly (tested against
``numel`` of real models): Llama-style decoders (Llama, Mistral, Qwen2/3, Gemma 1-3, Phi-3,
Granite, OLMo 2), the GPT-2 / OPT / GPT-NeoX / Phi style (ungated MLP, biases, LayerNorm), and
mixture-of-experts layers (Mixtral, Qwen2-MoE, Qwen3-MoE).
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

ALIASES = {
    "hidden": ("hidden_size", "n_embd", "d_model"),
    "layers": ("num_hidden_layers", "n_layer", "num_layers"),
    "heads": ("num_attention_heads", "n_head"),
    "kv_heads": ("num_key_value_heads", "num_kv_heads"),
    "intermediate": ("intermediate_size", "ffn_dim", "n_inner"),
    "max_positions": ("max_position_embeddings", "n_positions", "max_sequence_length", "seq_length"),
    "experts": ("num_experts", "num_local_experts", "n_routed_experts"),
    "experts_per_token": ("num_experts_per_tok", "moe_top_k"),
}
"""ModelShape field -> the config.json names for it, first found wins."""

UNGATED = {"gpt2", "gpt_bigcode", "gptj", "gpt_neox", "opt", "phi", "bloom", "falcon", "starcoder2", "codegen"}
"""Families whose MLP is up -> activation -> down (two matrices), not gated (three)."""
LAYER_NORM = {"gpt2", "gpt_bigcode", "gptj", "gpt_neox", "opt", "phi", "bloom", "falcon", "starcoder2", "codegen"}
"""Families whose norms are LayerNorm (weight and bias), not RMSNorm (weight)."""
LEARNED_POSITIONS = {"gpt2": 0, "gpt_bigcode": 0, "opt": 2}
"""Families with a learned position embedding, and its extra rows (OPT's offset of 2)."""
PARALLEL_BLOCK = {"gptj", "phi", "codegen"}
"""One norm per layer: attention and MLP read the same normalised input."""
TIED_BY_DEFAULT = {"gpt2", "gpt_bigcode", "opt", "gemma", "gemma2", "gemma3_text", "bloom", "falcon", "gptj"}
"""Families whose ``tie_word_embeddings`` defaults to true when config.json omits it."""
NO_GROUPED_QUERY = {"gpt2", "gptj", "gpt_neox", "opt", "bloom", "codegen"}
"""Families whose keys and values have every head (``num_key_value_heads``, if present, is unused)."""
NORMS_PER_LAYER = {"gemma2": 4, "gemma3_text": 4, "olmo2": 2}
"""Gemma 2/3 norm both sides of attention and MLP; OLMo 2 normalises after each (2, placed differently)."""

VARLEN_MODELS = frozenset({"llama", "mistral", "mixtral", "qwen2", "qwen3", "qwen3_moe", "phi3", "olmo2"})
"""Model types whose transformers 5.19 attention is plain causal SDPA over ``ALL_ATTENTION_FUNCTIONS``
with the keyword arguments passed through every layer (no soft-capping, no attention sinks; the only
other keyword is ``sliding_window``): ``learner.packing=auto`` runs these in one packed row on SDPA
when their config sets no sliding window (``models.packing.pack_mode``). Not Qwen2-MoE: it builds a
sliding-window mask over the row even with the window off (``sliding_window=0``)."""

MATH_ATTENTION_MAX_LENGTH = 128
"""Longest bucket that ``causal_attention`` runs as plain matmuls (bf16/fp16, CPU, with gradients).
Measured on 2 cores, fwd+bwd of one layer's bucket of ~2,600 tokens, 9 query / 3 key heads of 64:
fused 56 / 47 / 46 / 60 ms against 26 / 25 / 35 / 49 ms at lengths 43 / 80 / 128 / 180; past 256 the
fused kernel wins (its memory is linear in the length, the scores here are quadratic)."""


@dataclass(frozen=True)
class ModelShape:
    """What the plan's estimates need to know of a decoder (or its reward-model variant)."""

    family: str
    """``model_type`` (``llama``, ``gpt2``, ``mixtral``, ...)."""
    hidden: int
    """h: ``hidden_size``."""
    intermediate: int
    """i: the MLP's inner width (of one expert in a mixture-of-experts layer)."""
    layers: int
    """``num_hidden_layers``."""
    vocab: int
    """V: ``vocab_size``."""
    heads: int
    """``num_attention_heads``."""
    kv_heads: int
    """``num_key_value_heads`` (grouped-query attention)."""
    head_dim: int
    """``head_dim``, else h / heads."""
    tied: bool
    """``tie_word_embeddings``: the LM head is the embedding matrix."""
    qkv_bias: bool
    """q/k/v projections have biases (``attention_bias``; Qwen2 always; the GPT-2 style always)."""
    o_bias: bool
    """o projection has a bias."""
    qk_norm: bool
    """RMSNorm on q and k: per head (Qwen3), or over the whole projection (OLMo 2)."""
    mlp_bias: bool
    """The MLP's projections have biases."""
    labels: int
    """Classification labels (a reward model's score head); 0 for a causal LM."""
    max_positions: int | None
    """The longest sequence the model is made for; None when it names none (ALiBi)."""
    gated: bool = True
    """Gated MLP (gate, up, down) or not (up, down)."""
    layer_norm: bool = False
    """LayerNorm (weight + bias) rather than RMSNorm (weight)."""
    positions: int = 0
    """Rows of a learned position embedding (0: rotary or ALiBi)."""
    norms_per_layer: int = 2
    experts: int = 0
    """Routed experts per mixture-of-experts layer; 0 for a dense model."""
    experts_per_token: int = 0
    shared_expert: int = 0
    """Inner width of the shared expert (Qwen2-MoE), 0 if none."""
    sliding_window: bool = False
    """Attention within a sliding window (``windowed``): rules out the learner's ``varlen`` packing."""

    @property
    def moe(self) -> bool:
        return self.experts > 0


def _first(c: dict[str, Any], field: str, default: Any = None) -> Any:
    for name in ALIASES[field]:
        if c.get(name) is not None:
            return c[name]
    return default


def shape_from_config(c: dict[str, Any]) -> ModelShape:
    """The shape described by a parsed ``config.json`` (a multimodal one's ``text_config``)."""
    c = c.get("text_config", c)
    kind = c.get("model_type", "")
    h, heads = _first(c, "hidden"), _first(c, "heads")
    experts = int(_first(c, "experts", 0) or 0)
    inner = c.get("moe_intermediate_size") if experts and c.get("moe_intermediate_size") else _first(c, "intermediate")
    bias = bool(c.get("attention_bias", False)) or kind in UNGATED and kind != "gptj"
    ungated_bias = kind in UNGATED and bool(c.get("bias", c.get("use_bias", True)))
    classifier = any(a.endswith("ForSequenceClassification") for a in c.get("architectures") or [])
    positions = _first(c, "max_positions")
    return ModelShape(
        family=kind, hidden=h, intermediate=inner or 4 * h, layers=_first(c, "layers"), vocab=c["vocab_size"],
        heads=heads, kv_heads=heads if kind in NO_GROUPED_QUERY else _first(c, "kv_heads") or heads, head_dim=c.get("head_dim") or h // heads,
        tied=bool(c.get("tie_word_embeddings", kind in TIED_BY_DEFAULT)),
        qkv_bias=bias or kind == "qwen2" or kind == "qwen2_moe", o_bias=bias and kind not in ("qwen2", "qwen2_moe"),
        qk_norm=kind.startswith("qwen3") or kind == "olmo2", mlp_bias=bool(c.get("mlp_bias", False)) or ungated_bias,
        labels=(len(c.get("id2label") or {}) or c.get("num_labels", 1)) if classifier else 0,
        max_positions=int(positions) if positions else None, gated=kind not in UNGATED, layer_norm=kind in LAYER_NORM,
        positions=(positions + LEARNED_POSITIONS[kind]) if kind in LEARNED_POSITIONS and positions else 0,
        norms_per_layer=1 if kind in PARALLEL_BLOCK else NORMS_PER_LAYER.get(kind, 2),
        experts=experts, experts_per_token=int(_first(c, "experts_per_token", 0) or 0),
        shared_expert=int(c.get("shared_expert_intermediate_size") or 0), sliding_window=windowed(c, kind))


def windowed(c: dict[str, Any], kind: str) -> bool:
    """Whether transformers 5.19 gives the model a sliding window (the config's ``sliding_window``):
    config.json's value, Mistral's default 4096 where it names none, and for Qwen 2/3 only with
    ``use_sliding_window`` (their configuration classes set it to None otherwise)."""
    window = c.get("sliding_window", 4096 if kind == "mistral" else None)
    return window is not None and (not kind.startswith("qwen") or bool(c.get("use_sliding_window", False)))


def read_shape(path: str | Path) -> ModelShape:
    """The shape of the model in folder ``path`` (its ``config.json``)."""
    return shape_from_config(json.loads((Path(path) / "config.json").read_text()))


def context_of(c: dict[str, Any]) -> int | None:
    """The context length a parsed ``config.json`` names, by its family's name for it (None: none)."""
    positions = _first(c.get("text_config", c), "max_positions")
    return int(positions) if positions else None


def max_positions(path: str | Path) -> int | None:
    """The context length of the model in folder ``path`` (None: its config names none)."""
    return context_of(json.loads((Path(path) / "config.json").read_text()))


def attention_linears(s: ModelShape) -> list[tuple[int, int]]:
    """(in, out) of one layer's attention projections: q, k, v, o."""
    q, kv, h = s.heads * s.head_dim, s.kv_heads * s.head_dim, s.hidden
    return [(h, q), (h, kv), (h, kv), (q, h)]


def mlp_linears(s: ModelShape, inner: int) -> list[tuple[int, int]]:
    """(in, out) of one MLP of inner width ``inner``: gate, up, down (or up, down ungated)."""
    h = s.hidden
    return [(h, inner), (h, inner), (inner, h)] if s.gated else [(h, inner), (inner, h)]


def linears(s: ModelShape) -> list[tuple[int, int]]:
    """(in, out) of one layer's linear layers a token passes through: the attention projections
    and the MLP (of a mixture-of-experts layer: ``experts_per_token`` experts and the shared one)."""
    if not s.moe:
        return attention_linears(s) + mlp_linears(s, s.intermediate)
    experts = mlp_linears(s, s.intermediate) * s.experts_per_token
    return attention_linears(s) + experts + (mlp_linears(s, s.shared_expert) if s.shared_expert else [])


def layer_params(s: ModelShape) -> int:
    """Parameters of one decoder layer: projections (every expert's), their biases, router, norms."""
    q, kv, h = s.heads * s.head_dim, s.kv_heads * s.head_dim, s.hidden
    params = sum(a * b for a, b in attention_linears(s))
    params += (q + 2 * kv if s.qkv_bias else 0) + (h if s.o_bias else 0)
    mlps = [s.intermediate] * max(s.experts, 1) + ([s.shared_expert] if s.shared_expert else [])
    for inner in mlps:
        params += sum(a * b for a, b in mlp_linears(s, inner))
        params += (inner * (2 if s.gated else 1) + h) if s.mlp_bias else 0
    if s.moe:
        params += h * s.experts + (h if s.shared_expert else 0)  # the router; Qwen2-MoE's shared-expert gate
    if s.qk_norm:
        params += q + kv if s.family == "olmo2" else 2 * s.head_dim
    return params + s.norms_per_layer * _norm(s)


def _norm(s: ModelShape) -> int:
    return 2 * s.hidden if s.layer_norm else s.hidden


def param_count(s: ModelShape, head: str = "lm") -> int:
    """Parameters of embedding (+ learned positions) + layers + final norm + ``head``: ``lm``
    (V x h unless tied), ``score`` (a reward model's h x labels), ``value`` (the critic's h + 1)
    or ``none``."""
    heads = {"lm": 0 if s.tied else s.vocab * s.hidden, "score": s.hidden * max(s.labels, 1),
             "value": s.hidden + 1, "none": 0}
    lm_bias = s.vocab if head == "lm" and s.family in ("phi", "gptj", "codegen") else 0
    embeddings = (s.vocab + s.positions) * s.hidden
    return embeddings + s.layers * layer_params(s) + _norm(s) + heads[head] + lm_bias


def lora_params(s: ModelShape, rank: int) -> int:
    """LoRA adapters on every linear layer of the decoder (peft ``all-linear``): r (in + out) each."""
    per_layer = attention_linears(s) + mlp_linears(s, s.intermediate) * max(s.experts, 1)
    per_layer += mlp_linears(s, s.shared_expert) if s.shared_expert else []
    return s.layers * sum(rank * (a + b) for a, b in per_layer)
