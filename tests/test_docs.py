"""The project's text speaks of the software only, and its docs link only inside the repository.

A figure is identified by its date, commit and command; a feature by what it does. So no tracked text file (.py .md
.sh .toml .json under docs/, tools/, oracle/, fastpath/, tests/, scripts/, plus README.md and pyproject.toml) may
carry a word of how the work on it was organised: the sittings it was done in, the people or assistants who did it
and their working trees, machine visits, or issue numbers used as history markers (PROCESS below is the exact rule;
the planted phrases at the end of this file are what it must catch).

What stays legal, because it is a technical term and not a work-history word:
- pytest's session: `scope="session"`, `pytest_sessionstart`, a hook's `session` parameter (`(session, config,
  items)`, `session.config`), `start_new_session=` (subprocess), `requests.Session` / `ClientSession`;
- a helper function: "a @triton.jit helper", "comparison helpers", "the conv helpers were shared" — only the
  person-like forms are flagged (a helper's work / edits / working tree, "other helpers", "helpers were done");
- the verb visit: "drafts never visit the host", `def visit(v)` — only noun forms after a determiner or a machine
  name ("this visit", "a GPU visit", "the H200 visit") and "visit N" / "visits N" are flagged.

And no doc links outside the repository: no `../shared`, no `/work/shared`, no markdown link whose relative target
resolves outside the repository root, no http(s) link (but to a local server: 127.0.0.1, localhost).
"""
from __future__ import annotations

import re
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
DIRS = ("docs", "tools", "oracle", "fastpath", "tests", "scripts")
TOP_FILES = ("README.md", "pyproject.toml")
SUFFIXES = (".py", ".md", ".sh", ".toml", ".json")
SELF = Path(__file__).resolve()

# Technical uses of the words, removed from a line before the process rules look at it.
TECHNICAL = [re.compile(p) for p in (
    r"""scope\s*=\s*["']session["']""",          # pytest fixture scope
    r"\bpytest_session\w*",                        # pytest hooks
    r"\(\s*session\s*[,)]",                        # a hook's `session` parameter
    r"\bsession\.\w+",                             # its attributes (session.config, session.items)
    r"\b\w+\.Session\b",                           # requests.Session and the like
    r"\bin a (?:new |process )?session of its own\b",   # a POSIX process session (setsid, start_new_session)
    r"\bprocess session\b",
)]

_DET = r"(?:this|that|the|one|a|an|each|every|next|last|later|earlier|previous|first|closing|full|same|engine|gpu|h200|device)"
PROCESS = [(name, re.compile(p, re.IGNORECASE)) for name, p in (
    ("session", r"\bsessions?\b|\bsession's\b|\bsessions'"),
    ("helper (a person)", r"\bhelpers'|\bhelper's\s+(?:uncommitted|work|edits|working|own\s+test)"
                          r"|\b(?:other|another|two|three|several|speculative|megatron)\s+helpers?\b"
                          r"|\bhelpers?\s+(?:were|was)\s+done\b|\bhelpers?\s+added\b|\bhelper\s+provided\b"),
    ("the lead", r"\bthe\s+lead(?:'s)?\b"),
    ("visit", rf"\b{_DET}\s+visit(?:'s|s)?\b|\bvisit's\b|\bvisits?\s+\d"),
    ("issue number", r"\bissues?\s+\d+"),
    ("design brief", r"\bdesign\s+brief\b|\bDEVELOPERS\.md\b"),
)]


def process_words(text: str) -> list[tuple[int, str, str]]:
    """(line number, rule name, matched text) for every process word in `text`."""
    hits = []
    for n, line in enumerate(text.splitlines(), 1):
        for t in TECHNICAL:
            line = t.sub(" ", line)
        for name, rx in PROCESS:
            for m in rx.finditer(line):
                hits.append((n, name, m.group(0)))
    return hits


LINK = re.compile(r"\]\(([^)\s]+)\)")
OUTSIDE = re.compile(r"\.\./shared|/work/shared|https?://(?!(?:127\.0\.0\.1|localhost|0\.0\.0\.0|\[::1\])[:/\s`])")


def outside_links(path: Path, text: str) -> list[tuple[int, str]]:
    """(line number, target) for every link or path in a doc that points outside the repository."""
    bad = []
    for n, line in enumerate(text.splitlines(), 1):
        for m in OUTSIDE.finditer(line):
            bad.append((n, m.group(0)))
        for m in LINK.finditer(line):
            target = m.group(1).split("#")[0]
            if not target or re.match(r"^[a-z]+:", target):
                continue
            resolved = (path.parent / target).resolve()
            if ROOT not in resolved.parents and resolved != ROOT:
                bad.append((n, m.group(1)))
    return bad


