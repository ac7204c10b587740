"""docs/promises.md cannot rot: every row's quote is still in the file it names, at the line
it gives, and every test it names is a test function of that file.

``python -m tests.test_promises_index --fix`` rewrites the line numbers after an edit moved
them (nothing else: a quote that is gone, or a test that is gone, still fails).
"""

from __future__ import annotations

import ast
import re
import sys
from dataclasses import dataclass
from functools import cache

import pytest

from tests.conftest import ROOT

INDEX = ROOT / "docs" / "promises.md"
ROW = re.compile(r'^\| (\d+) \| "(.*)" \| ([\w./-]+):(\d+) \| (.*?) \| (.*) \|$')
NODE = re.compile(r"`(tests/[\w/]+\.py)::(test_\w+)`")


@dataclass(frozen=True)
class Row:
    number: int
    quote: str
    file: str
    line: int
    nodes: tuple[tuple[str, str], ...]
    text: str  # the row as written


def _unescape(cell: str) -> str:
    return cell.replace("\\|", "|")


def rows(text: str | None = None) -> list[Row]:
    found = []
    for raw in (INDEX.read_text() if text is None else text).splitlines():
        if not raw.startswith("| ") or raw.startswith(("| # ", "|---")):
            continue
        m = ROW.match(raw)
        assert m, f"docs/promises.md: a row that does not parse: {raw[:120]}"
        number, quote, file, line, guards, _ = m.groups()
        nodes = tuple(NODE.findall(guards))
        assert len(nodes) == guards.count("`") // 2, f"row {number}: a guard is not a node id"
        found.append(Row(int(number), _unescape(quote), file, int(line), nodes, raw))
    return found


@cache
def functions_in(path: str) -> frozenset[str]:
    """The test functions pytest collects from ``path`` (module level, as every test file of
    this repository writes them)."""
    tree = ast.parse((ROOT / path).read_text())
    return frozenset(
        node.name
        for node in tree.body
        if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef)
        and node.name.startswith("test_")
    )


def _normalised(text: str) -> str:
    return re.sub(r"\s+", " ", text).strip()


@cache
def _lines_by_offset(path: str) -> tuple[str, tuple[int, ...]]:
    """The file's text with runs of white space made one space, and the line of each
    character of it."""
    chars: list[str] = []
    owners: list[int] = []
    space = False
    for number, line in enumerate((ROOT / path).read_text().splitlines(), 1):
        for ch in line + "\n":
            if ch.isspace():
                if space:
                    continue
                ch, space = " ", True
            else:
                space = False
            chars.append(ch)
            owners.append(number)
    return "".join(chars), tuple(owners)


def where(file: str, quote: str) -> int | None:
    """The line on which ``quote`` starts in ``file`` (white space compared loosely)."""
    text, owners = _lines_by_offset(file)
    at = text.find(_normalised(quote))
    return None if at < 0 else owners[at]


def test_the_index_has_rows_numbered_in_order() -> None:
    found = rows()
    assert len(found) >= 200
    assert [r.number for r in found] == list(range(1, len(found) + 1))
    assert all(r.nodes for r in found), [r.number for r in found if not r.nodes]


@pytest.mark.parametrize("row", rows(), ids=lambda r: f"row-{r.number}")
def test_each_promise_is_where_the_index_says_and_its_tests_exist(row: Row) -> None:
    assert (ROOT / row.file).is_file(), f"row {row.number}: no file {row.file}"
    line = where(row.file, row.quote)
    assert line is not None, (
        f"row {row.number}: the promise is no longer in {row.file}: {row.quote[:80]!r}; "
        "if it was reworded, quote it again; if it was dropped, remove the row (and say why)"
    )
    assert line == row.line, (
        f"row {row.number}: {row.file}:{row.line} should be {row.file}:{line} "
        "(python -m tests.test_promises_index --fix)"
    )
    for path, name in row.nodes:
        assert (ROOT / path).is_file(), f"row {row.number}: no test file {path}"
        assert name in functions_in(path), f"row {row.number}: {path}::{name} is gone"


def test_the_index_notices_a_test_that_is_gone_and_a_promise_that_moved() -> None:
    """The checks above fail on what they should (a guard of the index itself)."""
    [first, *_] = rows()
    gone = first.text.replace(first.nodes[0][1], "test_that_was_never_written")
    [row] = rows(gone)
    assert row.nodes[0][1] not in functions_in(row.nodes[0][0])
    moved = first.text.replace(f"{first.file}:{first.line} ", f"{first.file}:{first.line + 1} ")
    [row] = rows(moved)
    assert where(row.file, row.quote) != row.line


def fix() -> int:
    """Rewrite the line numbers of rows whose quote moved; the number of rows changed."""
    text = INDEX.read_text()
    changed = 0
    for row in rows(text):
        line = where(row.file, row.quote)
        if line is None or line == row.line:
            continue
        new = row.text.replace(f" {row.file}:{row.line} |", f" {row.file}:{line} |", 1)
        text = text.replace(row.text, new, 1)
        changed += 1
    INDEX.write_text(text)
    return changed


if __name__ == "__main__":
    if sys.argv[1:] != ["--fix"]:
        sys.exit("usage: python -m tests.test_promises_index --fix")
    print(f"docs/promises.md: {fix()} line number(s) rewritten")
