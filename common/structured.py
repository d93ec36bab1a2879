"""StructuredOutput -> xgrammar Grammar: the one translation both processes use. The API builds the grammar to
refuse a bad schema, regex or EBNF with a 400 before it reaches the engine; the engine compiles the same grammar
against the model's vocabulary.

JSON (json_object, json_schema) is generated compact and in one fixed layout: `{"a": 1, "b": [1, 2]}`, i.e.
", " and ": " as separators and no other whitespace. With free whitespace a small model can emit newlines until
max_tokens, and the grammar would never end the request.
"""

from __future__ import annotations

import functools
import json
import re
from typing import TYPE_CHECKING

from common.json_schema_check import largest_repeat, unsupported
from common.messages import StructuredOutput

if TYPE_CHECKING:
    import xgrammar

MAX_SPEC_CHARS = 256 * 1024  # schema / regex / EBNF text; a grammar's compile time grows with it
ANY_OBJECT_SCHEMA = '{"type": "object"}'
# Regex / EBNF repetition counts: xgrammar's parser takes about 15 s over "a{1000000}", and its compile is worse.
MAX_REPEAT = 10_000
# EngineOutput.error_code of a constraint the engine could not compile: the request's fault (a 400), as the
# API's own check would have said had it seen the failure coming.
INVALID_CONSTRAINT = "invalid_structured_output"
# xgrammar's errors start with "[hh:mm:ss] /path/file.cc:123: " and sometimes "Check failed: (...) is false: ".
_NOISE = re.compile(r"^\[[\d:]+\] \S+:\d+: (Check failed: .*? is false:\s*)?")


def choice_ebnf(choices: list[str]) -> str:
    """One alternative per allowed string, as EBNF string literals (JSON's escapes are EBNF's)."""
    return "root ::= " + " | ".join(json.dumps(c, ensure_ascii=False) for c in choices)


def grammar_of(so: StructuredOutput) -> xgrammar.Grammar:
    """Raises ValueError (bad spec) or RuntimeError (xgrammar refused it)."""
    import xgrammar as xgr  # lazily: it loads torch, which the API process needs for nothing else

    if so.kind == "json_schema":
        return xgr.Grammar.from_json_schema(so.spec, any_whitespace=False)
    if so.kind == "json_object":
        return xgr.Grammar.from_json_schema(ANY_OBJECT_SCHEMA, any_whitespace=False)
    if so.kind == "regex":
        return xgr.Grammar.from_regex(so.spec)
    if so.kind == "grammar":
        return xgr.Grammar.from_ebnf(so.spec)
    if so.kind == "json_or_calls":
        return _json_or_calls(json.loads(so.spec))
    if so.kind == "choice":
        choices = json.loads(so.spec)
        if not isinstance(choices, list) or not choices or not all(isinstance(c, str) and c for c in choices):
            raise ValueError("choice must be a non-empty list of non-empty strings")
        return xgr.Grammar.from_ebnf(choice_ebnf(choices))
    raise ValueError(f"unknown structured output kind {so.kind!r}")


def _json_or_calls(spec: dict) -> xgrammar.Grammar:
    """The JSON of spec["schema"], or one or more tagged calls: begin, the JSON of spec["calls"], end, separated
    (one at most unless spec["parallel"]). Both JSON grammars compact, as everywhere."""
    import xgrammar as xgr

    def compact(schema: object) -> dict:
        text = str(xgr.Grammar.from_json_schema(json.dumps(schema), any_whitespace=False))  # xgrammar's own EBNF
        return {"type": "grammar", "grammar": text}

    tag = {"type": "tag", "begin": spec["begin"], "content": compact(spec["calls"]), "end": spec["end"]}
    calls = {"type": "tags_with_separator", "tags": [tag], "separator": spec["separator"], "at_least_one": True,
             "stop_after_first": not spec["parallel"]}  # fmt: skip
    either = {"type": "or", "elements": [compact(spec["schema"]), calls]}
    return xgr.Grammar.from_structural_tag(json.dumps({"type": "structural_tag", "format": either}))


def spec_error(so: StructuredOutput) -> str | None:
    """Why this constraint cannot be compiled, in one line; None when it can."""
    if len(so.spec) > MAX_SPEC_CHARS:
        return f"the {so.kind} specification is longer than {MAX_SPEC_CHARS} characters"
    if so.kind in ("regex", "grammar") and (count := largest_repeat(so.spec)) > MAX_REPEAT:
        return f"repetition count {count} is above the limit of {MAX_REPEAT}"
    if so.kind == "json_schema" and (error := _unsupported(so.spec)) is not None:
        return error
    if so.kind == "json_or_calls":
        try:
            spec = json.loads(so.spec)
            error = unsupported(spec["schema"]) or unsupported(spec["calls"])
        except (ValueError, KeyError, TypeError, RecursionError):
            return "the json_or_calls specification is malformed"
        if error is not None:
            return error
    try:
        # Some grammars build but fail to compile (xgrammar 0.2.8: a schema pattern repeated more than 128 times);
        # a compile against a tiny vocabulary finds them (a small schema takes milliseconds), before the engine.
        _tiny_compiler().compile_grammar(grammar_of(so))
    except Exception as exc:  # whatever xgrammar raises, a bad spec is the caller's 400, never a 500
        return error_text(exc)
    return None


def _unsupported(spec: str) -> str | None:
    try:
        return unsupported(json.loads(spec))
    except RecursionError:
        return "the schema is nested too deeply"
    except ValueError:
        return None  # not JSON: xgrammar says where


@functools.cache
def _tiny_compiler() -> xgrammar.GrammarCompiler:
    import xgrammar as xgr

    info = xgr.TokenizerInfo([chr(c) for c in range(32, 127)])  # printable ASCII, one character a token
    # With its cache on, as the engine's: the failures above happen on the cache's path.
    return xgr.GrammarCompiler(info, max_threads=1, cache_limit_bytes=8 << 20)


def error_text(exc: BaseException) -> str:
    lines = [line for line in str(exc).strip().splitlines() if line.strip()]
    text = _NOISE.sub("", lines[0]).strip() if lines else ""
    return text or "xgrammar could not compile it (an internal check failed)"  # a failed check says nothing more
