"""Log-probs and entropy of chosen tokens without materialising the full-vocabulary logits.

The last layer of a language model maps N hidden states ``h [N, H]`` to logits ``z = h W^T / T``
``[N, V]``. Materialised whole, with its log-softmax, softmax and their gradients, that is
several ``N x V x 4``-byte tensors: 1 GiB per tensor for 32k tokens of an 8k vocabulary, tens of
GiB for a 150k vocabulary and long responses, and on a CPU the memory traffic costs more time
than the matmul. Here the projection runs over chunks of ``chunk`` tokens; each chunk's logits
live only while the chunk's three numbers per token are taken from them:

    lse_n = logsumexp_v z_nv                      (the log-partition)
    log pi(y_n) = z_{n, y_n} - lse_n              (the chosen token's log-prob)
    H_n = lse_n - sum_v p_nv z_nv,  p = exp(z - lse)   (the entropy)

The backward pass recomputes each chunk's logits from ``h``, ``W`` and the saved ``lse``:

    d log pi(y_n) / d z_nv = [v = y_n] - p_nv
    d H_n / d z_nv         = -p_nv (z_nv - lse_n + H_n)        (= -p (log p + H))

then ``dz`` (divided by T) goes through the projection: ``dh = dz W``, ``dW += dz^T h``.
The same idea as Liger-Kernel's fused linear cross-entropy (a Triton kernel, so GPU only); this
one is plain torch and runs on both stacks.

The head in fp32. A bf16 matmul rounds every logit to bf16: 8 bits of mantissa, so a logit near
20 moves by up to 0.06 and a log-prob by as much. The generator rounds its own logits too, in
another kernel and order, so the two sides disagree by that much on tokens whose logits are large
(MiniMax-M1, arXiv:2506.13585, section 3.2: most of their train/inference gap was the head's
precision). Here the projection of a bf16 model is computed from an fp32 copy of ``W`` (made once
per call: ``V x H x 4`` bytes, 113 MB for SmolLM2's 49k x 576 head) and fp32 hidden states, and
the gradient flows back in fp32 before it is cast to the parameters' dtype. The generator does the
same (``actors/generator.py``, the fp32 head of the vLLM engine), so both read the same fp32 logits
of the same bf16 weights and hidden states: the gap left is the decoder's.

Two paths, the same numbers: ``_FusedLinearLogSoftmax`` when the head's weight is a plain tensor
(torch, ZeRO-0/1/2); activation checkpointing through the head *module* when it is not (LoRA on
the head adds its own terms, per chunk; under ZeRO-3 the module's hooks gather the partitioned
weight, a collective, so there the head is called once per pass on every rank: the pass's
response-token logits exist for that call only and are never kept for backward).
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import cast

import torch
import torch.utils.checkpoint

CHUNK_ELEMENTS = 1 << 23
"""Logits per chunk (8M: 32 MiB in fp32): 1024 tokens of an 8k vocabulary, 55 of a 152k one.
Large enough for a full-speed matmul, small enough for a cache-friendly pass over the chunk."""


@dataclass(frozen=True)
class HeadPass:
    """What one pass of the head takes from each token's logits besides log pi(y), and how many
    tokens' logits exist at once."""

    temperature: float = 1.0
    """T: the logits are divided by it, as the sampler's were."""
    with_entropy: bool = False
    """The entropy H of each token's softmax too."""
    entropy_grad: bool = True
    """A gradient flows through H; False: H is a statistic (and its backward costs nothing)."""
    chunk: int | None = None
    """Tokens per chunk; None: ``chunk_tokens(V)``."""


