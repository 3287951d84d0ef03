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


def built_for() -> str | None:
    """The torch version the installed library was compiled against, as the
    build recorded it (None where it did not: a build by hand)."""
    try:
        from ._built_for import TORCH_VERSION
    except ImportError:
        return None
    return TORCH_VERSION


REBUILD = "pip install --no-build-isolation --force-reinstall --no-deps ."


def load() -> None:
    """Registers the circle::* operators (idempotent). A library compiled
    against another torch than the one running does not load (its C++
    symbols differ): the error then says which torch it was built for, which
    one runs, and how to rebuild."""
    if hasattr(torch.ops.circle, "loss"):
        return
    path = library_path()
    try:
        torch.ops.load_library(path)
    except OSError as error:
        built = built_for()
        if built is None or built == torch.__version__:
            raise
        raise ImportError(
            f"circle_loss: the operator library {path} was built for torch {built}, but torch "
            f"{torch.__version__} is running, and a C++ extension runs only with the torch it was "
            f"compiled against. Rebuild it against this torch: in the circle_loss source tree, "
            f"`{REBUILD}` (or `bash scripts/setup.sh`), or install torch {built} again. ({error})"
        ) from error
