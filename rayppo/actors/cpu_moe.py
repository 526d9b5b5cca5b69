"""vLLM's CPU mixture-of-experts kernel, made to take weight updates (vLLM 0.32).

At start-up vLLM's CPU backend repacks each MoE layer's experts into the grouped-GEMM layout its
``cpu_fused_moe`` op reads (``CPUUnquantizedExperts.process_weights_after_loading``,
vllm/model_executor/layers/fused_moe/experts/cpu_moe.py): the parameters keep their shape, their
elements change order. A weight update runs vLLM's layerwise reload, and there
``UnquantizedFusedMoEMethod._setup_kernel`` (fused_moe/unquantized_fused_moe_method.py) skips
that repack once the kernel exists (``is_weight_update``): the new experts are copied in unpacked
and the kernel reads them as packed. The parameters then hold exactly what was sent, and the
logits are wrong.

``patch`` (run in every vLLM process by rayppo's plugin, ``weight_receiver.register``) repacks on
updates too. The reload then copies the packed result into the kernel's original storage
(``_copy_and_restore_kernel_tensors``, model_loader/reload/layerwise.py), so the next update
finds the same parameters. Since the packed layout is vLLM's own, the weight check reads each
expert matrix's probe taken just before the repack (``expert_probes``): what vLLM was handed.
"""

from __future__ import annotations

import torch

from rayppo.models.fingerprint import probe_rows

PROBES = "_rayppo_expert_probes"
"""The layer attribute holding ``{parameter name: [probe rows of each expert's matrix]}``."""
EXPERT_WEIGHTS = ("w13_weight", "w2_weight")


def expert_probes(layer: torch.nn.Module, param_name: str) -> list[torch.Tensor] | None:
    """The probe rows of each expert's ``param_name`` as loaded, before vLLM's CPU repack; None
    where the layer was not repacked (GPUs, zentorch, a dense layer)."""
    return getattr(layer, PROBES, {}).get(param_name)


def patch() -> None:
    """Repack the CPU experts after every weight update, recording their probes first (idempotent)."""
    try:
        from vllm.model_executor.layers.fused_moe.experts.cpu_moe import CPUUnquantizedExperts
        from vllm.model_executor.layers.fused_moe.unquantized_fused_moe_method import UnquantizedFusedMoEMethod
    except ImportError:  # a vLLM build or version without these: nothing of it to patch
        return

    if getattr(CPUUnquantizedExperts, "_rayppo_patched", False):
        return
    repack = CPUUnquantizedExperts.process_weights_after_loading
    setup = UnquantizedFusedMoEMethod._setup_kernel

    @torch.no_grad()
    def process_weights_after_loading(self, layer: torch.nn.Module) -> None:
        setattr(layer, PROBES, {name: [probe_rows(m) for m in getattr(layer, name)] for name in EXPERT_WEIGHTS})
        repack(self, layer)

    def _setup_kernel(self, layer: torch.nn.Module, w13: torch.Tensor, w2: torch.Tensor) -> None:
        update = self.moe_kernel is not None  # vLLM's own test for a weight update
        setup(self, layer, w13, w2)
        if update and isinstance(self.moe_kernel.fused_experts, CPUUnquantizedExperts):
            # The layer holds the reload's fresh, unpacked parameters here (never the live packed ones).
            self.moe_kernel.fused_experts.process_weights_after_loading(layer)

    CPUUnquantizedExperts.process_weights_after_loading = process_weights_after_loading
    UnquantizedFusedMoEMethod._setup_kernel = _setup_kernel
    CPUUnquantizedExperts._rayppo_patched = True
