"""The design pages stay readable and every reference to them resolves.

* No page of ``docs/design`` is longer than :data:`MAX_LINES` lines: a longer one is split by topic (the vLLM
  plugin's pages are one per sub-package; ``docs/design/README.md`` lists them).
* Every design page the repository names -- ``docs/design/NAME.md``, or a bare ``NAME.md`` with a lower-case
  name (``moonep.md §4``, ``vllm_store.md``; upper-case names such as ``README.md`` are other files) -- in
  ``src/``, ``tests/``, ``scripts/``, ``checks/``, ``docs/``, ``README.md`` or the ``Makefile`` exists.
* Where such a reference names a section in quotes right after the page (``vllm_observe.md, "Near-ties,
  explained"``), the page holds that text: a section that moved to another page fails here.

Each check is a function over text, so the controls below show it failing on a planted page or reference
(this file, whose controls plant them, is not scanned).
"""

from __future__ import annotations

import pathlib
import re

HERE = pathlib.Path(__file__).resolve()
ROOT = HERE.parents[2]
DESIGN = ROOT / "docs" / "design"
MAX_LINES = 500
#: where references to the design pages are looked for
SOURCES = ("src", "tests", "scripts", "checks", "docs", "README.md", "Makefile")
SUFFIXES = {".py", ".md", ".sh", ".toml", ".cfg", ".txt", ""}
#: ``docs/design/NAME.md`` or a bare lower-case ``NAME.md``, then an optional quoted section name right after
#: it (a backtick, ``'s``, a comma or a parenthesis between them).
REFERENCE = re.compile(r"(?<![\w/.-])(?:docs/design/)?([a-z][a-z0-9_]*\.md)\b"
                       r"(?:`?(?:'s)?,?\s*\(?\s*\"([^\"]{3,80})\")?")


def long_pages(folder: pathlib.Path, limit: int = MAX_LINES) -> dict[str, int]:
    """``{page: lines}`` of every ``*.md`` in ``folder`` longer than ``limit`` lines."""
    counts = {p.name: len(p.read_text().splitlines()) for p in sorted(folder.glob("*.md"))}
    return {name: n for name, n in counts.items() if n > limit}


def flatten(text: str) -> str:
    """One line: comment markers at line starts dropped, every run of whitespace one space (a quoted section
    name may be wrapped across lines of a paragraph or a ``#:`` comment)."""
    return " ".join(re.sub(r"^\s*#:?", " ", text, flags=re.M).split())


def references(text: str) -> list[tuple[str, str | None]]:
    """``(page, quoted section or None)`` of every design-page reference in ``text``."""
    return [(m.group(1), m.group(2)) for m in REFERENCE.finditer(flatten(text))]


def broken_references(files: dict[str, str], pages: dict[str, str]) -> list[str]:
    """``files``: path -> text to scan; ``pages``: design page name -> its text. Every reference to a page that
    does not exist, or to a quoted section its page does not hold."""
    flat_pages = {name: flatten(text) for name, text in pages.items()}
    broken = []
    for path, text in files.items():
        for page, section in references(text):
            if page not in flat_pages:
                broken.append(f"{path}: docs/design/{page} does not exist")
            elif section is not None and section not in flat_pages[page]:
                broken.append(f"{path}: {page} has no section {section!r}")
    return broken


def repository_files() -> dict[str, str]:
    out = {}
    for name in SOURCES:
        top = ROOT / name
        paths = [top] if top.is_file() else sorted(top.rglob("*")) if top.is_dir() else []
        for path in paths:
            if (path.is_file() and path.suffix in SUFFIXES and "__pycache__" not in path.parts and path != HERE
                    and not any(part.endswith(".egg-info") for part in path.parts)):
                try:
                    out[str(path.relative_to(ROOT))] = path.read_text()
                except UnicodeDecodeError:
                    continue
    return out


def design_pages() -> dict[str, str]:
    return {p.name: p.read_text() for p in DESIGN.glob("*.md")}


def test_no_design_page_is_longer_than_the_limit():
    assert long_pages(DESIGN) == {}, f"split these pages by topic (at most {MAX_LINES} lines each)"


def test_every_design_page_named_in_the_repository_exists_with_its_sections():
    assert broken_references(repository_files(), design_pages()) == []


def test_the_design_index_lists_every_page():
    index = (DESIGN / "README.md").read_text()
    listed = {page for page, _ in references(index)}
    assert sorted(set(design_pages()) - {"README.md"} - listed) == [], "docs/design/README.md misses these pages"


def test_control_a_long_page_is_reported(tmp_path):
    """Control: a page one line over the limit is reported, one at the limit is not."""
    (tmp_path / "short.md").write_text("x\n" * MAX_LINES)
    (tmp_path / "long.md").write_text("x\n" * (MAX_LINES + 1))
    assert long_pages(tmp_path) == {"long.md": MAX_LINES + 1}


def test_control_a_missing_page_or_section_is_reported():
    """Control: a reference to a page that does not exist, or to a section its page lost, is reported; the
    same references to a page that holds the section (wrapped across lines, or in a ``#:`` comment) are not."""
    pages = {"vllm.md": "# Overview\n\n## Kimi K3: what runs where\n", "vllm_store.md": "### Weight passes\n"}
    good = {"a.py": '#: see docs/design/vllm.md, "Kimi K3: what\n#: runs where"\n',
            "b.md": 'the store (see `vllm_store.md`, "Weight passes"); moonep-free text: README.md, tests/README.md\n'}
    assert broken_references(good, pages) == []
    bad = {"c.py": '"""docs/design/vllm_oracle.md, and vllm.md ("Near-ties, explained")."""\n',
           "d.md": 'see `vllm_store.md`, "In-place weight updates"\n'}
    assert broken_references(bad, pages) == [
        "c.py: docs/design/vllm_oracle.md does not exist",
        "c.py: vllm.md has no section 'Near-ties, explained'",
        "d.md: vllm_store.md has no section 'In-place weight updates'",
    ]
