"""python -m bench.reliability: arguments, the run (a given or a launched server), the JSON result and the table."""

from __future__ import annotations

import argparse
import asyncio
import datetime
import ipaddress
import json
import os
import shlex
from typing import Any
from urllib.parse import urlsplit

from bench import reliability
from bench.reliability.launched_server import REPO, LaunchedServer
from bench.reliability.probe import Probe
from bench.reliability.scenarios import SCENARIOS, probe
from bench.serve import machine


def is_loopback(url: str) -> bool:
    host = urlsplit(url).hostname or ""
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def print_table(scenarios: dict[str, dict[str, Any]]) -> None:
    keys = {"streams": ("sent", "errors", "unfinished", "wall_s"),
            "mix": ("sent", "errors", "closed_mid_stream", "wall_s", "after", "api_rss_growth_mb"),
            "big-body": ("status", "status_s", "bytes_sent_at_status", "health_max_ms", "api_rss_growth_mb"),
            "hostile": ("hostile_status", "streams_running_at_hostile", "errors", "unfinished",
                        "health_after")}  # fmt: skip
    print(f"{' Reliability probe ':=^100}")
    for name, res in scenarios.items():
        nums = ", ".join(f"{k}={res[k]}" for k in keys.get(name, ()) if k in res)
        print(f"{name:<10}{'ok' if res['ok'] else 'FAIL':<6}{nums}")
        for failure in res["failures"]:
            print(f"{'':<16}- {failure}")
        for err in res.get("first_errors", [])[:3]:
            print(f"{'':<16}  e.g. {err}")
    print("=" * 100)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        prog="python -m bench.reliability",  # not "__main__.py"
        description=reliability.__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    a = parser.add_argument
    a("--url", default=None, help="a running server (loopback only); default with --launch: its own")
    a("--pid", type=int, default=None, help="with --url: the API process (launch.py), to read its RSS")
    a("--launch", action="store_true", help="start launch.py on a free port for the probe, stop it afterwards")
    a("--server-args", default="--log-level warning", help="with --launch: extra launch.py flags (one string)")
    a("--launch-timeout", type=float, default=600.0, help="seconds for a launched server to get healthy")
    a("--api-key", default=None)
    a("--model", default=None, help="default: the first model the server lists at /v1/models")
    a("--scenarios", default="all", help=f"all, or comma-separated of {', '.join(SCENARIOS)}")
    a("--scale", type=float, default=1.0, help="multiplies the streams and mix counts (0.05: a smoke run)")
    a("--streams", type=int, default=512, help="concurrent streams of the streams scenario")
    a("--stream-tokens", type=int, default=16, help="max_tokens of each stream there")
    a("--mix", type=int, default=3000, help="requests of the mix scenario")
    a("--mix-concurrency", type=int, default=64)
    a("--big-body-mb", type=float, default=20.0, help="size of the oversized body (1 MB = 10^6 bytes)")
    a("--big-body-timeout", type=float, default=120.0, help="seconds to wait for its status line")
    a("--hostile-streams", type=int, default=8)
    a("--hostile-tokens", type=int, default=128, help="max_tokens of those streams: enough to outlast the request")
    a("--request-timeout", type=float, default=300.0, help="seconds without progress before a request fails")
    a("--scenario-timeout", type=float, default=900.0, help="seconds before a scenario's requests are cut off")
    a("--drain-timeout", type=float, default=60.0, help="seconds for the engine to get idle after the mix")
    a("--seed", type=int, default=0)
    a("--result-json", default=str(REPO / "bench" / "results" / "reliability.json"))
    args = parser.parse_args(argv)
    if (args.url is None) == (not args.launch):
        parser.error("give exactly one of --url and --launch")
    if args.url is not None and not is_loopback(args.url):
        parser.error(f"--url must be a loopback address (127.0.0.1, ::1, localhost), not {args.url}")
    names = list(SCENARIOS) if args.scenarios == "all" else [s.strip() for s in args.scenarios.split(",")]
    if unknown := [s for s in names if s not in SCENARIOS]:
        parser.error(f"unknown scenarios {unknown}; known: {', '.join(SCENARIOS)}")
    args.scenario_names = names
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    server: LaunchedServer | None = None
    server_info: dict[str, Any] = {}
    if args.launch:
        server = LaunchedServer(shlex.split(args.server_args))
        print(f"launching: {shlex.join(server.cmd)} (log {server.log})", flush=True)
        server.wait_healthy(args.launch_timeout)
        url, pid = server.url, server.proc.pid
    else:
        url, pid = args.url.rstrip("/"), args.pid
    try:
        p = Probe(args, url, pid)
        scenarios = asyncio.run(probe(p, args.scenario_names))
    finally:
        if server is not None:
            server_info = server.stop()
    settings = {k: v for k, v in vars(args).items() if k not in ("api_key", "scenario_names")}
    settings.update(url=url, api_pid=pid, api_key_set=bool(args.api_key), model=p.model, machine=machine(),
                    date=datetime.datetime.now().astimezone().isoformat(timespec="seconds"),
                    load_avg_1m=os.getloadavg()[0])  # fmt: skip
    result = {"settings": settings, "server": server_info or None, "scenarios": scenarios,
              "ok": all(s["ok"] for s in scenarios.values())}  # fmt: skip
    os.makedirs(os.path.dirname(os.path.abspath(args.result_json)), exist_ok=True)
    with open(args.result_json, "w") as f:
        json.dump(result, f, indent=2)
    print_table(scenarios)
    if server_info:
        print(f"server stopped: exit code {server_info['exit_code']} in {server_info['stop_s']} s, "
              f"{server_info['log_tracebacks']} tracebacks in {server_info['log']}")  # fmt: skip
    print(f"results: {args.result_json}")
    return 0 if result["ok"] else 1
