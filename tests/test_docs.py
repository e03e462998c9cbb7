"""The guide's pages read the same from any checkout, and README's first screen says what the project is."""

from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
CARD = ROOT / "conductor" / "policies" / "default"
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md")), CARD / "README.md", CARD / "HISTORY.md"]

# A path of the machine a page was written on: the checkouts and homes of the machines this project ran on, a
# temporary folder, a file:// URL of any absolute path. `~/.cache/conductor` ($CONDUCTOR_HOME's default), paths
# relative to the checkout (`examples/corpus`, `../shared/data`) and placeholders (`<checkout>/...`) are fine.
MACHINE_PATH = re.compile(r"(?<![\w.~-])/(?:work|root|tmp|home/[^/\s`]+|Users/[^/\s`]+)/|file:///")

WHAT_IT_IS_WITHIN = 40  # README's first screen: the lines a reader sees before scrolling


def test_no_page_holds_an_absolute_machine_path() -> None:
    """README, every docs/*.md and the default policy's card and history name paths relative to the checkout (or
    by a placeholder), never an absolute path of the machine they were written on."""
    found = [
        f"{page.relative_to(ROOT)}:{number}: {line.strip()[:100]}"
        for page in PAGES
        for number, line in enumerate(page.read_text(encoding="utf-8").splitlines(), start=1)
        if MACHINE_PATH.search(line)
    ]
    assert not found, "absolute machine paths:\n" + "\n".join(found)


def test_the_machine_path_rule_flags_machine_paths_and_passes_relative_ones() -> None:
    """The rule above catches what README once showed and lets the project's own spellings through."""
    flagged = ["<file:///work/main/examples/corpus/smollm2.html>", "source /work/venv/bin/activate",
               "/root/.cache/x", "/home/alice/conductor", "/tmp/run", "file:///etc/passwd"]  # fmt: skip
    passed = ["~/.cache/conductor/models", "<checkout>/examples/corpus/smollm2.html", "../shared/data",
              "runs/tmp/x", "http://127.0.0.1:8000/v1", "benchmarks/results/plates/v24/summary.json"]  # fmt: skip
    missed = [text for text in flagged if not MACHINE_PATH.search(text)]
    wrongly = [text for text in passed if MACHINE_PATH.search(text)]
    assert not missed and not wrongly, f"missed {missed}, flagged {wrongly}"


def test_readmes_first_screen_says_what_it_is() -> None:
    """README's "## What it is" heading is within its first 40 lines, so a newcomer reads what the project is
    before any output or figure."""
    lines = (ROOT / "README.md").read_text(encoding="utf-8").splitlines()
    assert "## What it is" in lines, "README has no '## What it is' heading"
    at = lines.index("## What it is") + 1
    assert at <= WHAT_IT_IS_WITHIN, f"'## What it is' is on line {at}, past line {WHAT_IT_IS_WITHIN}"


def test_readmes_documentation_table_links_every_page_of_docs() -> None:
    """Every docs/*.md page is linked from README's Documentation section (docs/plates.md once was not)."""
    readme = (ROOT / "README.md").read_text(encoding="utf-8")
    section = readme.split("## Documentation", 1)[1].split("\n## ", 1)[0]
    pages = sorted(page.name for page in (ROOT / "docs").glob("*.md"))
    missing = [name for name in pages if f"](docs/{name})" not in section]
    assert not missing, f"docs pages not in README's Documentation table: {missing}"
