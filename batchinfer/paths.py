"""Where batchinfer keeps files between runs: the demo model, the bench's named shapes,
compiled CPU kernels. One root, $BATCHINFER_CACHE_DIR, else $XDG_CACHE_HOME/batchinfer,
else ~/.cache/batchinfer."""
from __future__ import annotations

import os
from pathlib import Path


def cache_root() -> Path:
    root = os.environ.get("BATCHINFER_CACHE_DIR")
    if root:
        return Path(root).expanduser()
    xdg = os.environ.get("XDG_CACHE_HOME")
    return (Path(xdg) if xdg else Path.home() / ".cache") / "batchinfer"
