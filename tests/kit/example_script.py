"""``examples/train_gpt.py`` loaded as a module, for tests that call its functions (flag checks, batches).

It is a script, not a package module: loaded from its path under a name of the caller's choosing (as a module
it installs no signal handler and starts no training).
"""

from __future__ import annotations

import importlib.util
from pathlib import Path
from types import ModuleType

ROOT = Path(__file__).resolve().parents[2]
TRAIN_GPT = ROOT / "examples" / "train_gpt.py"


def load_train_gpt(name: str = "train_gpt") -> ModuleType:
    """A fresh module of ``examples/train_gpt.py``, registered under no name (``name`` is only its ``__name__``)."""
    spec = importlib.util.spec_from_file_location(name, TRAIN_GPT)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module
