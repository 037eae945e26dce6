"""Every ```python block of README.md and docs/*.md runs, as written, on CPU.

Pages are found when the tests are collected (a new ``docs/*.md`` page is tested without
being listed here). Each block runs in a fresh Python process (the venv's interpreter, a
temporary working directory, a time limit), so a block cannot lean on another block's
imports or state, nor on the test suite's (the process is forked from a server that imported torch
and megatron-core once, kit/fork_server.py, so a block does not pay for those imports again). A block
that continues the one before it on the same page says so on the line above its fence::

    <!-- docs-test: continue -->
    ```python

and then runs in the same process, after the blocks it continues. A block that needs
several ranks says how many (``<!-- docs-test: ranks=2 -->``) and runs under ``torchrun
--standalone`` on CPU (gloo; its blocks read ``RANK``/``WORLD_SIZE`` as under any torchrun;
the blocks that continue it run on every rank too). Output, shell commands
and code that needs what is not on the package index (Megatron-LM's training code) go in
```text / ```bash / ```console blocks, which are not run.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
from dataclasses import dataclass, field
from pathlib import Path

import pytest
from kit.fork_server import run_python

ROOT = Path(__file__).resolve().parents[1]
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("**/*.md"))]
MARKER = re.compile(r"^<!-- docs-test: (.*) -->$")
TIME_LIMIT_S = 420  # a block trains a tiny model on CPU ranks; the 2-core CI machine is shared
FENCE = re.compile(r"^```python[ \t]*\n(.*?)^```[ \t]*$", re.M | re.S)

# Runs each block of a session in one namespace, compiled under "page:line" so that a traceback names the block.
DRIVER = """
import json, sys
namespace = {"__name__": "__main__"}
for where, code in json.load(open(sys.argv[1])):
    print(f"--- {where}", file=sys.stderr, flush=True)
    exec(compile(code, where, "exec"), namespace)
"""


@dataclass
class Session:
    """Blocks that run in one process: a block and the blocks that continue it."""

    page: str
    blocks: list[tuple[str, str]] = field(default_factory=list)  # ("page:line", code)
    ranks: int = 1

    @property
    def name(self) -> str:
        return self.blocks[0][0] + (f" (+{len(self.blocks) - 1} continued)" if len(self.blocks) > 1 else "")


def sessions(page: Path, root: Path = ROOT) -> list[Session]:
    """The ```python blocks of ``page``, grouped into sessions by ``docs-test:`` markers; named from ``root``."""
    text = page.read_text()
    name = str(page.relative_to(root))
    found: list[Session] = []
    for match in FENCE.finditer(text):
        line = text.count("\n", 0, match.start()) + 1
        where = f"{name}:{line}"
        marker = MARKER.match(text[:match.start()].rstrip("\n").rsplit("\n", 1)[-1].strip())
        options = marker.group(1).split() if marker else []
        unknown = [option for option in options if option != "continue" and not re.fullmatch(r"ranks=[1-9]\d*", option)]
        if unknown:
            raise ValueError(f"{where}: unknown docs-test option {unknown}; expected 'continue' or 'ranks=N'")
        if "continue" in options:
            if not found or len(options) > 1:
                raise ValueError(f"{where}: 'continue' needs a python block before it on the page, and no other option")
            found[-1].blocks.append((where, match.group(1)))
        else:
            ranks = int(options[0].split("=")[1]) if options else 1
            found.append(Session(name, [(where, match.group(1))], ranks))
    return found


ALL = [session for page in PAGES for session in sessions(page)]


def test_the_pages_have_python_blocks_and_the_markers_are_read(tmp_path):
    assert any(session.page == "README.md" for session in ALL)
    assert len(ALL) >= 5
    page = tmp_path / "docs" / "page.md"
    page.parent.mkdir()
    page.write_text("```python\na = 1\n```\n\n<!-- docs-test: continue -->\n```python\nassert a == 1\n```\n\n"
                    "<!-- docs-test: ranks=2 -->\n```python\nimport os\n```\n\n```text\nnot run\n```\n")
    found = sessions(page, root=tmp_path)
    page.write_text("<!-- docs-test: ranks=two -->\n```python\npass\n```\n")
    with pytest.raises(ValueError, match="unknown docs-test option"):
        sessions(page, root=tmp_path)
    assert [(s.name, s.ranks, [code for _, code in s.blocks]) for s in found] == [
        ("docs/page.md:1 (+1 continued)", 1, ["a = 1\n", "assert a == 1\n"]), ("docs/page.md:11", 2, ["import os\n"])]


@pytest.mark.parametrize("session", ALL, ids=lambda session: session.name)
def test_the_python_block_runs(session, tmp_path):
    env = {**os.environ, "PYTHONUNBUFFERED": "1", "OMP_NUM_THREADS": "1"}
    (tmp_path / "blocks.json").write_text(json.dumps(session.blocks))
    (tmp_path / "driver.py").write_text(DRIVER)
    launcher = [] if session.ranks == 1 else ["-m", "torch.distributed.run", "--standalone",
                                              f"--nproc-per-node={session.ranks}"]
    try:
        # A fresh interpreter for the block, forked from one that imported torch and megatron-core once
        # (kit/fork_server.py); torchrun's ranks are its own fresh processes.
        done = run_python([*launcher, "driver.py", "blocks.json"], cwd=tmp_path, env=env, timeout=TIME_LIMIT_S)
    except subprocess.TimeoutExpired as error:
        pytest.fail(f"{session.name} ran past {TIME_LIMIT_S} s; stderr:\n{(error.stderr or b'')[-3000:]!r}")
    assert done.returncode == 0, f"{session.name} failed:\n{done.stdout[-2000:]}\n{done.stderr[-4000:]}"


def test_the_readme_reaches_the_reference_pages_within_1500_words():
    """A newcomer reads the README in ten minutes: what and why, install, the commands, the quickstarts; the
    reference lives in docs/, linked early (words: whitespace-separated, code included)."""
    text = (ROOT / "README.md").read_text()
    before_first_link = text[:text.index("](docs/")]
    assert len(before_first_link.split()) < 1500
    assert len(text.split()) < 2000
    for section in ("## Install", "## The two commands", "## Quickstart: Megatron-LM's `pretrain()`",
                    "## Quickstart: your own megatron-core loop", "## Quickstart: Twinkle", "## Reference"):
        assert section in text, section
