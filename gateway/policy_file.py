"""YAML with positions: every value read from a policy file knows its FILE:LINE:COL.

The loader walks the document through ``Node`` objects. A ``Node`` never raises on a bad
value: it records an ``Issue`` (``policies/x.yaml:12:9: expected ...``) in the shared list
and returns ``None``, so one pass reports every error in the file, not just the first.
"""

from __future__ import annotations

import re
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ruamel.yaml import YAML
from ruamel.yaml.comments import CommentedMap, CommentedSeq
from ruamel.yaml.error import MarkedYAMLError, YAMLError


@dataclass(frozen=True)
class Issue:
    path: str
    line: int  # 1-based
    col: int  # 1-based
    message: str

    def __str__(self) -> str:
        return f"{self.path}:{self.line}:{self.col}: {self.message}"


class PolicyError(Exception):
    """Raised when a policy file cannot be loaded; ``issues`` lists every error found."""

    def __init__(self, issues: list[Issue]) -> None:
        self.issues = sorted(issues, key=lambda i: (i.path, i.line, i.col))
        super().__init__("\n".join(str(i) for i in self.issues))


_DURATION = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*(ms|s|m|h|d)?\s*$")
_DURATION_UNITS = {"ms": 0.001, "s": 1.0, "m": 60.0, "h": 3600.0, "d": 86400.0, None: 1.0}
_SIZE = re.compile(r"^\s*(\d+)\s*(B|KiB|MiB|GiB|KB|MB|GB)?\s*$")
_SIZE_UNITS = {
    None: 1,
    "B": 1,
    "KiB": 1024,
    "MiB": 1024**2,
    "GiB": 1024**3,
    "KB": 1000,
    "MB": 1000**2,
    "GB": 1000**3,
}


def parse_duration(text: str | int | float) -> float:
    """``"30s"``, ``"5m"``, ``"1h"``, ``"250ms"`` or a number of seconds -> seconds."""
    if isinstance(text, bool):
        raise ValueError("expected a duration such as 30s, 5m or 1h")
    if isinstance(text, int | float):
        value = float(text)
    else:
        m = _DURATION.match(text)
        if not m:
            raise ValueError(f"expected a duration such as 30s, 5m or 1h, got {text!r}")
        value = float(m.group(1)) * _DURATION_UNITS[m.group(2)]
    if value < 0:
        raise ValueError("a duration cannot be negative")
    return value


def parse_size(text: str | int) -> int:
    """``"64KiB"``, ``"1MiB"`` or a number of bytes -> bytes."""
    if isinstance(text, bool):
        raise ValueError("expected a size such as 64KiB or 1MiB")
    if isinstance(text, int):
        value = text
    else:
        m = _SIZE.match(text)
        if not m:
            raise ValueError(f"expected a size such as 64KiB or 1MiB, got {text!r}")
        value = int(m.group(1)) * _SIZE_UNITS[m.group(2)]
    if value < 0:
        raise ValueError("a size cannot be negative")
    return value


_TYPE_NAMES = {
    dict: "a mapping",
    list: "a list",
    str: "a string",
    int: "an integer",
    bool: "true or false",
    float: "a number",
}


def _type_name(value: Any) -> str:
    if value is None:
        return "nothing (null)"
    if isinstance(value, bool):
        return "true or false"
    for t, name in _TYPE_NAMES.items():
        if isinstance(value, t):
            return name
    return type(value).__name__


