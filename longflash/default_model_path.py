"""Where the embedded default model lives (inside the installed package)."""

from __future__ import annotations

import os


def default_model_path() -> str:
    """Path of the shipped default model directory (``longflash/default_model``).

    Raises FileNotFoundError if the package was installed without it.
    """
    path = os.path.join(os.path.dirname(os.path.abspath(__file__)), "default_model")
    if not os.path.isfile(os.path.join(path, "config.json")):
        raise FileNotFoundError(f"the embedded default model is missing at {path}; pass --model PATH")
    return path


def is_default_model(path: str) -> bool:
    """True when ``path`` is the embedded default model's directory."""
    here = os.path.join(os.path.dirname(os.path.abspath(__file__)), "default_model")
    return os.path.realpath(path) == os.path.realpath(here)
