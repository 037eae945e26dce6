"""What `pip install` gives: the version in one place, the console script, extras that install what they name."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from importlib.metadata import metadata
from pathlib import Path

import twinkle_megatron

ROOT = Path(__file__).resolve().parents[1]


def test_the_te_extra_installs_transformer_engine_with_its_pytorch_bindings():
    """A bare ``transformer-engine`` has no PyTorch bindings: ``import transformer_engine.pytorch`` fails."""
    setup = (ROOT / "setup.py").read_text()
    assert '"te": ["transformer-engine[pytorch]"]' in setup
    requires = metadata("twinkle-megatron").get_all("Requires-Dist") or []
    te = [line for line in requires if 'extra == "te"' in line]
    assert te and all(re.match(r"transformer-engine\[pytorch\]", line) for line in te), te


def test_one_version_everywhere():
    assert metadata("twinkle-megatron")["Version"] == twinkle_megatron.__version__
    script = os.path.join(os.path.dirname(sys.executable), "twinkle-megatron")
    done = subprocess.run([script, "--version"], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0 and done.stdout.strip() == f"twinkle-megatron {twinkle_megatron.__version__}"
