"""Moving weights between processes: named tensors <-> numpy arrays for Ray's object store.

numpy arrays travel through the object store without a copy on the receiving side; bfloat16 has
no numpy dtype, so it travels as raw 16-bit integers and is reinterpreted on arrival.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from typing import Any, TypeVar

import numpy as np
import torch

T = TypeVar("T")


@dataclass
class WeightsPayload:
    """A full set of policy weights at one version."""

    arrays: dict[str, np.ndarray]
    """Parameter name (Hugging Face naming) -> values."""
    dtypes: dict[str, str]
    """Parameter name -> torch dtype name (``float32``, ``bfloat16``, ...)."""
    version: int
    """Policy version these weights are (the learner's step count)."""
    adapter: dict[str, Any] | None = None
    """The peft config when ``arrays`` are a LoRA adapter's A and B under peft's names
    (``learner.lora_sync=adapter``, ``learner/adapter_weights.py``); None: the full weights."""

    @property
    def nbytes(self) -> int:
        return sum(a.nbytes for a in self.arrays.values())


def pack_weights(named: dict[str, torch.Tensor], version: int, adapter: dict[str, Any] | None = None
                 ) -> WeightsPayload:
    arrays, dtypes = {}, {}
    for name, tensor in named.items():
        t = tensor.detach().cpu().contiguous()
        dtypes[name] = str(t.dtype).removeprefix("torch.")
        arrays[name] = (t.view(torch.int16) if t.dtype == torch.bfloat16 else t).numpy()
    return WeightsPayload(arrays, dtypes, version, adapter)


def unpack_weights(payload: WeightsPayload) -> dict[str, torch.Tensor]:
    out = {}
    for name, array in payload.arrays.items():
        t = torch.from_numpy(np.array(array, copy=not array.flags.writeable))
        out[name] = t.view(torch.bfloat16) if payload.dtypes[name] == "bfloat16" else t
    return out


def with_aliases(named: Iterable[tuple[str, T]], aliases: dict[str, str]) -> Iterator[tuple[str, T]]:
    """Each ``(name, item)`` of ``named``, followed by the same item under every name that
    ``aliases`` (``{alias: source}``) shares with it.

    The learner sends a tied head once, under the embedding's name. An engine whose head is a module
    of its own sharing that parameter (vLLM's Gemma, OPT: ``ParallelLMHead``) must receive it under
    the head's name too: vLLM's layerwise reload (model_executor/model_loader/reload/layerwise.py,
    0.32) reprocesses only the layers that received tensors, so on CPU a head that received
    nothing keeps the repacked copy of the old embedding that computes the logits.
    """
    by_source: dict[str, list[str]] = {}
    for alias, source in aliases.items():
        by_source.setdefault(source, []).append(alias)
    for name, item in named:
        yield name, item
        for alias in by_source.get(name, ()):
            yield alias, item


@dataclass(frozen=True)
class SyncFault:
    """Testing only (``checks.sync_fault``): what a broken generator does to the weights it is sent,
    so that tests can show the correctness guard stopping the run."""

    kind: str = "none"
    """``none``, ``skip_all`` (load nothing; with adapter sync: keep serving the previous
    adapter), ``skip_tensor`` (load all but ``tensor``), ``perturb_tensor`` (load ``tensor`` plus
    1% of its RMS) or ``drop_adapter`` (adapter sync: load it, then serve requests with none)."""
    tensor: str = ""
    """The Hugging Face name of the tensor that ``skip_tensor`` / ``perturb_tensor`` hit."""

    def apply(self, named: Iterable[tuple[str, torch.Tensor]]) -> Iterator[tuple[str, torch.Tensor]]:
        """The ``(name, tensor)`` stream this generator actually loads."""
        for name, tensor in named:
            if self.kind == "skip_all" or (self.kind == "skip_tensor" and name == self.tensor):
                continue
            if self.kind == "perturb_tensor" and name == self.tensor:
                tensor = tensor + 0.01 * tensor.float().square().mean().sqrt().to(tensor.dtype)
            yield name, tensor
