"""The README's key tables, read as the tests check them against the code's key lists."""

from __future__ import annotations

import re
from pathlib import Path

README = Path(__file__).resolve().parents[2] / "README.md"


def key_table(name: str) -> list[str]:
    """The first column of the README table between ``<!-- {name} keys -->`` and ``<!-- /{name} keys -->``."""
    table = README.read_text().split(f"<!-- {name} keys -->")[1].split(f"<!-- /{name} keys -->")[0]
    return [match.group(1) for match in re.finditer(r"^\| `([^`]+)` \|", table, re.M)]
