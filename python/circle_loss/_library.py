"""Finding and loading the compiled operator library."""

from __future__ import annotations

import os
from pathlib import Path

import torch

_LIBRARY_NAME = "libcircle_loss_ops.so"


def library_path() -> str:
    """Absolute path of ``libcircle_loss_ops.so``, the library that registers
    ``torch.ops.circle.*``. C++ programs link it; other Python code may pass it
    to ``torch.ops.load_library``. ``CIRCLE_LOSS_LIBRARY`` overrides it."""
    override = os.environ.get("CIRCLE_LOSS_LIBRARY")
    path = Path(override) if override else Path(__file__).with_name(_LIBRARY_NAME)
    if not path.is_file():
        raise FileNotFoundError(
            f"circle_loss: operator library not found at {path}; build and install "
            "the package with `pip install --no-build-isolation .`"
        )
    return str(path)


def load() -> None:
    """Registers the circle::* operators (idempotent)."""
    if not hasattr(torch.ops.circle, "loss"):
        torch.ops.load_library(library_path())
