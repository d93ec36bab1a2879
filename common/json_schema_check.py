"""JSON schemas checked before xgrammar builds them: the keywords it would ignore (so the output would not be held
to the schema) and the patterns it cannot compile are refused, naming the keyword and where it is.

Checked against xgrammar 0.2.8. It enforces type, properties, required, additionalProperties, patternProperties,
propertyNames, min/maxProperties, items, prefixItems, unevaluated*, min/maxItems, min/maxLength, pattern, format,
enum, const, minimum/maximum (exclusive too), multipleOf on integers, anyOf, oneOf, local $refs and an allOf of one
schema. It ignores the ones below; annotations (title, description, examples, default, ...) cost nothing.
"""

from __future__ import annotations

import re
from collections.abc import Iterator
from typing import Any

MAX_SCHEMA_DEPTH = 32  # JSON nesting of a schema: every walk over it (ours, jsonschema's, xgrammar's) recurses
# xgrammar 0.2.8 compiles no JSON-schema pattern with a repeat count above 128 (and builds one in time quadratic
# in the count: "a{10000}" takes 8 s before the compile fails).
MAX_PATTERN_REPEAT = 128
_REPEAT = re.compile(r"\{\s*(\d+)\s*(?:,\s*(\d*)\s*)?\}")
_LOOKAROUND = re.compile(r"(?<!\\)(?:\\\\)*\(\?<?[=!]")  # (?= (?! (?<= (?<! not escaped

_ONE = ("items", "additionalItems", "additionalProperties", "unevaluatedItems", "unevaluatedProperties",
        "propertyNames", "contains", "not", "if", "then", "else", "contentSchema")  # fmt: skip
_LIST = ("prefixItems", "items", "allOf", "anyOf", "oneOf")  # a list of items: the old tuple form
_MAP = ("properties", "patternProperties", "$defs", "definitions", "dependentSchemas", "dependencies")

_IGNORED = ("contains", "minContains", "maxContains", "not", "if", "then", "else", "dependentRequired",
            "dependentSchemas", "dependencies", "$dynamicRef", "$recursiveRef")  # fmt: skip
# Beside a $ref or an allOf xgrammar ignores every other keyword: fine for annotations and definitions only.
_BESIDE_REF = frozenset({"title", "description", "examples", "default", "$schema", "$id", "$comment", "deprecated",
                          "readOnly", "writeOnly", "discriminator", "$anchor", "$defs", "definitions"})  # fmt: skip


def subschemas(schema: Any) -> Iterator[tuple[str, dict[str, Any]]]:
    """Every schema object inside `schema` (itself included) with its JSON pointer; never data (const, enum,
    default, examples) nor property names. Without recursion, so any depth is safe."""
    stack: list[tuple[str, Any]] = [("", schema)]
    while stack:
        at, node = stack.pop()
        if not isinstance(node, dict):
            continue
        yield at, node
        for key in _ONE:
            if isinstance(node.get(key), dict):
                stack.append((f"{at}/{_token(key)}", node[key]))
        for key in _LIST:
            if isinstance(node.get(key), list):
                stack += [(f"{at}/{_token(key)}/{i}", sub) for i, sub in enumerate(node[key])]
        for key in _MAP:
            if isinstance(node.get(key), dict):
                stack += [(f"{at}/{_token(key)}/{_token(str(name))}", sub) for name, sub in node[key].items()]


def _token(name: str) -> str:
    return name.replace("~", "~0").replace("/", "~1")


def depth_exceeds(value: Any, limit: int = MAX_SCHEMA_DEPTH) -> bool:
    """Whether JSON `value` nests deeper than `limit` levels (the value itself is level 0)."""
    stack = [(value, 0)]
    while stack:
        node, depth = stack.pop()
        if depth > limit:
            return True
        children = node.values() if isinstance(node, dict) else node if isinstance(node, list) else ()
        stack += [(child, depth + 1) for child in children]
    return False


def largest_repeat(pattern: str) -> int:
    """The largest repetition count ({n}, {n,}, {n,m}) written in a regex or EBNF text; 0 without one."""
    return max((int(n) for m in _REPEAT.finditer(pattern) for n in m.groups() if n), default=0)


def pattern_error(pattern: str) -> str | None:
    if _LOOKAROUND.search(pattern):
        return "uses a lookaround assertion, which constrained decoding cannot enforce"
    if (count := largest_repeat(pattern)) > MAX_PATTERN_REPEAT:
        return f"has the repetition count {count}, above the limit of {MAX_PATTERN_REPEAT} for schema patterns"
    return None


def unsupported(schema: Any) -> str | None:
    """Why constrained decoding cannot hold output to this schema, naming the keyword and where; None: it can."""
    for at, node in subschemas(schema):
        where = at or "the top"
        bad = next((k for k in _IGNORED if k in node), None)
        if bad is None and node.get("uniqueItems") is True:  # pydantic's set[...]; vLLM refuses it too
            bad = "uniqueItems"
        if bad is None and "multipleOf" in node and not _integer_only(node.get("type")):
            bad = "multipleOf"  # xgrammar checks it on integers only
        if bad is not None:
            return f"the keyword {bad!r} (at {where}) cannot be enforced by constrained decoding"
        ref = node.get("$ref")
        if ref is not None and not (isinstance(ref, str) and (ref == "#" or ref.startswith("#/"))):
            return f"the $ref {ref!r} (at {where}) is not a local reference (\"#\" or \"#/...\")"
        all_of = node.get("allOf")
        if ref is not None or all_of is not None:
            keyword = "$ref" if ref is not None else "allOf"
            others = sorted(k for k in node if k not in _BESIDE_REF and k != keyword)
            if others or (all_of is not None and (not isinstance(all_of, list) or len(all_of) != 1)):
                what = f"beside {', '.join(map(repr, others))}" if others else "with more than one schema"
                return f"{keyword} {what} (at {where}) cannot be enforced by constrained decoding"
        names = node.get("patternProperties")
        patterns = [("pattern", node.get("pattern"))] + [("patternProperties", p) for p in
                                                         (names if isinstance(names, dict) else {})]  # fmt: skip
        for keyword, pattern in patterns:
            error = pattern_error(pattern) if isinstance(pattern, str) else None
            if error is not None:
                return f"the {keyword} {pattern[:40]!r} (at {where}) {error}"
    return None


def _integer_only(kind: Any) -> bool:
    kinds = kind if isinstance(kind, list) else [kind]
    return "integer" in kinds and "number" not in kinds
