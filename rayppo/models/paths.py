"""Where the embedded model lives: importable without torch (the command line's checks use it)."""

from __future__ import annotations

import os
from pathlib import Path

BUILD_VERSION = "digits-v1"
"""Bump when the embedded model's recipe (``rayppo.models.embedded``) changes, so stale caches
are rebuilt."""
GUESS_BUILD_VERSION = "guess-v1"
"""Likewise for the embedded multi-turn model (``model.policy: embedded-guess``, ``rayppo.models.embedded_guess``)."""
EMBEDDED_MODELS = {"embedded": BUILD_VERSION, "embedded-guess": GUESS_BUILD_VERSION}
"""The model names rayppo builds itself, and their cache folders."""


def cache_root(cache_dir: str | None = None) -> Path:
    return Path(cache_dir or os.environ.get("RAYPPO_CACHE") or Path.home() / ".cache" / "rayppo")


def embedded_path(cache_dir: str | None = None, name: str = "embedded") -> Path:
    """The folder of the embedded model ``name`` (``EMBEDDED_MODELS``; it may not be built yet)."""
    return cache_root(cache_dir) / EMBEDDED_MODELS[name]
