"""The documentation's key tables, read as the tests check them against the code's key lists."""

from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
# Where the tables may live: the README and the reference pages (docs/tracker.md, docs/moe.md...).
PAGES = (ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md")))


def key_table(name: str) -> list[str]:
    """The first column of the table between ``<!-- {name} keys -->`` and ``<!-- /{name} keys -->``.

    Exactly one page of the README and ``docs/`` holds it (two copies could disagree).
    """
    start, end = f"<!-- {name} keys -->", f"<!-- /{name} keys -->"
    holders = [page for page in PAGES if start in page.read_text()]
    assert len(holders) == 1, f"the {name} key table must be on exactly one page, found on {holders}"
    table = holders[0].read_text().split(start)[1].split(end)[0]
    return [match.group(1) for match in re.finditer(r"^\| `([^`]+)` \|", table, re.M)]
