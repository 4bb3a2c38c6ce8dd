"""README.md and benchmarks/NOTES.md: every relative link (result files, pictures, sources)
points at a file of the checkout."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
LINK = re.compile(r"\]\(([^)\s]+)\)")


@pytest.mark.parametrize("doc", ["README.md", "benchmarks/NOTES.md"])
def test_relative_links_resolve(doc):
    path = ROOT / doc
    targets = [t.split("#")[0] for t in LINK.findall(path.read_text()) if not t.startswith(("http://", "https://"))]
    assert targets, f"{doc} links to nothing"
    missing = sorted({t for t in targets if t and not (path.parent / t).exists()})
    assert not missing, f"{doc} links to files that do not exist: {missing}"
