"""The README is for users: the two set-up commands first and one screen's worth of the rest,
and no text in the repository points at a tracker that is not in it (`#12`-style references)."""

from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
TEXT_DIRS = ("docs", "services", "common", "tandem", "api", "stack", "bench", "tests",
             "scripts", "examples", "deploy")
TEXT_SUFFIXES = {".py", ".md", ".sh", ".yaml", ".yml", ".toml", ".c", ".txt"}
ISSUE_REF = re.compile(r"(?<![\w&/])#[0-9]{1,3}\b")


def test_readme_starts_with_the_two_commands_and_stays_short():
    lines = (ROOT / "README.md").read_text().splitlines()
    assert len(lines) <= 150, f"README.md has {len(lines)} lines (at most 150)"
    block = lines[lines.index("```bash") + 1:]
    commands = block[:block.index("```")]
    assert [c.split()[0] for c in commands] == ["scripts/up.sh", "scripts/test.sh"]
    assert lines.index("```bash") < 5


def text_files():
    yield ROOT / "README.md"
    for d in TEXT_DIRS:
        for p in (ROOT / d).rglob("*"):
            if p.suffix in TEXT_SUFFIXES and p.is_file() and ".venv" not in p.parts:
                yield p


def test_no_issue_references():
    found = [f"{p.relative_to(ROOT)}:{n}: {line.strip()}"
             for p in text_files()
             for n, line in enumerate(p.read_text(errors="replace").splitlines(), 1)
             if ISSUE_REF.search(line) and p.name != "test_docs.py"]
    assert not found, "issue references:\n" + "\n".join(found[:20])
