"""Where the embedded model lives: importable without torch (the command line's checks use it)."""

from __future__ import annotations

import os
from pathlib import Path

BUILD_VERSION = "digits-v1"
"""Bump when the embedded model's recipe (``rayppo.models.embedded``) changes, so stale caches
are rebuilt."""


def cache_root(cache_dir: str | None = None) -> Path:
    return Path(cache_dir or os.environ.get("RAYPPO_CACHE") or Path.home() / ".cache" / "rayppo")


def embedded_path(cache_dir: str | None = None) -> Path:
    """The embedded model's folder (it may not be built yet)."""
    return cache_root(cache_dir) / BUILD_VERSION
