"""One request as the client saw it, and what is wrong with it: the scenarios' error kinds and tallies."""

from __future__ import annotations

import json
from collections import Counter
from dataclasses import dataclass, field
from typing import Any


@dataclass
class Outcome:
    """One request as the client saw it."""

    status: int | None = None  # None: no status line (connection error or timeout before it)
    done: bool = False  # the stream's [DONE] arrived (or, not streamed, a 200 JSON body was read)
    closed_by_us: bool = False  # we dropped a stream before its end, on purpose
    error_event: str = ""  # an {"error": ...} event inside a 200 stream
    exception: str = ""
    completion_tokens: int | None = None  # from usage
    finish_reasons: dict[int, str | None] = field(default_factory=dict)
    content_chunks: int = 0
    body: str = ""  # start of a non-200 answer, for the report
    ttft: float | None = None
    e2e: float = 0.0


def read_event(o: Outcome, event: dict[str, Any], elapsed: float) -> None:
    """Folds one SSE `data:` object (chat or completions chunk, usage chunk, error event) into the outcome."""
    if "error" in event:
        o.error_event = json.dumps(event["error"])[:200]
        return
    if usage := event.get("usage"):
        o.completion_tokens = usage.get("completion_tokens")
    for choice in event.get("choices") or []:
        text = choice.get("text") if "text" in choice else (choice.get("delta") or {}).get("content")
        if text:
            o.content_chunks += 1
            if o.ttft is None:
                o.ttft = elapsed
        if choice.get("finish_reason") is not None:
            o.finish_reasons[int(choice.get("index", 0))] = choice["finish_reason"]


def problem(o: Outcome, stream: bool, n: int = 1, tokens: tuple[int, int] | None = None,
            finishes: frozenset[str] = frozenset({"stop", "length"})) -> str | None:  # fmt: skip
    """What is wrong with a valid request's outcome (None: nothing); the kinds are the report's error keys."""
    if o.exception:
        return f"exception:{o.exception.split(':', 1)[0]}"
    if o.status != 200:
        return f"http_{o.status}"
    if o.closed_by_us:  # we cut it: whatever came before is fine
        return None
    if o.error_event:
        return "error_event"
    if stream and not o.done:
        return "no_done"
    if sorted(o.finish_reasons) != list(range(n)):
        return "missing_finish"
    if any(r not in finishes for r in o.finish_reasons.values()):
        return f"finish_{sorted({str(r) for r in o.finish_reasons.values()} - finishes)[0]}"
    if tokens is not None:
        if o.completion_tokens is None:
            return "no_usage"
        if not tokens[0] <= o.completion_tokens <= tokens[1]:
            return "wrong_token_count"
    return None


def describe(o: Outcome, kind: str) -> str:
    detail = o.exception or o.error_event or o.body
    if kind == "wrong_token_count":
        detail = f"completion_tokens={o.completion_tokens}"
    elif kind.startswith("finish_") or kind == "missing_finish":
        detail = f"finish_reasons={o.finish_reasons}"
    return f"{kind}: {detail}"[:240]


def tally(results: list[tuple[Outcome, str | None] | None]) -> dict[str, Any]:
    """Counts of a scenario's requests: unfinished ones (None) are those its time limit cut off."""
    finished = [r for r in results if r is not None]
    problems = Counter(kind for _, kind in finished if kind)
    statuses = Counter(str(o.status) for o, _ in finished)
    firsts = list(dict.fromkeys(describe(o, kind) for o, kind in finished if kind))
    return {"sent": len(results), "finished": len(finished), "unfinished": len(results) - len(finished),
            "errors": sum(problems.values()), "error_kinds": dict(problems), "statuses": dict(statuses),
            "first_errors": firsts[:5]}  # fmt: skip
