"""What a model folder must hold, read from its files alone (json and the safetensors headers; no
torch, no transformers), so a broken folder is named in one line before anything heavy loads:

- every ``*.safetensors`` file whole: its 8-byte header length, its JSON header, and exactly the
  bytes the header's offsets end at (a file cut short by a full disk or an interrupted copy);
- ``config.json``'s sizes agree with the weights (the embedding's ``[vocab_size, hidden_size]``,
  the number of layers);
- tokenizer files where a tokenizer is loaded (policy, reward model);
- a reward model is a sequence classifier with one label (one number per response).

The safetensors layout (a little-endian u64 header size N, N bytes of JSON mapping tensor names
to ``dtype``, ``shape`` and ``data_offsets`` into the data that follows) is the format's spec:
https://github.com/huggingface/safetensors, "Format".
"""

from __future__ import annotations

import json
import re
import struct
from pathlib import Path
from typing import Any

from rayppo.errors import ModelFolderError

MAX_HEADER_BYTES = 100 * 1024 * 1024
"""The safetensors library refuses headers above 100 MB: a larger length is not a header."""
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model", "vocab.json")
EMBEDDING = re.compile(r"(^|\.)(embed_tokens|wte|word_embeddings)\.weight$")
LAYER = re.compile(r"\.(?:layers|h|blocks)\.(\d+)\.")


def safetensors_tensors(field: str, file: Path) -> dict[str, list[int]]:
    """``{tensor name: shape}`` of a safetensors file, checked whole; ``ModelFolderError`` naming
    the file when it is not a safetensors file or is shorter or longer than its header says."""
    size = file.stat().st_size
    with file.open("rb") as f:
        head = f.read(8)
        (length,) = struct.unpack("<Q", head) if len(head) == 8 else (None,)
        if length is None or length > min(MAX_HEADER_BYTES, size - 8):
            raise ModelFolderError(f"{field}: {file} is not a safetensors file ({size:,} bytes, no valid header)")
        try:
            header = json.loads(f.read(length))
        except (ValueError, UnicodeDecodeError):
            raise ModelFolderError(f"{field}: {file} is not a safetensors file (its header is not JSON)") from None
    tensors = {name: entry for name, entry in header.items() if name != "__metadata__"} if isinstance(header, dict) \
        else None
    if tensors is None or not all(isinstance(e, dict) and "data_offsets" in e and "shape" in e for e in tensors.values()):
        raise ModelFolderError(f"{field}: {file} is not a safetensors file (its header lists no tensors)")
    expected = 8 + length + max((int(e["data_offsets"][1]) for e in tensors.values()), default=0)
    if size != expected:
        cut = "truncated (an interrupted copy or a full disk?)" if size < expected else "longer than its header says"
        raise ModelFolderError(f"{field}: {file} is {cut}: {size:,} bytes, its header says {expected:,}")
    return {name: list(e["shape"]) for name, e in tensors.items()}


def check_weight_files(field: str, folder: Path, config: dict[str, Any]) -> None:
    """Every safetensors file of ``folder`` whole, and ``config.json``'s sizes matching them."""
    tensors: dict[str, list[int]] = {}
    for file in sorted(folder.glob("*.safetensors")):
        tensors.update(safetensors_tensors(field, file))
    text_config = config.get("text_config")
    text = text_config if isinstance(text_config, dict) else config
    vocab, hidden = text.get("vocab_size"), text.get("hidden_size", text.get("n_embd"))
    embedding = next((name for name in tensors if EMBEDDING.search(name)), None)
    if embedding and isinstance(vocab, int) and isinstance(hidden, int) and tensors[embedding] != [vocab, hidden]:
        raise ModelFolderError(f"{field}: {folder / 'config.json'} says vocab_size={vocab}, hidden_size={hidden}, but "
                               f"the weights hold {embedding} of shape {tensors[embedding]}: config and weights are "
                               "of different models")
    layers = {int(m.group(1)) for name in tensors if (m := LAYER.search(name))}
    expected = text.get("num_hidden_layers", text.get("n_layer"))
    if layers and isinstance(expected, int) and max(layers) + 1 != expected:
        raise ModelFolderError(f"{field}: {folder / 'config.json'} says num_hidden_layers={expected}, but the weights "
                               f"hold {max(layers) + 1} layers: config and weights are of different models")


def check_tokenizer_files(field: str, folder: Path) -> None:
    """A folder whose tokenizer is loaded must carry one."""
    if not any((folder / name).is_file() for name in TOKENIZER_FILES):
        raise ModelFolderError(f"{field}: {folder} has no tokenizer files ({', '.join(TOKENIZER_FILES)}): save the "
                               "tokenizer next to the weights (tokenizer.save_pretrained(dir))")


def check_reward_model(folder: Path, config: dict[str, Any]) -> None:
    """``reward.model`` scores a response with one number: a sequence classifier with one label."""
    architectures = config.get("architectures") or []
    labels = config.get("num_labels", len(config.get("id2label") or {}) or None)
    classifier = any(str(a).endswith("ForSequenceClassification") for a in architectures)
    need = "a reward model is AutoModelForSequenceClassification with num_labels=1 (one score per response)"
    if architectures and not classifier:
        raise ModelFolderError(f"reward.model: {folder} holds a {', '.join(map(str, architectures))}, not a reward "
                               f"model: {need}")
    if labels not in (None, 1):
        raise ModelFolderError(f"reward.model: {folder} is a classifier with {labels} labels, not a reward model: {need}")
    from rayppo.models.reward_stats import RewardStats

    RewardStats.read(folder)  # a damaged reward_stats.json fails here, naming it, not in an actor
