"""What `pip install` gives: the version in one place, the console script, extras that install what they name,
the licence and the NOTICE in the wheel, the megatron-core range CI runs at both ends."""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
import zipfile
from importlib.metadata import metadata
from pathlib import Path

from packaging.requirements import Requirement
from packaging.version import Version

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


def test_the_wheel_carries_the_licence_and_the_notice(tmp_path):
    """``pip wheel`` from a copy of the sources: LICENSE (Apache-2.0, in full) and NOTICE in the .dist-info, the
    licence in the metadata."""
    source = tmp_path / "source"
    shutil.copytree(ROOT / "twinkle_megatron", source / "twinkle_megatron",
                    ignore=shutil.ignore_patterns("__pycache__"))
    for name in ("setup.py", "pyproject.toml", "README.md", "LICENSE", "NOTICE"):
        shutil.copy(ROOT / name, source / name)
    done = subprocess.run([sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "-q",
                           "-w", str(tmp_path / "dist"), str(source)], capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stdout + done.stderr
    (wheel,) = (tmp_path / "dist").glob("twinkle_megatron-*.whl")
    with zipfile.ZipFile(wheel) as archive:
        info = {Path(name).name: name for name in archive.namelist() if ".dist-info/" in name}
        licence, notice = (archive.read(info[name]).decode() for name in ("LICENSE", "NOTICE"))
        metadata = archive.read(info["METADATA"]).decode()
    assert licence == (ROOT / "LICENSE").read_text() and notice == (ROOT / "NOTICE").read_text()
    for part in ("Apache License", "Version 2.0, January 2004", "TERMS AND CONDITIONS FOR USE, REPRODUCTION, AND "
                 "DISTRIBUTION", "END OF TERMS AND CONDITIONS", "APPENDIX: How to apply the Apache License"):
        assert part in licence
    assert "modelscope/twinkle" in notice and "KempnerForge" in notice
    assert re.search(r"^License(-Expression)?: Apache-2\.0$", metadata, re.M), metadata[:2000]
    assert {"LICENSE", "NOTICE"} <= set(re.findall(r"^License-File: (?:.*/)?(\S+)$", metadata, re.M))


def test_ci_runs_both_ends_of_the_megatron_core_range_install_requires_allows():
    """``install_requires``, ``.ci/run`` and docs/versions.md agree: CI runs the oldest and the newest release
    the range allows, and the versions page reports both."""
    (line,) = [r for r in metadata("twinkle-megatron").get_all("Requires-Dist") if r.startswith("megatron-core")]
    allowed = Requirement(line).specifier
    matrix = re.findall(r"^(?:step )?make test MCORE=(\S+)(?:\s|$)", (ROOT / ".ci/run").read_text(), re.M)
    ran = sorted(Version(v) for v in matrix)
    oldest, newest = ran[0], ran[-1]
    assert oldest in allowed and Version(f"{oldest.major}.{oldest.minor - 1}") not in allowed, (line, oldest)
    assert newest in allowed and Version(f"{newest.major}.{newest.minor + 1}") not in allowed, (line, newest)
    page = (ROOT / "docs" / "versions.md").read_text()
    for version in (oldest, newest):
        row = next(row for row in page.splitlines() if row.startswith(f"| {version} "))
        assert "passed" in row and "failed" not in row, row
