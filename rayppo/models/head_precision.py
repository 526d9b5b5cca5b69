"""The output projection (the LM head) in fp32 for models held in bf16 or fp16.

A low-precision matmul rounds each logit to the model's dtype (bf16: 8 bits of mantissa, so a
logit near 20 moves by up to 0.06 nats), and two engines that round in different kernels disagree
by that much on the log-prob of the same token. MiniMax-M1 (arXiv:2506.13585, section 3.2) traced
most of its train/inference log-prob gap to the head's precision and removed it by running the head
in fp32. rayppo does so on every side: the learner's chunked head (``vocab_head.py``), this module
for every engine that calls the transformers head module (the reference, the transformers
generator, the full-logits path of families with their own logits), and vLLM's
``head_dtype=float32`` (``actors/generator.py``).
"""

from __future__ import annotations

import types
from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F

if TYPE_CHECKING:
    from transformers import PreTrainedModel

LOW_PRECISION = (torch.bfloat16, torch.float16)


def _fp32_forward(self: torch.nn.Linear, hidden: torch.Tensor) -> torch.Tensor:
    """``hidden W^T (+ b)`` formed in fp32: fp32 operands, fp32 logits; the gradient reaches the
    bf16 weight through the casts."""
    bias = None if self.bias is None else self.bias.float()
    return F.linear(hidden.float(), self.weight.float(), bias)


def set_head_fp32(model: PreTrainedModel, on: bool = True) -> bool:
    """Make ``model``'s output embedding (a ``nn.Linear``) compute its logits in fp32 (``on``) or
    in its own dtype again; returns whether the head is now fp32-computed.

    Only the module's ``forward`` changes: hooks (ZeRO-3 gathers the partitioned weight around the
    call) and the weight itself (shared with the input embedding of a tied model) stay as they
    are. A head that is not a plain ``nn.Linear`` or whose weight is fp32 already is left alone."""
    head = model.get_output_embeddings() if hasattr(model, "get_output_embeddings") else None
    if type(head) is not torch.nn.Linear or head.weight.dtype not in LOW_PRECISION:
        return False
    if on:
        # The instance's own forward (what Module.__setattr__ stores for a method), popped below.
        vars(head)["forward"] = types.MethodType(_fp32_forward, head)
    else:
        vars(head).pop("forward", None)
    return on
