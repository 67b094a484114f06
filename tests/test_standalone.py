"""The repository stands alone: no file in it refers to a document that lives outside it.

The protocol is described in docs/PROTOCOL.md and the operate pipeline in docs/PIPELINE.md; a
comment, docstring, --help text or README that cites another copy of the protocol, a design
record, a tracker issue or a sibling folder points a user who cloned the repository at nothing.
Every file git knows (tracked or new, not ignored) is scanned.
"""

from __future__ import annotations

import re
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
SELF = Path(__file__).resolve().relative_to(ROOT).as_posix()

# (what is wrong, pattern). Each names a reference to something a clone does not contain.
FORBIDDEN: list[tuple[str, re.Pattern[str]]] = [
    ("a sibling folder outside the repository", re.compile(r"\.\./shared\b|/work/shared\b")),
    ("a design record by number", re.compile(r"\bADR-?\d+")),
    ("a design record ('the ADR')", re.compile(r"\b[Tt]he ADR\b|\bADR\b")),
    ("a protocol document other than docs/PROTOCOL.md", re.compile(r"(?<![\w/.-])PROTOCOL(?:\.md)?\s*§")),
    ("the design notes", re.compile(r"\bDESIGN\.md\b|\bDESIGN \"|reference-behaviou?r")),
    ("a tracker issue", re.compile(r"\b[Ii]ssue[ #-]?#?\d+\b")),
    ("another implementation ('the reference')", re.compile(r"\b[Tt]he reference(?!s\b)(?!\s+(?:count|to)\b)")),
]
PROTOCOL_MD = re.compile(r"([\w./-]*)PROTOCOL\.md")
TEXT_SUFFIXES = {".py", ".md", ".lua", ".ts", ".mjs", ".js", ".json", ".toml", ".txt", ".sh", ".cfg", ".ini",
                 ".yml", ".yaml", ".vim", ".jsonl", ""}
SKIP_PREFIXES = ("bench/out/", "bench/.venvs/")


def repo_files() -> list[str]:
    out = subprocess.run(["git", "ls-files", "-z", "--cached", "--others", "--exclude-standard"], cwd=ROOT,
                         capture_output=True, check=True, timeout=60).stdout.decode()
    return sorted({f for f in out.split("\0") if f and (ROOT / f).is_file()})


def protocol_md_ok(path: str, prefix: str) -> bool:
    """``PROTOCOL.md`` is fine when it means docs/PROTOCOL.md: ``docs/PROTOCOL.md`` itself or a relative path
    from the citing file that resolves to it."""
    if prefix.endswith("docs/") and (prefix == "docs/" or (ROOT / Path(path).parent / prefix / "PROTOCOL.md")
                                     .resolve() == (ROOT / "docs" / "PROTOCOL.md")):
        return True
    return (ROOT / Path(path).parent / f"{prefix}PROTOCOL.md").resolve() == (ROOT / "docs" / "PROTOCOL.md")


def offences(path: str, text: str) -> list[str]:
    found = []
    for n, line in enumerate(text.splitlines(), 1):
        for what, pattern in FORBIDDEN:
            if pattern.search(line):
                found.append(f"{path}:{n}: {what}: {line.strip()[:160]}")
        for m in PROTOCOL_MD.finditer(line):
            if not protocol_md_ok(path, m.group(1)):
                found.append(f"{path}:{n}: a PROTOCOL.md other than docs/PROTOCOL.md: {line.strip()[:160]}")
    return found


def test_no_file_refers_to_a_document_outside_the_repository():
    files = [f for f in repo_files() if f != SELF and not f.startswith(SKIP_PREFIXES)
             and Path(f).suffix in TEXT_SUFFIXES and "node_modules/" not in f]
    assert len(files) > 100, f"git ls-files found only {len(files)} files"
    bad = []
    for f in files:
        try:
            text = (ROOT / f).read_text(encoding="utf-8")
        except UnicodeDecodeError:
            continue
        bad += offences(f, text)
    assert not bad, ("references to documents outside the repository (point them at docs/PROTOCOL.md or "
                     "docs/PIPELINE.md, or say it in the project's words):\n" + "\n".join(bad))


def test_the_documents_it_points_to_exist():
    for doc in ("docs/PROTOCOL.md", "docs/PIPELINE.md", "protocol/schema.json"):
        assert (ROOT / doc).is_file(), doc
    protocol = (ROOT / "docs" / "PROTOCOL.md").read_text(encoding="utf-8")
    for section in range(1, 14):
        assert re.search(rf"^## {section}\. ", protocol, re.MULTILINE), f"docs/PROTOCOL.md has no section {section}"
    pipeline = (ROOT / "docs" / "PIPELINE.md").read_text(encoding="utf-8")
    for step in ("D1", "D2", "D3", "D4"):
        assert re.search(rf"^## {step}: ", pipeline, re.MULTILINE), f"docs/PIPELINE.md has no step {step}"


@pytest.mark.parametrize("line, bad", [
    ("see ../" + "shared/PROTOCOL.md", True),  # split: the scanner must not find this line itself
    ("(ADR-0022 D1)", True),
    ("the ADR's seams", True),
    ("PROTOCOL §5", True),
    ("PROTOCOL.md §2", True),
    ("issue 5 §4", True),
    ("as the reference does", True),
    ("the reference's name", True),
    ("see DESIGN.md", True),
    ('(PROTOCOL §1, DESIGN "stdio hardening")', True),
    ("docs/PROTOCOL.md §5", False),
    ("the pipeline's step D3 (docs/PIPELINE.md)", False),
    ("Expand the references of a prompt", False),
    ("lionagi 0.36.0 (benchmark peer)", False),
])
def test_the_scanner_flags_outside_references_and_nothing_else(line, bad):
    assert bool(offences("server/x.py", line)) is bad, offences("server/x.py", line)


def test_relative_links_to_docs_protocol_are_allowed():
    assert not offences("clients/typescript/README.md", "[the protocol](../../docs/PROTOCOL.md)")
    assert not offences("docs/PIPELINE.md", "[`docs/PROTOCOL.md`](PROTOCOL.md)")
    assert offences("clients/typescript/README.md", "[the protocol](../PROTOCOL.md)")


TEST_REF = re.compile(r"\b(tests/[\w/]+\.py)::(\w+)")


def test_every_test_the_docs_name_exists():
    """A document that names a test (``tests/x.py::test_y``) as the evidence for what it says
    points at a test that is there: one renamed since leaves the reader with nothing to run
    (docs/SECURITY.md named a code-cache test by its old name)."""
    docs = [f for f in repo_files() if f.endswith(".md") and not f.startswith(SKIP_PREFIXES)]
    missing, seen = [], 0
    for doc in docs:
        for path, name in TEST_REF.findall((ROOT / doc).read_text(encoding="utf-8", errors="replace")):
            seen += 1
            target = ROOT / path
            if not target.is_file() or not re.search(rf"^\s*(?:async\s+)?def {name}\b|^class {name}\b",
                                                      target.read_text(encoding="utf-8"), re.M):
                missing.append(f"{doc}: {path}::{name}")
    assert seen > 20, seen  # (the pattern still finds the docs' references)
    assert not missing, missing