class Node:
    """One value of the document with its position and the shared list of issues."""

    __slots__ = ("value", "path", "line", "col", "where", "issues")

    def __init__(
        self, value: Any, path: str, line: int, col: int, where: str, issues: list[Issue]
    ) -> None:
        self.value = value
        self.path = path
        self.line = line
        self.col = col
        self.where = where
        self.issues = issues

    # -- reporting --------------------------------------------------------------------------

    def fail(self, message: str) -> None:
        """Record an error at this node's position."""
        self.issues.append(Issue(self.path, self.line, self.col, message))

    def _expect(self, what: str) -> None:
        self.fail(f"{self.where or 'the document'}: expected {what}, got {_type_name(self.value)}")

    # -- children ---------------------------------------------------------------------------

    def _child(self, key: Any, value: Any) -> Node:
        line, col = self.line, self.col
        container = self.value
        try:
            if isinstance(container, CommentedMap):
                pos = container.lc.value(key)
            elif isinstance(container, CommentedSeq):
                pos = container.lc.item(key)
            else:
                pos = None
            if pos is not None:
                line, col = pos[0] + 1, pos[1] + 1
        except (KeyError, IndexError, TypeError):
            pass
        where = f"{self.where}[{key}]" if isinstance(key, int) else f"{self.where}.{key}"
        return Node(value, self.path, line, col, where.lstrip("."), self.issues)

    def _key_node(self, key: Any) -> Node:
        line, col = self.line, self.col
        if isinstance(self.value, CommentedMap):
            try:
                pos = self.value.lc.key(key)
                line, col = pos[0] + 1, pos[1] + 1
            except (KeyError, TypeError):
                pass
        return Node(key, self.path, line, col, self.where, self.issues)

    # -- navigation (no checks, no issues: for tools that read a loaded file again) ----------

    def get(self, key: str) -> Node | None:
        """The child at ``key`` of a mapping, or None."""
        if isinstance(self.value, dict) and key in self.value:
            return self._child(key, self.value[key])
        return None

    def key_at(self, key: str) -> Node:
        """The node of a mapping's key itself (its position is the key's)."""
        return self._key_node(key)

    def items(self) -> list[tuple[str, Node]]:
        """A mapping's (string key, child) pairs; empty for anything else."""
        if not isinstance(self.value, dict):
            return []
        return [(k, self._child(k, v)) for k, v in self.value.items() if isinstance(k, str)]

    def elements(self) -> list[Node]:
        """A list's children; empty for anything else."""
        if not isinstance(self.value, list):
            return []
        return [self._child(i, v) for i, v in enumerate(self.value)]

    def as_map(
        self, required: tuple[str, ...] = (), optional: tuple[str, ...] = ()
    ) -> dict[str, Node] | None:
        """The mapping's children, checking required and unknown keys."""
        if not isinstance(self.value, dict):
            self._expect("a mapping")
            return None
        allowed = set(required) | set(optional)
        out: dict[str, Node] = {}
        for key, value in self.value.items():
            if not isinstance(key, str):
                self._key_node(key).fail(f"{self.where}: keys must be strings, got {key!r}")
                continue
            if allowed and key not in allowed:
                self._key_node(key).fail(
                    f"unknown key {key!r} in {self.where or 'the document'}; "
                    f"expected one of {sorted(allowed)}"
                )
                continue
            out[key] = self._child(key, value)
        for key in required:
            if key not in out and key in allowed and key not in self.value:
                self.fail(f"{self.where or 'the document'}: missing required key {key!r}")
        return out

    def entries(self) -> Iterator[tuple[Node, Node]]:
        """(key node, value node) for a mapping with free-form keys (names of things)."""
        if not isinstance(self.value, dict):
            self._expect("a mapping")
            return
        for key, value in self.value.items():
            key_node = self._key_node(key)
            if not isinstance(key, str):
                key_node.fail(f"{self.where}: names must be strings, got {key!r}")
                continue
            yield key_node, self._child(key, value)

    def as_list(self) -> list[Node] | None:
        if not isinstance(self.value, list):
            self._expect("a list")
            return None
        return [self._child(i, v) for i, v in enumerate(self.value)]

    # -- scalars ----------------------------------------------------------------------------

    def as_str(self, *, pattern: re.Pattern[str] | None = None, what: str = "") -> str | None:
        if not isinstance(self.value, str):
            self._expect(what or "a string")
            return None
        if pattern is not None and not pattern.fullmatch(self.value):
            self.fail(f"{self.where}: {self.value!r} is not {what or 'valid here'}")
            return None
        return self.value

    def as_choice(self, choices: tuple[str, ...]) -> str | None:
        if not isinstance(self.value, str) or self.value not in choices:
            self.fail(f"{self.where}: expected one of {list(choices)}, got {self.value!r}")
            return None
        return self.value

    def as_int(self, *, minimum: int | None = None, maximum: int | None = None) -> int | None:
        if isinstance(self.value, bool) or not isinstance(self.value, int):
            self._expect("an integer")
            return None
        if minimum is not None and self.value < minimum:
            self.fail(f"{self.where}: must be at least {minimum}, got {self.value}")
            return None
        if maximum is not None and self.value > maximum:
            self.fail(f"{self.where}: must be at most {maximum}, got {self.value}")
            return None
        return int(self.value)

    def as_bool(self) -> bool | None:
        if not isinstance(self.value, bool):
            self._expect("true or false")
            return None
        return self.value

    def as_str_list(self) -> list[str] | None:
        items = self.as_list()
        if items is None:
            return None
        out = [item.as_str() for item in items]
        if any(v is None for v in out):
            return None
        return [v for v in out if v is not None]

    def as_duration(self) -> float | None:
        try:
            return parse_duration(self.value)
        except (ValueError, TypeError) as exc:
            self.fail(f"{self.where}: {exc}")
            return None

    def as_size(self) -> int | None:
        try:
            return parse_size(self.value)
        except (ValueError, TypeError) as exc:
            self.fail(f"{self.where}: {exc}")
            return None

    def plain(self) -> Any:
        """The value as plain Python data (dicts, lists, scalars), e.g. for a JSON Schema."""
        return _plain(self.value)


def _plain(value: Any) -> Any:
    # ruamel returns subclasses (ScalarFloat, CommentedMap, ...): convert to the builtins.
    if isinstance(value, dict):
        return {str(k): _plain(v) for k, v in value.items()}
    if isinstance(value, list):
        return [_plain(v) for v in value]
    for builtin in (bool, int, float, str):
        if isinstance(value, builtin):
            return builtin(value)
    return value


