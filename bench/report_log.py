"""What a pytest run on the GPU machine found, from its --report-log (pytest-reportlog writes each test's report as
it ends): each failure with its traceback and captured output, then the slowest tests. bench/gpu_session.sh runs
it after the tests, so a run cut off at its time limit still says why its tests failed, which -v's one line per
test does not. With --unreported, the tests such a run never reached, for the next call to run.

    python -m bench.report_log REPORT_LOG [--slowest N]
    python -m bench.report_log REPORT_LOG --unreported COLLECTED   (COLLECTED: `pytest --collect-only -q`'s output)
"""

from __future__ import annotations

import argparse
import json
from collections.abc import Iterator
from pathlib import Path

SECTION_CHARS = 3000  # the end of each captured output: a server's log can run to megabytes


def reports(path: Path) -> Iterator[dict]:
    for line in path.read_text(errors="replace").splitlines():
        try:
            entry = json.loads(line)
        except json.JSONDecodeError:  # the last line of a run killed while writing
            continue
        if entry.get("$report_type") == "TestReport":
            yield entry


def traceback_text(longrepr: object) -> str:
    if not isinstance(longrepr, dict):
        return str(longrepr)
    entries = longrepr.get("reprtraceback", {}).get("reprentries", [])
    lines = [line for e in entries for line in e.get("data", {}).get("lines", [])]
    crash = longrepr.get("reprcrash") or {}
    return "\n".join([*lines, f"{crash.get('path')}:{crash.get('lineno')}: {crash.get('message')}"])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("report_log", type=Path)
    parser.add_argument("--slowest", type=int, default=40)
    parser.add_argument("--unreported", type=Path, help="print the node ids in this collection with no report")
    args = parser.parse_args()
    all_reports = list(reports(args.report_log))
    if args.unreported:
        reported = {r["nodeid"] for r in all_reports if r["when"] == "teardown"}  # what was running is not done
        collected = [line for line in args.unreported.read_text().splitlines() if "::" in line]
        print("\n".join(node for node in collected if node not in reported))
        return
    failed = [r for r in all_reports if r["outcome"] == "failed"]
    print(f"{len(all_reports)} reports, {len(failed)} failed")
    for r in failed:
        print(f"\n==== {r['nodeid']} ({r['when']}) ====\n{traceback_text(r.get('longrepr'))}")
        for title, content in r.get("sections", []):
            print(f"---- {title} (last {SECTION_CHARS} chars) ----\n{content[-SECTION_CHARS:]}")
    print(f"\n==== slowest {args.slowest} ====")
    for r in sorted(all_reports, key=lambda r: -r["duration"])[: args.slowest]:
        print(f"{r['duration']:8.2f} s  {r['when']:8}  {r['nodeid']}")


if __name__ == "__main__":
    main()
