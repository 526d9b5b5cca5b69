"""What one weight sync sends of the learner's policy, on every transport (docs/lora.md).

A sync moves either the full policy (LoRA merged per layer, ``full_weights.py``) or, under
``learner.lora_sync=adapter``, the LoRA adapter's A and B alone (``adapter_weights.py``). The
three transports take the same stream: the object store packs it (``payload``), the broadcast
sends it tensor by tensor after the receivers learnt its ``layout`` once, CUDA-IPC hands it over in
runs (``ipc_runs``). Each tensor's fingerprint is recorded on the way (rank 0), in the form the
serving engine holds it (an adapter's B times its scaling, ``engine_form``), for the weight check.

Only ``torch``: the ZeRO-3 gather is handed in by the learner engine.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import torch

from rayppo.learner.adapter_weights import adapter_config, adapter_tensors, engine_form, scaling, unsupported
from rayppo.learner.broadcast_sender import SyncLayout, layer_runs, param_specs
from rayppo.learner.full_weights import Gather, full_tensors
from rayppo.models.checkpoint_names import checkpoint_tensors
from rayppo.models.fingerprint import SentPrint, sent_print
from rayppo.models.weights import WeightsPayload, pack_weights

Named = Iterator[tuple[str, torch.Tensor]]


class PolicySync:
    """The sync stream of one learner rank's policy module. Every stream is collective under
    ZeRO-3 (each rank must drain it); rank 0 keeps the fingerprints of the last one sent."""

    def __init__(self, module: torch.nn.Module, lora_sync: str, gather: Gather | None, rank: int):
        """``lora_sync``: ``none`` (no LoRA), ``merged`` or ``adapter`` (``config.derived.lora_sync``)."""
        self.module, self.gather, self.rank = module, gather, rank
        self.adapter, self.lora = lora_sync == "adapter", lora_sync != "none"
        self.sent: dict[str, SentPrint] = {}
        self._config: dict[str, Any] | None = None  # the adapter's peft config, checked once

    def full(self) -> Named:
        """``(HF name, full tensor)`` of the policy in its checkpoint's layout, LoRA merged per
        layer, one module gathered at a time: a tensor is valid until the next is requested."""
        return checkpoint_tensors(self.module, full_tensors(self.module, self.gather))

    def stream(self) -> Named:
        """What a sync sends: the adapter's A and B under peft's names, or the full policy."""
        return adapter_tensors(self.module, self.gather) if self.adapter else self.full()

    def adapter_config(self) -> dict[str, Any]:
        """The adapter's peft config, refused (naming why) where vLLM could not serve it as sent.
        Read and checked at the first sync: peft's config and the adapter's names never change."""
        if self._config is not None:
            return self._config
        config = adapter_config(self.module)
        named = [name for name, _ in adapter_tensors(self.module)]  # names only: nothing gathered
        if (why := unsupported(config, named)) is not None:
            raise ValueError(f"learner.lora_sync: the generators cannot serve this adapter: {why} "
                             "(learner.lora_sync=merged)")
        self._config = config
        return config

    def fingerprinted(self) -> Named:
        """``stream()`` passed through, each tensor's fingerprint recorded in ``sent`` as the
        engine will hold it (rank 0 only; the other ranks just follow the gathers)."""
        s = scaling(self.adapter_config()) if self.adapter else 1.0
        self.sent = {}
        for name, tensor in self.stream():
            if self.rank == 0:
                self.sent[name] = sent_print(engine_form(name, tensor, s))
            yield name, tensor

    def layout(self) -> SyncLayout:
        """What the broadcast's receivers learn once, when they join: the tensors in send order,
        and the adapter's config under adapter sync."""
        return SyncLayout(param_specs(self.stream()), self.adapter_config() if self.adapter else None)

    def payload(self, version: int) -> WeightsPayload | None:
        """Host copies of the stream for the object store (rank 0; None elsewhere, after
        following the gathers without copying anything)."""
        if self.rank != 0:
            for _ in self.stream():
                pass
            return None
        named = {name: tensor.to("cpu", copy=True) for name, tensor in self.fingerprinted()}
        return pack_weights(named, version, adapter=self.adapter_config() if self.adapter else None)

    def ipc_runs(self, zero_stage: int) -> Iterator[list[tuple[str, torch.Tensor]]]:
        """The stream in runs for CUDA-IPC: a whole policy without ZeRO-3 or LoRA is one run of
        the live parameters (no copy); an adapter is one run of copies (a few MB); otherwise one
        decoder layer at a time, copied under ZeRO-3 (the gather is released at the next module)."""
        stream = self.fingerprinted()
        if self.adapter:
            return iter([[(name, tensor.clone()) for name, tensor in stream]])
        if zero_stage < 3 and not self.lora:
            return iter([list(stream)])
        return layer_runs(stream, copy=zero_stage == 3)
