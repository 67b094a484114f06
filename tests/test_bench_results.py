"""A full benchmark run rewrites the start of ``bench/RESULTS.md`` and keeps the rest.

The sections that the ``--only store|acp|edit|first`` runs write (between their markers) and the
dated notes written by hand between them are no run's output: regenerating the main tables must
not erase them. (Nothing here is timed; the benchmarks themselves live in ``bench/``.)
"""

from __future__ import annotations

from pathlib import Path

from bench.report import write_markdown

OLD = """# Benchmark results

- date: 2000-01-01T00:00:00+00:00
- an old main table

<!-- store-bench:begin -->
## State store
| a store row |
<!-- store-bench:end -->

*A dated note written by hand after a section.* It says why a figure moved.

<!-- first-request-bench:begin -->
## First request after a spawn
| a first-request row |
<!-- first-request-bench:end -->
"""

RESULTS = {"date": "2026-12-03T13:00:00+00:00", "command": "python -m bench.run", "ratios": []}


def test_a_full_run_keeps_the_separate_sections_and_the_notes_between_them(tmp_path: Path) -> None:
    path = tmp_path / "RESULTS.md"
    path.write_text(OLD)

    write_markdown(RESULTS, path)
    text = path.read_text()

    assert text.startswith("# Benchmark results\n")
    assert "- date: 2026-12-03T13:00:00+00:00" in text
    assert "2000-01-01" not in text and "an old main table" not in text
    kept = OLD[OLD.index("<!-- store-bench:begin -->"):]
    assert text.endswith(kept), "everything from the first separate section on is kept as it was"
    assert text.count("*A dated note written by hand after a section.*") == 1
    assert text.index("## Targets") < text.index("<!-- store-bench:begin -->")


def test_a_second_full_run_does_not_repeat_what_it_keeps(tmp_path: Path) -> None:
    path = tmp_path / "RESULTS.md"
    path.write_text(OLD)

    write_markdown(RESULTS, path)
    once = path.read_text()
    write_markdown(RESULTS, path)

    assert path.read_text() == once


def test_without_an_earlier_file_a_full_run_writes_the_main_tables_alone(tmp_path: Path) -> None:
    path = tmp_path / "RESULTS.md"

    write_markdown(RESULTS, path)
    text = path.read_text()

    assert text.startswith("# Benchmark results\n")
    assert "-bench:begin -->" not in text
