"""How far fp32 rounding can move a model's output: a first-order bound, for tests' tolerances.

A forward in fp32 computes every intermediate result y with an error of at most b(y), elementwise
(Higham, *Accuracy and Stability of Numerical Algorithms*, 2nd ed.): a dot product of length K at
most gamma_K sum |a_k||b_k| (eq. 3.5, whatever the summation order or blocking), so a matmul at most
gamma_K (|A| @ |B|); a sum or mean of n terms gamma_n times the same of their magnitudes; one
rounded operation u |y|. To first order in u the output r then moves by at most

    E = sum over results y, over their elements, of |dr/dy| * b(y)

(each result's error reaches r through the rest of the computation, whose derivative is dr/dy;
the next order is smaller by a factor of about K u, 1e-5 for K = 256). ``forward_rounding`` evaluates E on the forward
itself: the model in float64 (a stand-in for the exact values), every function the forward calls
recorded with its b(y), then one backward for every dr/dy. Two fp32 evaluations of the same
output (other batches, paddings, kernels) are each within E of the exact value, so within 2E of
each other. Padding changes nothing here: a masked position adds exact zeros, which round nothing.
Attention is bounded as the eager decomposition computes it (two matmuls and a softmax), which a
fused kernel computes with as many roundings per term.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from torch.overrides import TorchFunctionMode

U32 = 2.0**-24
"""fp32's unit roundoff: one rounded operation's relative error is at most this."""
U64 = 2.0**-53
"""float64's."""

EXACT = {"embedding", "__get__", "__getitem__", "view", "reshape", "transpose", "t", "contiguous", "cat", "expand",
         "unsqueeze", "neg", "to", "float", "dropout", "where", "arange", "tensor"}
"""Functions a decoder's forward calls that round nothing: lookups, views, copies, sign flips, the
casts between fp32 and the float64 stand-in (no-ops in the fp32 forward), dropout in eval mode.
(``t``, ``matmul`` and ``__iadd__``: DeepSpeed's ZeRO-3 linear, ``x.matmul(w.t())`` then ``+= bias``,
which stands in for ``F.linear`` in a process where a ZeRO-3 engine has started, as in the suite.)"""
ROUNDINGS = {"add": 1, "__iadd__": 1, "add_": 1, "mul": 1, "pow": 1, "rsqrt": 2, "cos": 2, "sin": 2, "silu": 6}
"""Element-wise functions and how many u of |y| each result may be off: one rounding for +, x and
a square; two for 1/sqrt (a sqrt and a division) and for a libm function (within one ulp, 2u);
silu = x / (1 + exp(-x)) an exp, an add, a division and a product."""


def gamma(n: int, u: float = U32) -> float:
    """Higham's gamma_n = n u / (1 - n u): the relative error of n roundings in a row (eq. 3.8)."""
    return n * u / (1 - n * u)


def rounding_bound(name: str, args: tuple, kwargs: dict[str, Any], out: torch.Tensor) -> torch.Tensor:
    """b(y) of the fp32 result ``out`` of function ``name`` on ``args`` (elementwise, module docstring)."""
    if name == "linear":
        x, w, bias = (list(args) + [kwargs.get("bias")])[:3]
        return gamma(x.shape[-1] + 1) * F.linear(x.abs(), w.abs(), None if bias is None else bias.abs())
    if name == "matmul":
        return gamma(args[0].shape[-1]) * torch.matmul(args[0].abs(), args[1].abs())
    if name == "mean":
        return gamma(args[0].numel() // out.numel()) * torch.mean(args[0].abs(), *args[1:], **kwargs)
    if name == "softmax":  # exp(x - max) / sum: a subtraction, an exp (2u), n - 1 additions, a division
        dim = args[1] if len(args) > 1 else kwargs["dim"]
        return gamma(args[0].shape[dim] + 4) * out.abs()
    if name in ROUNDINGS:
        return ROUNDINGS[name] * U32 * out.abs()
    raise AssertionError(f"fp_rounding: no rounding rule for torch function {name!r}: add it to EXACT, "
                         "ROUNDINGS or rounding_bound")


class RecordRounding(TorchFunctionMode):
    """Inside: every floating-point result of a torch function that rounds, kept for its gradient,
    beside its b(y) (``results``)."""

    def __init__(self) -> None:
        super().__init__()
        self.results: list[tuple[torch.Tensor, torch.Tensor]] = []

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        name = getattr(func, "__name__", str(func))
        if not isinstance(out, torch.Tensor) or not out.is_floating_point() or name in EXACT:
            return out
        with torch.no_grad():
            bound = rounding_bound(name, args, kwargs, out)
        if not out.requires_grad:  # a result of constants (rotary angles): its error still reaches r
            out.requires_grad_()
        out.retain_grad()
        self.results.append((out, bound))
        return out


def forward_rounding(model: torch.nn.Module, ids: list[int]) -> float:
    """E (module docstring) of ``model``'s fp32 score ``logits[0, 0]`` of the one row ``ids``;
    ``model`` is the fp32 model loaded in float64 with eager attention."""
    model.requires_grad_(False)
    recorded = RecordRounding()
    with recorded:
        score = model(input_ids=torch.tensor([ids])).logits[0, 0]
    score.backward()
    return sum(float((y.grad.abs() * bound).sum()) for y, bound in recorded.results if y.grad is not None)
