"""Every link and citation into the docs resolves: a relative markdown link to an existing file and anchor, a cited
`docs/NAME.md` to a file, a cited section (`docs/X.md, "Title"`, `docs/X.md §n`, `DESIGN §n`, `docs/X.md, History`)
to a heading or bold label of that file. Moving text between pages must carry its citations along."""
from __future__ import annotations

import re
from pathlib import Path

from tests.test_docs import git_tracked, needs_git

ROOT = Path(__file__).resolve().parents[1]
DIRS = ("docs", "tools", "oracle", "fastpath", "tests", "scripts")
SUFFIXES = (".py", ".md", ".sh")
SELF = Path(__file__).resolve()

LINK = re.compile(r"\[[^\]\n]*\]\(([^)\s]+)\)")
CITE = re.compile(r"(docs/(?:journal/)?[\w.-]+\.md)"
                  r"(?:[,:]?\s*\(?\s*[\"“]([^\"”\n]{2,80})[\"”]|\s*§\s*(\d+)|[,\s]\s*\(?(History)\b)?")
DESIGN = re.compile(r"\bDESIGN\s*§\s*(\d+)")


def slug(heading: str) -> str:
    """GitHub's anchor of a heading: lower case, punctuation dropped, spaces to hyphens."""
    return re.sub(r"\s", "-", re.sub(r"[^\w\s-]", "", heading.strip().lower()))


def sections(path: Path) -> list[str]:
    """A doc's headings (without the #s) and its bold labels (`**Label**`), the two things a citation may name."""
    text = path.read_text(encoding="utf-8")
    heads = [re.sub(r"^#+\s*", "", line).strip() for line in text.splitlines() if re.match(r"#{1,6} ", line)]
    return heads + re.findall(r"\*\*(.+?)\*\*", text)


def broken_links(path: Path, text: str) -> list[str]:
    """'line: target (why)' for each relative markdown link in `text` whose file or anchor does not exist."""
    bad = []
    for m in LINK.finditer(text):
        target = m.group(1)
        if re.match(r"^[a-z]+:", target):
            continue
        file, _, anchor = target.partition("#")
        dest = (path.parent / file).resolve() if file else path
        line = text.count("\n", 0, m.start()) + 1
        if not dest.exists():
            bad.append(f"{line}: {target} (no such file)")
        elif anchor and dest.suffix == ".md" and anchor not in {slug(h) for h in sections(dest)}:
            bad.append(f"{line}: {target} (no heading with anchor #{anchor})")
    return bad


def broken_citations(text: str, root: Path = ROOT) -> list[str]:
    """'line: citation (why)' for each cited doc file or section of `text` that does not exist under `root`."""
    bad = []
    for m in CITE.finditer(text):
        path, title, number, history = m.groups()
        line = text.count("\n", 0, m.start()) + 1
        doc = root / path
        if not doc.is_file():
            bad.append(f"{line}: {path} (no such file)")
            continue
        names = sections(doc)
        if title and not any(title.lower() in n.lower() for n in names):
            bad.append(f"{line}: {path} \"{title}\" (no such heading or bold label)")
        if number and not any(re.match(rf"{number}\.\s", n) for n in names):
            bad.append(f"{line}: {path} §{number} (no such numbered section)")
        if history and "History" not in names:
            bad.append(f"{line}: {path}, History (no History heading)")
    design = sections(root / "docs" / "design.md")
    for m in DESIGN.finditer(text):
        if not any(re.match(rf"{m.group(1)}\.\s", n) for n in design):
            bad.append(f"{text.count(chr(10), 0, m.start()) + 1}: DESIGN §{m.group(1)} (no such section)")
    return bad


def tracked_files() -> list[Path]:
    return git_tracked((*DIRS, "README.md"), SUFFIXES, SELF)


@needs_git
def test_every_relative_markdown_link_in_the_docs_resolves():
    docs = [f for f in tracked_files() if f.suffix == ".md"]
    assert any(f.parent.name == "journal" for f in docs), "docs/journal/ pages are tracked"
    found = [f"{f.relative_to(ROOT)}:{b}" for f in docs for b in broken_links(f, f.read_text(encoding="utf-8"))]
    assert not found, "broken markdown links:\n" + "\n".join(found)


@needs_git
def test_every_cited_doc_file_and_section_exists():
    found = [f"{f.relative_to(ROOT)}:{b}" for f in tracked_files()
             for b in broken_citations(f.read_text(encoding="utf-8", errors="replace"))]
    assert not found, "citations of missing docs or sections:\n" + "\n".join(found)


def test_a_planted_broken_link_and_citations_are_caught(tmp_path):
    (tmp_path / "docs").mkdir()
    (tmp_path / "docs" / "design.md").write_text("# d\n\n## 1. Shape\n")
    (tmp_path / "docs" / "a.md").write_text("# A\n\n## Current figures\n\n**Launch rules** hold.\n")
    page = tmp_path / "docs" / "b.md"
    page.write_text("[ok](a.md#current-figures) [gone](c.md) [anchor](a.md#history)\n")
    assert [b.split(" (")[0] for b in broken_links(page, page.read_text())] == ["1: c.md", "1: a.md#history"]
    text = ('docs/a.md, "Current figures" docs/a.md ("Launch rules") DESIGN §1\n'
            'docs/a.md, "Lost section" docs/c.md docs/design.md §7 DESIGN §9 docs/a.md, History\n')
    assert broken_citations(text, tmp_path) == [
        '2: docs/a.md "Lost section" (no such heading or bold label)', "2: docs/c.md (no such file)",
        "2: docs/design.md §7 (no such numbered section)", "2: docs/a.md, History (no History heading)",
        "2: DESIGN §9 (no such section)"]