def chunk_tokens(vocab_size: int) -> int:
    """Tokens per chunk for a vocabulary of ``vocab_size`` (at least 1)."""
    return max(1, CHUNK_ELEMENTS // vocab_size)


def _stats_dtype(dtype: torch.dtype) -> torch.dtype:
    return torch.promote_types(dtype, torch.float32)


def _logits(hidden: torch.Tensor, weight: torch.Tensor, temperature: float) -> torch.Tensor:
    """``[n, V]`` logits of one chunk in fp32 (fp64 for fp64 inputs), divided by the sampling
    temperature. ``weight`` is already in that precision (``_FusedLinearLogSoftmax`` casts it once
    per call); a bf16 chunk of ``hidden`` is cast here: the product is formed in fp32, never
    rounded to bf16 (see the module docstring, "The head in fp32")."""
    z = hidden.to(weight.dtype) @ weight.t()
    return z if temperature == 1.0 else z.div_(temperature)


def _chunk_stats(z: torch.Tensor, targets: torch.Tensor, with_entropy: bool
                 ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """``(lse [n], log pi(targets) [n, m], H [n] or None)`` of one chunk's fp32 logits ``z [n, V]``
    at ``targets [n, m]`` (m ids per token: the sampled one, and the teacher's top ids).

    With ``y = z - max z`` and ``e = exp(y)``, ``s = sum e``: lse = max z + log s and
    H = log s - sum(e y) / s (the same H as above, in one pass over e)."""
    chosen = z.gather(1, targets)
    if not with_entropy:
        lse = torch.logsumexp(z, dim=-1)
        return lse, chosen - lse.unsqueeze(1), None
    top = z.amax(dim=-1, keepdim=True)
    y = z - top
    e = torch.exp(y)
    s = e.sum(dim=-1)
    lse = top.squeeze(1) + torch.log(s)
    return lse, chosen - lse.unsqueeze(1), torch.log(s) - torch.linalg.vecdot(e, y) / s


class _FusedLinearLogSoftmax(torch.autograd.Function):
    """``(log pi(targets) [N, m], H [N] or empty)`` of ``z = (h W^T) / T`` (in fp32 at least), chunk by chunk."""

    @staticmethod
    def forward(ctx, hidden: torch.Tensor, weight: torch.Tensor, targets: torch.Tensor,
                settings: HeadPass) -> tuple[torch.Tensor, torch.Tensor]:
        """``settings.chunk`` is set (``token_logprobs`` resolves it)."""
        temperature, with_entropy, chunk = settings.temperature, settings.with_entropy, cast(int, settings.chunk)
        n, dtype = hidden.shape[0], _stats_dtype(hidden.dtype)
        weight_stats = weight.to(dtype)  # once per call: every chunk's product in fp32
        logprobs = torch.empty(targets.shape, dtype=dtype, device=hidden.device)
        entropy = torch.empty(n if with_entropy else 0, dtype=dtype, device=hidden.device)
        lse = torch.empty(n, dtype=dtype, device=hidden.device)
        for s in range(0, n, chunk):
            z = _logits(hidden[s:s + chunk], weight_stats, temperature)
            lse[s:s + chunk], logprobs[s:s + chunk], h = _chunk_stats(z, targets[s:s + chunk], with_entropy)
            if with_entropy:
                assert h is not None  # _chunk_stats returns H with_entropy
                entropy[s:s + chunk] = h
        ctx.save_for_backward(hidden, weight, targets, lse, entropy)
        ctx.temperature, ctx.chunk, ctx.entropy_grad = temperature, chunk, with_entropy and settings.entropy_grad
        if not ctx.entropy_grad:
            ctx.mark_non_differentiable(entropy)
        ctx.set_materialize_grads(False)
        return logprobs, entropy

    @staticmethod
    def backward(ctx, grad_logprobs: torch.Tensor | None, grad_entropy: torch.Tensor | None):
        hidden, weight, targets, lse, entropy = ctx.saved_tensors
        t, chunk = ctx.temperature, ctx.chunk
        if not ctx.entropy_grad:
            grad_entropy = None
        if grad_logprobs is None and grad_entropy is None:  # neither output reached the loss
            return None, None, None, None
        grad_hidden = torch.empty_like(hidden) if ctx.needs_input_grad[0] else None
        stats = _stats_dtype(weight.dtype)
        weight_stats = weight.to(stats)  # the fp32 head of the forward, and its gradient in fp32
        grad_weight = torch.zeros(weight.shape, dtype=stats, device=weight.device) if ctx.needs_input_grad[1] else None
        for s in range(0, hidden.shape[0], chunk):
            h = hidden[s:s + chunk]
            z = _logits(h, weight_stats, t)
            p = z.sub(lse[s:s + chunk].unsqueeze(1)).exp_()
            shift = None if grad_entropy is None else entropy[s:s + chunk] - lse[s:s + chunk]  # H - lse
            dz = _logits_grad(p, z, targets[s:s + chunk], shift, _part(grad_logprobs, s, chunk),
                              _part(grad_entropy, s, chunk))
            dz = dz if t == 1.0 else dz.div_(t)
            if grad_hidden is not None:
                grad_hidden[s:s + chunk] = dz @ weight_stats
            if grad_weight is not None:
                grad_weight.addmm_(dz.t(), h.to(stats))
        grad_weight = None if grad_weight is None else grad_weight.to(weight.dtype)
        return grad_hidden, grad_weight, None, None


def _part(x: torch.Tensor | None, start: int, chunk: int) -> torch.Tensor | None:
    """Rows ``start .. start + chunk`` of a per-token gradient, as ``[n, m]`` (``[n, 1]`` for the entropy's)."""
    if x is None:
        return None
    part = x[start:start + chunk]
    return part if part.dim() == 2 else part.unsqueeze(1)


def _logits_grad(p: torch.Tensor, z: torch.Tensor, targets: torch.Tensor, shift: torch.Tensor | None,
                 grad_logprobs: torch.Tensor | None, grad_entropy: torch.Tensor | None) -> torch.Tensor:
    """``dL/dz [n, V]`` from ``dL/dlog pi(targets)`` [n, m] and ``dL/dH`` [n, 1] (either may be None);
    ``shift`` [n] is H - lse. Overwrites ``p``. Each target j adds ([v = j] - p) g_j: the p part of
    all m is -p sum_j g_j."""
    g = None if grad_logprobs is None else grad_logprobs.sum(1, keepdim=True)
    if grad_entropy is None:  # sum_j ([v = j] - p) g_j
        assert g is not None  # backward returned early when neither gradient came
        dz = p.mul_(-g)
    else:  # -p (z - lse + H) g_H - p sum_j g_j  (the [v = j] g_j parts are added below)
        assert shift is not None  # backward computes the shift whenever grad_entropy is given
        dz = p.mul_(-(z + shift.unsqueeze(1)) * grad_entropy - (0 if g is None else g))
    if grad_logprobs is not None:
        dz.scatter_add_(1, targets, grad_logprobs)
    return dz


def _checkpointed_chunk(head: torch.nn.Module, hidden: torch.Tensor, targets: torch.Tensor, temperature: float,
                        with_entropy: bool) -> tuple[torch.Tensor, torch.Tensor]:
    # The head module itself: under ZeRO-3 its hooks gather the weight only around this call, and an
    # adapter adds its own terms. A bf16 ``nn.Linear`` head computes fp32 logits here too: the model
    # was loaded with ``head_precision.set_head_fp32``.
    z = head(hidden)
    _, logprobs, entropy = _chunk_stats(z.to(_stats_dtype(z.dtype)) / temperature, targets, with_entropy)
    return logprobs, entropy if entropy is not None else logprobs.new_empty(0)


def plain_weight(head: torch.nn.Module) -> torch.Tensor | None:
    """The head's ``[V, H]`` weight when it is a bias-free ``nn.Linear`` whose weight is all here
    (not a ZeRO-3 partition, no adapter); ``None`` otherwise."""
    if type(head) is not torch.nn.Linear or head.bias is not None:
        return None
    weight = head.weight
    if hasattr(weight, "ds_id") or weight.shape != (head.out_features, head.in_features):
        return None
    return weight


def token_logprobs(hidden: torch.Tensor, head: torch.nn.Module, targets: torch.Tensor,
                   settings: HeadPass = HeadPass()) -> tuple[torch.Tensor, torch.Tensor | None]:
    """``(log pi(targets) [N] or [N, m], H_n [N] or None)`` for hidden states ``[N, H]`` and targets
    ``[N]`` (the sampled tokens) or ``[N, m]`` (m tokens per position: the sampled one and a teacher's top ids).

    Equals ``log_softmax(head(hidden).float() / T)`` (fp64 stays fp64) gathered at the targets (and the entropy of
    that softmax) to fp32 rounding, gradients included, but never holds more than ``chunk``
    tokens' logits (``settings.chunk``, default ``chunk_tokens(V)``). ``entropy_grad=False`` returns
    the entropy as a statistic (no gradient flows through it, and its backward costs nothing).
    """
    with_entropy, entropy_grad = settings.with_entropy, settings.entropy_grad
    chunk = settings.chunk or chunk_tokens(_vocab_size(head))
    flat = targets.dim() == 1
    targets = targets.long().unsqueeze(1) if flat else targets.long()  # [N, m]
    weight = plain_weight(head)
    if weight is not None:
        logprobs, entropy = _FusedLinearLogSoftmax.apply(hidden, weight, targets, replace(settings, chunk=chunk))
    else:
        logprobs, entropy = _module_head_logprobs(hidden, head, targets, replace(settings, chunk=chunk))
        entropy = entropy if entropy_grad else entropy.detach()
    return logprobs.squeeze(1) if flat else logprobs, entropy if with_entropy else None


def _vocab_size(head: torch.nn.Module) -> int:
    return getattr(head, "out_features", None) or cast(torch.Tensor, head.weight).shape[0]


def _module_head_logprobs(hidden: torch.Tensor, head: torch.nn.Module, targets: torch.Tensor, settings: HeadPass
                          ) -> tuple[torch.Tensor, torch.Tensor]:
    """``token_logprobs`` through the head module, each chunk under activation checkpointing
    (an adapter on the head, a ZeRO-3 partition): ``(log pi(targets) [N, m], H [N] or empty)``."""
    temperature, with_entropy, chunk = settings.temperature, settings.with_entropy, cast(int, settings.chunk)
    n = hidden.shape[0]
    if any(hasattr(p, "ds_id") for p in head.parameters()):
        # ZeRO-3: every call of the head gathers its weight, a collective, so every rank must make
        # the same calls whatever its token count: one per pass (its logits are transient, never
        # kept for backward, which recomputes them in one call too).
        chunk = max(n, 1)
    parts = []
    for s in range(0, max(n, 1), chunk):  # at least one call, so that an empty pass still joins
        args = (head, hidden[s:s + chunk], targets[s:s + chunk], temperature, with_entropy)
        if torch.is_grad_enabled() and hidden.requires_grad:
            parts.append(torch.utils.checkpoint.checkpoint(_checkpointed_chunk, *args, use_reentrant=False))
        else:
            parts.append(_checkpointed_chunk(*args))
    return torch.cat([p[0] for p in parts]), torch.cat([p[1] for p in parts])


@torch.no_grad()
def top_logprobs(hidden: torch.Tensor, head: torch.nn.Module, k: int, targets: torch.Tensor, temperature: float = 1.0,
                 chunk: int | None = None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(log pi(targets) [N], log pi [N, k], ids [N, k])``: at each of the hidden states ``[N, H]``
    the log-prob of its target (the sampled token), and its k most likely next tokens and their
    log-probs, most likely first, under ``log_softmax(head(hidden).float() / T)`` (a distillation
    teacher's pass, ``docs/distillation.md``), from one projection per chunk. No gradient; chunked
    as ``token_logprobs`` is, so no ``[N, V]`` tensor exists."""
    chunk = chunk or chunk_tokens(_vocab_size(head))
    weight = plain_weight(head)
    weight = None if weight is None else weight.to(_stats_dtype(weight.dtype))  # once per call, as the fused pass
    chosen, values, ids = [], [], []
    for s in range(0, hidden.shape[0], chunk):
        h = hidden[s:s + chunk]
        if weight is not None:
            z = _logits(h, weight, temperature)
        else:
            z = head(h)
            z = z.to(_stats_dtype(z.dtype)) / temperature
        lse = torch.logsumexp(z, dim=-1, keepdim=True)
        top, index = z.topk(k, dim=-1)
        chosen.append((z.gather(1, targets[s:s + chunk].long().unsqueeze(1)) - lse).squeeze(1))
        values.append(top - lse)
        ids.append(index)
    if not values:
        empty = hidden.new_zeros((0, k), dtype=_stats_dtype(hidden.dtype))
        return empty[:, 0], empty, torch.zeros((0, k), dtype=torch.long, device=hidden.device)
    return torch.cat(chosen), torch.cat(values), torch.cat(ids)
