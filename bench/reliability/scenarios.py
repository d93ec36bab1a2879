"""The load scenarios (streams, mix, hostile), the table of all four, and the loop that runs the chosen ones."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable, Callable
from typing import Any

import httpx

from bench.reliability.big_body import scenario_big_body
from bench.reliability.client import bounded_gather, health_status, json_request, restarts, stream_request, wait_idle
from bench.reliability.outcome import Outcome, problem, tally
from bench.reliability.plan import CHAT, COMPLETIONS, WORDS, MixSpec, chat_stream_body, mix_body, mix_plan, scaled
from bench.reliability.probe import Probe, rss_delta, rss_mb
from bench.serve import served_model
from bench.serve_metrics import stats_ms

SCENARIOS = ("streams", "mix", "big-body", "hostile")


async def scenario_streams(p: Probe, client: httpx.AsyncClient) -> dict[str, Any]:
    count, max_tokens = scaled(p.args.streams, p.args.scale), p.args.stream_tokens
    coros = [stream_request(client, CHAT, chat_stream_body(p.model, f"Say one thing about the number {i}.",
                                                           max_tokens)) for i in range(count)]  # fmt: skip
    start = time.perf_counter()
    outcomes, timed_out = await bounded_gather(coros, p.args.scenario_timeout)
    wall = time.perf_counter() - start
    results = [None if o is None else (o, problem(o, True, 1, (max_tokens, max_tokens), frozenset({"length"})))
               for o in outcomes]  # fmt: skip
    out = {"concurrency": count, "max_tokens": max_tokens, **tally(results), "wall_s": round(wall, 3),
           "ttft_ms": stats_ms([o.ttft for o in outcomes if o is not None and o.ttft is not None]),
           "timed_out": timed_out}  # fmt: skip
    out["failures"] = [f"{out['errors']} of {count} streams went wrong"] if out["errors"] else []
    if timed_out:
        out["failures"].append(f"{out['unfinished']} streams still running after {p.args.scenario_timeout} s")
    return out


async def scenario_mix(p: Probe, client: httpx.AsyncClient) -> dict[str, Any]:
    plan = mix_plan(scaled(p.args.mix, p.args.scale), p.args.seed)
    sem = asyncio.Semaphore(p.args.mix_concurrency)
    restarts_before, rss_before = await restarts(client), rss_mb(p.pid)

    async def one(spec: MixSpec) -> tuple[Outcome, str | None]:
        path, body = mix_body(spec, p.model)
        async with sem:
            if spec.stream:
                o = await stream_request(client, path, body, spec.close_after)
            else:
                o = await json_request(client, path, body)
        # Usage counts every choice's tokens; stop strings and EOS may end a choice early.
        return o, problem(o, spec.stream, spec.n, (0, spec.n * spec.max_tokens))

    start = time.perf_counter()
    results, timed_out = await bounded_gather([one(s) for s in plan], p.args.scenario_timeout)
    wall = time.perf_counter() - start
    drained = await wait_idle(client, p.args.drain_timeout)
    rss_after, restarts_after = rss_mb(p.pid), await restarts(client)
    closed = [r[0].closed_by_us and not r[0].done for r in results if r is not None]
    out = {"requests": len(plan), "concurrency": p.args.mix_concurrency, **tally(results), "wall_s": round(wall, 3),
           "requests_per_s": round(len(plan) / wall, 2), "streams": sum(s.stream for s in plan),
           "planned_closes": sum(s.close_after is not None for s in plan), "closed_mid_stream": sum(closed),
           "after": drained, "api_rss_mb_before": rss_before, "api_rss_mb_after": rss_after,
           "api_rss_growth_mb": rss_delta(rss_before, rss_after),
           "engine_restarts": None if restarts_before is None or restarts_after is None
           else restarts_after - restarts_before, "timed_out": timed_out}  # fmt: skip
    failures = [f"{out['errors']} of {len(plan)} requests went wrong"] if out["errors"] else []
    if timed_out:
        failures.append(f"{out['unfinished']} requests still running after {p.args.scenario_timeout} s")
    if not drained["idle"]:
        failures.append(f"engine not idle {p.args.drain_timeout} s after the mix: {drained}")
    if out["engine_restarts"]:
        failures.append(f"the engine core restarted {out['engine_restarts']:g} times")
    out["failures"] = failures
    return out


async def scenario_hostile(p: Probe, client: httpx.AsyncClient) -> dict[str, Any]:
    count, max_tokens = p.args.hostile_streams, p.args.hostile_tokens
    restarts_before = await restarts(client)
    outcomes = [Outcome() for _ in range(count)]
    prompts = [f"Write a story about a {WORDS[i % len(WORDS)]}." for i in range(count)]
    coros = [stream_request(client, CHAT, chat_stream_body(p.model, text, max_tokens), o=o)
             for text, o in zip(prompts, outcomes, strict=True)]  # fmt: skip
    streams = asyncio.ensure_future(bounded_gather(coros, p.args.scenario_timeout))
    # The hostile request goes in once every stream is generating, so it shares their batch.
    deadline = time.perf_counter() + min(60.0, p.args.scenario_timeout)
    while time.perf_counter() < deadline and not streams.done():
        if all(o.content_chunks or o.status not in (None, 200) or o.exception for o in outcomes):
            break
        await asyncio.sleep(0.01)
    running = sum(not o.done and not o.exception and o.status in (None, 200) for o in outcomes)
    hostile = {"model": p.model, "prompt": "Hello", "max_tokens": 8, "temperature": 0.8, "top_k": 2**63}
    h = await json_request(client, COMPLETIONS, hostile)
    results, timed_out = await streams
    health, restarts_after = await health_status(client), await restarts(client)
    checked = [None if o is None else (o, problem(o, True, 1, (max_tokens, max_tokens), frozenset({"length"})))
               for o in results]  # fmt: skip
    out = {"hostile_body": {k: v for k, v in hostile.items() if k != "model"}, "hostile_status": h.status,
           "hostile_response": h.body or h.exception or "(200 with a completion)", "hostile_s": round(h.e2e, 3),
           "streams": count, "stream_max_tokens": max_tokens, "streams_running_at_hostile": running,
           **tally(checked), "health_after": health,
           "engine_restarts": None if restarts_before is None or restarts_after is None
           else restarts_after - restarts_before, "timed_out": timed_out}  # fmt: skip
    failures = []
    if h.status != 400:
        failures.append(f"hostile request answered {h.status}, expected 400")
    if out["errors"] or out["unfinished"]:
        failures.append(f"{out['errors'] + out['unfinished']} of {count} streams did not finish with full output")
    if health != 200:
        failures.append(f"/health {health} after the hostile request")
    if out["engine_restarts"]:
        failures.append(f"the engine core restarted {out['engine_restarts']:g} times")
    out["failures"] = failures
    if not running:  # a note, not the server's fault: raise --hostile-tokens
        out["note"] = "every stream had finished before the hostile request was sent"
    return out


RUNNERS: dict[str, Callable[[Probe, httpx.AsyncClient], Awaitable[dict[str, Any]]]] = {
    "streams": scenario_streams, "mix": scenario_mix, "big-body": scenario_big_body, "hostile": scenario_hostile,
}  # fmt: skip


async def probe(p: Probe, names: list[str]) -> dict[str, dict[str, Any]]:
    out: dict[str, dict[str, Any]] = {}
    async with p.client() as client:
        try:
            p.model = p.args.model or await served_model(client)
        except (httpx.HTTPError, ValueError, KeyError, IndexError) as exc:
            return {n: {"ok": False, "failures": [f"server unreachable: {type(exc).__name__}: {exc}"[:300]]}
                    for n in names}  # fmt: skip
        for name in names:
            print(f"-- {name} ...", flush=True)
            start = time.perf_counter()
            try:
                res = await RUNNERS[name](p, client)
            except Exception as exc:  # a probe bug or a dead server: report it, go on with the next scenario
                res = {"failures": [f"probe error: {type(exc).__name__}: {exc}"[:300]]}
            res["ok"] = not res["failures"]
            res["scenario_s"] = round(time.perf_counter() - start, 3)
            out[name] = res
            print(f"   {'ok' if res['ok'] else 'FAIL'} in {res['scenario_s']:.1f} s", flush=True)
    return out