MAX_POLICY_BYTES = 4 * 1024 * 1024


MAX_NESTING = 64


def _nesting(text: str) -> int:
    """An upper bound of the flow nesting ([ and { outside quotes are counted; block nesting
    is bounded by indentation within MAX_POLICY_BYTES): deep nesting is refused before the
    parser recurses into it."""
    depth = deepest = 0
    for char in text:
        if char in "[{":
            depth += 1
            deepest = max(deepest, depth)
        elif char in "]}":
            depth = max(depth - 1, 0)
    return deepest


def read_text(path: str | Path) -> str:
    """A policy file's text, read once; any failure is a ``PolicyError``."""
    name = str(path)
    try:
        raw = Path(path).read_bytes()
    except OSError as exc:
        raise PolicyError([Issue(name, 1, 1, f"cannot read file: {exc.strerror}")]) from exc
    if len(raw) > MAX_POLICY_BYTES:
        raise PolicyError([Issue(name, 1, 1, "file is larger than 4 MiB")])
    try:
        return raw.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise PolicyError([Issue(name, 1, 1, "file is not valid UTF-8")]) from exc


_DUPLICATE = re.compile(r'found duplicate key "(.*?)" with value')
_NOT_A_TOKEN = re.compile(r"found character '(.*?)' that cannot start any token")


def yaml_issue(name: str, exc: MarkedYAMLError) -> Issue:
    """A YAML syntax error as ``FILE:LINE:COL: YAML: <what is wrong, in plain words>``:
    indentation, tabs, unclosed quotes and brackets are explained, not quoted from the
    parser (whose words are kept only for the rare errors not recognised here)."""
    problem, context = str(exc.problem or ""), str(exc.context or "")
    mark = exc.problem_mark or exc.context_mark
    opened = exc.context_mark
    at = f" (started at line {opened.line + 1})" if opened is not None else ""
    text = _explain_yaml(problem, context, at)
    if "could not find expected ':'" in problem and opened is not None:
        mark = opened  # the line without its ':' is where the simple key started
    line = mark.line + 1 if mark else 1
    col = mark.column + 1 if mark else 1
    return Issue(name, line, col, f"YAML: {text}")


def _explain_yaml(problem: str, context: str, at: str) -> str:
    found = _NOT_A_TOKEN.search(problem)
    if found and found.group(1) == "\\t":
        return "a tab character: YAML indents with spaces only; replace the tab with spaces"
    if found:
        return f"{found.group(1)!r} cannot start a value: put the value in quotes"
    if "mapping values are not allowed" in problem:
        return (
            "a ':' where no 'key: value' can start: this line is probably indented deeper "
            "than the key above it (the keys of one mapping start in the same column), or a "
            "value containing ': ' needs quotes"
        )
    if "could not find expected ':'" in problem:
        return (
            "this line is neither 'key: value' nor a list item '- ...': add the ':' after the key"
        )
    if "block mapping" in context and "found '-'" in problem:
        return (
            f"a list item '- ' inside a mapping{at}: indent the list under its key, or make "
            "every entry of the list start with '- '"
        )
    if "block mapping" in context or "block collection" in context:
        return (
            f"this line's indentation does not match the block it belongs to{at}: the keys "
            "of one mapping, and the '- ' of one list's items, start in the same column"
        )
    if "flow mapping" in context:
        return f"a '{{' mapping{at} is not closed with '}}', or lacks a ',' between entries"
    if "flow sequence" in context:
        return f"a '[' list{at} is not closed with ']', or lacks a ',' between items"
    if "quoted scalar" in context:
        return f"a quoted string{at} is never closed: add the closing quote"
    duplicate = _DUPLICATE.search(problem)
    if duplicate:
        return (
            f'duplicate key "{duplicate.group(1)}": it appears twice in one mapping, and '
            "the second would silently replace the first"
        )
    return " ".join(p for p in (context, problem) if p)


def read_document(path: str | Path, text: str | None = None) -> Node:
    """Parse one YAML file into a root ``Node``; syntax errors become a ``PolicyError``."""
    name = str(path)
    if text is None:
        text = read_text(path)
    if _nesting(text) > MAX_NESTING:
        raise PolicyError([Issue(name, 1, 1, f"nested deeper than {MAX_NESTING} levels")])
    yaml = YAML(typ="rt")
    yaml.allow_duplicate_keys = False
    try:
        data = yaml.load(text)
    except MarkedYAMLError as exc:
        raise PolicyError([yaml_issue(name, exc)]) from exc
    except YAMLError as exc:
        raise PolicyError([Issue(name, 1, 1, f"YAML: {exc}")]) from exc
    except RecursionError as exc:  # a bound below caught most; the parser's own stack
        raise PolicyError([Issue(name, 1, 1, "YAML: nested too deeply")]) from exc
    issues: list[Issue] = []
    if data is None:
        raise PolicyError([Issue(name, 1, 1, "the file is empty")])
    return Node(data, name, 1, 1, "", issues)