def git_tracked(paths: tuple[str, ...], suffixes: tuple[str, ...], exclude: Path) -> list[Path]:
    """The files git tracks under `paths` whose names end with one of `suffixes`, `exclude` left out."""
    out = subprocess.run(["git", "ls-files", "-z", "--", *paths], cwd=ROOT, capture_output=True,
                         check=True).stdout.decode().split("\0")
    files = [ROOT / p for p in out if p and p.endswith(suffixes)]
    return [f for f in files if f.is_file() and f.resolve() != exclude]


def tracked_text_files() -> list[Path]:
    return git_tracked((*DIRS, *TOP_FILES), SUFFIXES, SELF)


def _git_available() -> bool:
    try:
        return subprocess.run(["git", "rev-parse", "--git-dir"], cwd=ROOT, capture_output=True).returncode == 0
    except OSError:
        return False


needs_git = pytest.mark.skipif(not _git_available(), reason="not a git checkout (tracked files unknown)")


@needs_git
def test_no_tracked_text_file_speaks_of_how_the_work_was_organised():
    files = tracked_text_files()
    assert len(files) > 50, files
    found = []
    for f in files:
        for n, name, word in process_words(f.read_text(encoding="utf-8", errors="replace")):
            found.append(f"{f.relative_to(ROOT)}:{n}: {name}: {word!r}")
    assert not found, "process words (name a figure by its date, commit and command):\n" + "\n".join(found)


@needs_git
def test_docs_link_only_inside_the_repository():
    docs = [f for f in tracked_text_files() if f.suffix == ".md"] + [ROOT / "README.md"]
    found = []
    for f in docs:
        for n, target in outside_links(f, f.read_text(encoding="utf-8")):
            found.append(f"{f.relative_to(ROOT)}:{n}: {target}")
    assert not found, "links outside the repository:\n" + "\n".join(found)


@pytest.mark.parametrize("phrase", [
    "Measured 2026-12-02 on this session's 2-core machine",
    "Session 11, 2026-12-02 ~21:40 UTC",
    "the blind runs of sessions 9–10",
    "(transcribed, session 10)",
    "tree bf4da00 + other helpers' uncommitted edits",
    "commit 9f86266 + the Megatron helper's uncommitted edits",
    "nothing uncommitted that mattered: helpers were done",
    "the speculative helper's work",
    "for the lead's GPU visit",
    "Not measured in this visit",
    "only bound the visit's time",
    "at the last visit (visit 8, ~14:28 UTC)",
    "Where a step is now (visits 8–11)",
    "the H200 visit of 2026-12-02 13:37 UTC",
    "prefix-cache hit with a prefill graph (issue 17.5 met)",
    "Issue 20.3: the main job's default run",
    "see the design brief",
])
def test_a_planted_process_phrase_is_caught(phrase):
    assert process_words(f"x = 1\n# {phrase}\n"), phrase


@pytest.mark.parametrize("text", [
    '@pytest.fixture(scope="session")',
    "@pytest.fixture(scope='session')",
    "def pytest_collection_modifyitems(session, config, items) -> None:",
    "    for item in session.items:",
    "proc = subprocess.Popen(cmd, start_new_session=True)",
    "One worker in a session of its own (a timeout ends its whole process group)",
    "s = requests.Session()",
    "def pytest_sessionstart(session):",
    "a call to a @triton.jit helper inside a kernel",
    "the helper's own patch scope is never restored",
    "after the conv helpers were shared (5ba444b)",
    "attention_decode's 3 helper launches per layer",
    "tests/ uses the harness's comparison helpers",
    '"""Verify steps whose drafts never visit the host before the forward."""',
    "    def visit(v):",
    "host ms and device ms per stage",
    "the issue's monotone-logit class",
])
def test_technical_uses_of_the_words_pass(text):
    assert process_words(text) == [], process_words(text)


def test_a_planted_outside_link_is_caught(tmp_path):
    doc = ROOT / "docs" / "x.md"
    assert outside_links(doc, "see `../shared/DESIGN.md`")
    assert outside_links(doc, "see [the design](../../shared/DESIGN.md)")
    assert outside_links(doc, "see https://example.org/x")
    assert not outside_links(doc, "`--base-url http://127.0.0.1:8080` or http://localhost:8000/v1")
    assert not outside_links(doc, "see [the design](design.md §4) and [the README](../README.md)")
