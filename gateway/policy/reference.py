"""The policy file's schema as published files: ``docs/policy.schema.json`` (for editors:
yaml-language-server, IDE plugins) and ``docs/policy-reference.md`` (every key, for people).

Both are made from ``spec.policy_schema()``, itself made from the tables the loader reads,
so none of the three can drift from the others; the test suite checks that the committed
files equal what this module makes (regenerate with ``capgate policy schema -o
docs/policy.schema.json``, ``capgate policy schema --markdown -o docs/policy-reference.md`` and
``capgate policy schema --tests -o docs/policy-tests.schema.json`` for test files, whose
schema ``commands/policy_tests.py`` makes).
"""

from __future__ import annotations

import json
from typing import Any

from gateway.policy.spec import policy_schema

SCHEMA_FILE = "docs/policy.schema.json"
REFERENCE_FILE = "docs/policy-reference.md"


def schema_text() -> str:
    """The schema as the committed JSON file: 2-space indents, keys in declaration order."""
    return json.dumps(policy_schema(), indent=2, ensure_ascii=False) + "\n"


def _type(schema: dict[str, Any]) -> str:
    """A short human description of a value's form: ``string``, ``one of: a, b``..."""
    if "const" in schema:
        return f"`{json.dumps(schema['const'])}`"
    if "enum" in schema:
        return "one of: " + ", ".join(f"`{v}`" for v in schema["enum"])
    if "anyOf" in schema:
        return " or ".join(_type(s) for s in schema["anyOf"])
    kind = schema.get("type")
    if isinstance(kind, list):
        return " or ".join(kind)
    if kind == "array":
        items = schema.get("items") or {}
        return f"list of {_type(items)}" if items else "list"
    if kind == "object":
        extra = schema.get("additionalProperties")
        if isinstance(extra, dict) and "properties" not in schema:
            return f"mapping of name to {_type(extra)}"
        return "mapping"
    text = str(kind) if kind else "any value"
    if "pattern" in schema:
        text += f" matching `{schema['pattern']}`"
    return text


def _bounds(schema: dict[str, Any]) -> str:
    parts = []
    for key, word in (("minimum", "at least"), ("maximum", "at most")):
        if key in schema:
            parts.append(f"{word} {schema[key]}")
    return f" ({', '.join(parts)})" if parts else ""


def _children(schema: dict[str, Any]) -> list[tuple[str, dict[str, Any]]]:
    """The object schemas nested in a value's schema, with the path suffix to reach them."""
    out: list[tuple[str, dict[str, Any]]] = []
    if "properties" in schema:
        out.append(("", schema))
        return out
    for alt in schema.get("anyOf", []):
        out.extend(_children(alt))
    if schema.get("type") == "array" and isinstance(schema.get("items"), dict):
        out.extend((f"[]{sub}", s) for sub, s in _children(schema["items"]))
    extra = schema.get("additionalProperties")
    if isinstance(extra, dict):
        out.extend((f".<name>{sub}", s) for sub, s in _children(extra))
    return out


def _section(path: str, schema: dict[str, Any], out: list[str], seen: dict[str, str]) -> None:
    if path in seen.values():
        return
    out.append(f"## `{path}`")
    out.append("")
    canonical = json.dumps(schema, sort_keys=True)
    if canonical in seen:
        out.append(f"The same keys as `{seen[canonical]}`.")
        out.append("")
        return
    seen[canonical] = path
    if schema.get("description"):
        out.append(str(schema["description"]))
        out.append("")
    required = set(schema.get("required", []))
    out.append("| key | value | required | description |")
    out.append("|---|---|---|---|")
    nested: list[tuple[str, dict[str, Any]]] = []
    for name, prop in schema["properties"].items():
        description = str(prop.get("description", "")).replace("|", "\\|").replace("\n", " ")
        value = (_type(prop) + _bounds(prop)).replace("|", "\\|")
        mark = "yes" if name in required else ""
        out.append(f"| `{name}` | {value} | {mark} | {description} |")
        base = f"{path}.{name}" if path != "(file)" else name
        nested.extend((base + sub, child) for sub, child in _children(prop))
    out.append("")
    for child_path, child in nested:
        _section(child_path, child, out, seen)


def reference_markdown() -> str:
    """Every key of the policy file, section by section, from the schema."""
    schema = policy_schema()
    out = [
        "# Policy file reference",
        "",
        "<!-- Generated from the loader's specification (gateway/policy/spec.py) by",
        "     `capgate policy schema --markdown`; do not edit by hand. -->",
        "",
        "Every key a capgate policy file may hold. `<name>` stands for a name you choose (an",
        "upstream, a role, an agent, a parameter); `[]` for each item of a list. The same",
        f"information, as a JSON Schema for editors, is `{SCHEMA_FILE}`: put",
        "",
        "```yaml",
        "# yaml-language-server: $schema=../docs/policy.schema.json",
        "```",
        "",
        "as the first line of a policy (the path relative to the policy file) for completion",
        "and errors as you type in any editor using yaml-language-server (VS Code's YAML",
        "extension, Neovim, Helix, ...). The loader (`capgate policy check`) checks more than",
        "the schema can say: references between sections, regular expressions that compile,",
        "path patterns, SQL settings.",
        "",
    ]
    _section("(file)", schema, out, {})
    return "\n".join(out).rstrip() + "\n"
