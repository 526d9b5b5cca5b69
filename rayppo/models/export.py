"""The trained policy as a Hugging Face folder, written from the weight-sync stream.

The stream (``learner/full_weights.py`` then ``models/checkpoint_names.py``) is already the
checkpoint's layout: the names and tensors ``save_pretrained`` would write, per-expert matrices of
MoE layers unfused, LoRA merged, and a tied head sent once, under the input embedding's name. So
the export is that stream written to safetensors shards beside the base model's config: no model
is built to write it (loading the base model again on rank 0 to ``load_state_dict`` the stream
would cost another full copy in host memory, 140 GB at 70B, and failed for every tied family and
for MoE layers, whose module names are not the checkpoint's). ``from_pretrained`` re-ties the
head from the config's ``tie_word_embeddings``, exactly as it does for the base model's own files.

Peak memory is one shard (``max_shard_bytes``) plus the tensor in flight.
"""

from __future__ import annotations

import json
import shutil
from collections.abc import Iterable
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import save_file

MAX_SHARD_BYTES = 2 << 30
"""Bytes per safetensors shard (transformers' default limit is larger, 50 GB; smaller shards bound
the writer's memory)."""

_DTYPE_NAMES = {torch.float32: "float32", torch.bfloat16: "bfloat16", torch.float16: "float16"}


def write_policy(stream: Iterable[tuple[str, torch.Tensor]], base: Path, tokenizer: Any, out: Path) -> int:
    """A run's final policy: ``stream`` written as ``write_pretrained`` does, from host copies (a
    ZeRO-3 module's gathered tensors are released when the stream moves on), and the tokenizer
    beside it, so ``out`` loads with ``from_pretrained`` alone. Returns the tensors written."""
    written = write_pretrained(((name, t.to("cpu", copy=True)) for name, t in stream), base, out)
    tokenizer.save_pretrained(str(out))
    return written


def write_pretrained(stream: Iterable[tuple[str, torch.Tensor]], base: Path, out: Path,
                     max_shard_bytes: int = MAX_SHARD_BYTES) -> int:
    """Write ``stream`` (``(checkpoint name, full tensor)``) into ``out`` as a Hugging Face model
    folder: safetensors shards (with their index when there is more than one), ``base``'s
    ``config.json`` with the tensors' dtype, and its ``generation_config.json`` if any. Returns
    the number of tensors written. The tokenizer is the caller's (it is not in the stream)."""
    out.mkdir(parents=True, exist_ok=True)
    current: dict[str, torch.Tensor] = {}  # the shard being filled; earlier ones are on disk
    names: list[list[str]] = [[]]
    size, dtype, written = 0, None, 0
    for name, tensor in stream:
        nbytes = tensor.numel() * tensor.element_size()
        if current and size + nbytes > max_shard_bytes:
            _save_shard(current, out, len(names))
            current, size = {}, 0
            names.append([])
        current[name] = tensor.detach().to("cpu").contiguous()
        names[-1].append(name)
        size += nbytes
        dtype = dtype or tensor.dtype
        written += 1
    _save_shard(current, out, len(names))
    _name_shards(out, names)
    _write_config(base, out, dtype)
    return written


def _shard_path(out: Path, index: int) -> Path:
    return out / f".shard-{index:05d}.safetensors"  # renamed once the count is known


def _save_shard(tensors: dict[str, torch.Tensor], out: Path, index: int) -> None:
    save_file(tensors, str(_shard_path(out, index)), metadata={"format": "pt"})


def _name_shards(out: Path, names: list[list[str]]) -> None:
    """The shards under transformers' names, and the index that maps each tensor to its file."""
    if len(names) == 1:
        _shard_path(out, 1).rename(out / "model.safetensors")
        return
    weight_map: dict[str, str] = {}
    for index, shard_names in enumerate(names, start=1):
        final = f"model-{index:05d}-of-{len(names):05d}.safetensors"
        _shard_path(out, index).rename(out / final)
        weight_map |= dict.fromkeys(shard_names, final)
    total = sum((out / f).stat().st_size for f in set(weight_map.values()))
    (out / "model.safetensors.index.json").write_text(
        json.dumps({"metadata": {"total_size": total}, "weight_map": weight_map}, indent=2) + "\n")


def _write_config(base: Path, out: Path, dtype: torch.dtype | None) -> None:
    config = json.loads((base / "config.json").read_text())
    if dtype in _DTYPE_NAMES:
        config["dtype"] = _DTYPE_NAMES[dtype]
        config.pop("torch_dtype", None)  # transformers 4's name for the same field
    (out / "config.json").write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")
    if (base / "generation_config.json").is_file():
        shutil.copy(base / "generation_config.json", out / "generation_config.json")
