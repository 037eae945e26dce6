"""Every ```python block of README.md and docs/*.md runs, as written, on CPU.

Pages are found when the tests are collected (a new ``docs/*.md`` page is tested without
being listed here). Each block runs in a fresh Python process (the venv's interpreter, a
temporary working directory, a time limit), so a block cannot lean on another block's
imports or state, nor on the test suite's. A block that continues the one before it on
the same page says so on the line above its fence::

    <!-- docs-test: continue -->
    ```python

and then runs in the same process, after the blocks it continues. Output, shell commands
and code that needs what is not on the package index (Megatron-LM's training code) go in
```text / ```bash / ```console blocks, which are not run.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from dataclasses import dataclass, field
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("**/*.md"))]
CONTINUE = "<!-- docs-test: continue -->"
TIME_LIMIT_S = 420  # a block trains a tiny model on CPU ranks; the 2-core CI machine is shared
FENCE = re.compile(r"^```python[ \t]*\n(.*?)^```[ \t]*$", re.M | re.S)

# Runs each block of a session in one namespace, compiled under "page:line" so that a traceback names the block.
DRIVER = """
import json, sys
namespace = {"__name__": "__main__"}
for where, code in json.load(sys.stdin):
    print(f"--- {where}", file=sys.stderr, flush=True)
    exec(compile(code, where, "exec"), namespace)
"""


@dataclass
class Session:
    """Blocks that run in one process: a block and the blocks that continue it."""

    page: str
    blocks: list[tuple[str, str]] = field(default_factory=list)  # ("page:line", code)

    @property
    def name(self) -> str:
        return self.blocks[0][0] + (f" (+{len(self.blocks) - 1} continued)" if len(self.blocks) > 1 else "")


def sessions(page: Path) -> list[Session]:
    """The ```python blocks of ``page``, grouped into sessions by ``docs-test: continue`` markers."""
    text = page.read_text()
    name = str(page.relative_to(ROOT))
    found: list[Session] = []
    for match in FENCE.finditer(text):
        line = text.count("\n", 0, match.start()) + 1
        before = text[:match.start()].rstrip("\n").rsplit("\n", 1)[-1].strip()
        if before == CONTINUE:
            if not found:
                raise ValueError(f"{name}:{line}: '{CONTINUE}' before the page's first python block")
            found[-1].blocks.append((f"{name}:{line}", match.group(1)))
        else:
            found.append(Session(name, [(f"{name}:{line}", match.group(1))]))
    return found


ALL = [session for page in PAGES for session in sessions(page)]


def test_the_pages_have_python_blocks_and_the_markers_are_read():
    assert any(session.page == "README.md" for session in ALL)
    assert len(ALL) >= 5


@pytest.mark.parametrize("session", ALL, ids=lambda session: session.name)
def test_the_python_block_runs(session, tmp_path):
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    try:
        done = subprocess.run([sys.executable, "-c", DRIVER], input=json.dumps(session.blocks), cwd=tmp_path,
                              env=env, capture_output=True, text=True, timeout=TIME_LIMIT_S)
    except subprocess.TimeoutExpired as error:
        pytest.fail(f"{session.name} ran past {TIME_LIMIT_S} s; stderr:\n{(error.stderr or b'')[-3000:]!r}")
    assert done.returncode == 0, f"{session.name} failed:\n{done.stdout[-2000:]}\n{done.stderr[-4000:]}"
