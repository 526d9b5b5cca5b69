"""GPT-2's ``Conv1D`` weights, which vLLM holds transposed, fingerprinted as the learner sent them.

transformers' GPT-2 keeps its attention and MLP projections (``c_attn``, ``c_proj``, ``c_fc``) as
``Conv1D`` weights laid out ``[in, out]``, and the learner sends them so; vLLM's loader transposes
them into its ``[out, in]`` linear layers (``GPT2Model._transpose_conv1d``,
vllm/model_executor/models/gpt2.py, 0.32). Read in the sent layout they are the wrong matrix, and
on CPU, where the layer's weight lives in a oneDNN kernel, the read does worse: a probe of the
sent width ``out`` reaches a kernel of width ``in``, and vLLM's ``onednn_mm`` (vllm/_custom_ops.py)
allocates the output for the probe's rows but reshapes the probe to rows of ``in``, so the kernel
writes past the buffer and the process aborts in ``malloc`` ("unsorted double linked list
corrupted"; the generator of a GPT-2 policy died of it after its first weight load).

Here the transposed weights are read in the sent layout: a kernel handed rows of the identity
of width ``in`` returns ``W^T`` exactly (each element one product with 1.0, plus exact zeros), a
plain parameter is transposed; every other weight is left to
``held_weights.worker_held_prints`` (which never sees the transposed ones).
"""

from __future__ import annotations

from typing import Any

import torch

from rayppo.actors.held_weights import worker_held_prints as held_prints
from rayppo.models.fingerprint import probe_rows, read_back, split_rows


def transposed_names(model: torch.nn.Module, shapes: dict[str, list[int]]) -> set[str]:
    """The sent 2-D tensors ``model``'s loader transposes, as its own ``_transpose_conv1d`` decides
    (empty for a model without one)."""
    transpose: Any = next((m._transpose_conv1d for m in model.modules() if hasattr(m, "_transpose_conv1d")), None)
    if transpose is None:
        return set()
    sent = [(name, torch.empty(shape, device="meta")) for name, shape in shapes.items() if len(shape) == 2]
    return {name for (name, tensor), (_, loaded) in zip(sent, transpose(iter(sent))) if loaded is not tensor}


def sent_layout_rows(module: torch.nn.Module, param: torch.Tensor, shape: list[int]) -> torch.Tensor:
    """``[in, PROBES]`` probe rows of the held ``[out, in]`` weight read as the sent ``[in, out]``."""
    if param.numel() or not hasattr(module, "cpu_linear"):
        return probe_rows(param.t())
    cpu_linear: Any = module.cpu_linear  # vLLM's kernel call: untyped (the Module reads it as a Tensor or Module)
    blocks = read_back(lambda x: cpu_linear(x, param, None), shape[0], param.dtype)  # rows of W^T
    return torch.cat([probe_rows(rows) for _, rows in blocks])


@torch.no_grad()
def worker_held_prints(worker, shapes: dict[str, list[int]]) -> dict[str, tuple[float, float]]:
    """Runs inside a vLLM worker: ``held_weights.worker_held_prints``, the weights vLLM transposed
    on load included (read in the sent layout). A transposed name the engine does not hold under
    that name stays unverified (the weight check names it)."""
    model = worker.get_model()
    transposed = transposed_names(model, shapes)
    out = held_prints(worker, {name: shape for name, shape in shapes.items() if name not in transposed})
    for name in sorted(transposed):
        module_name, _, param_name = name.rpartition(".")
        try:
            module = model.get_submodule(module_name)
        except AttributeError:
            continue
        param = getattr(module, param_name, None)
        if isinstance(param, torch.Tensor):
            out.update(split_rows(sent_layout_rows(module, param, shapes[name]), [name], shapes))
    return out
