"""Frontend overhead: one all-at-once workload through HTTP (launch.py, streamed) and through the engine core
directly over ZMQ (no HTTP, no detokenizing), same prompts and engine flags; output tok/s, step times, overhead %.
Also transformers `generate` on the same prompts (one static batch, same dtype) in the same run, so that the
HTTP throughput has its ratio to HF as the offline benchmark has (--skip-hf leaves it out).

python -m bench.overhead [--num-prompts 64 --input-len 128 --output-len 128] [--dtype bfloat16] [--result-json F]

"Decode step" on both sides is the client-side TPOT, (last token - first token) / (tokens - 1) per request: with
every request running, each engine step gives each request one token, so it is the step interval as a client sees
it, whether or not the frontend merged tokens into fewer chunks. The direct side also reports the engine's own
`stats.step_time_s` (schedule + forward + sample + update), which HTTP does not expose.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from bench import serve
from bench.offline import add_workload_args, bench_hf
from bench.servers import free_port, launched
from common.config import EngineConfig, to_cli_args
from common.messages import EngineRequest, SamplingParams
from frontend.offline.engine_link import EngineClient


def run_direct(prompts: list[list[int]], warmup: list[list[int]], output_len: int,
               config: EngineConfig) -> dict[str, Any]:  # fmt: skip
    with EngineClient(config) as engine:
        params = SamplingParams(max_tokens=output_len, temperature=0.0, ignore_eos=True)
        # The same unmeasured warmup bench.serve sends the HTTP server: all at once, same prompts.
        engine.generate([EngineRequest(f"warmup-{i}", p, params) for i, p in enumerate(warmup)])
        first: dict[str, float] = {}
        last: dict[str, float] = {}
        counts = dict.fromkeys(map(str, range(len(prompts))), 0)
        step_s: list[float] = []
        start = time.perf_counter()
        for i, p in enumerate(prompts):
            engine.send(EngineRequest(str(i), p, params))
        done = 0
        while done < len(prompts):
            msg = engine.next_outputs(timeout=600)
            now = time.perf_counter()
            if msg.stats is not None:
                step_s.append(msg.stats.step_time_s)
            for out in msg.outputs:
                if out.new_token_ids:
                    first.setdefault(out.request_id, now)
                    last[out.request_id] = now
                    counts[out.request_id] += len(out.new_token_ids)
                done += out.finished
        elapsed = time.perf_counter() - start
    tokens = sum(counts.values())
    tpot = [(last[r] - first[r]) / (n - 1) for r, n in counts.items() if n > 1]
    return {"output_tokens": tokens, "seconds": elapsed, "output_tok_s": tokens / elapsed,
            "ttft_ms_median": statistics.median(first[r] - start for r in first) * 1000,
            "decode_step_ms_mean": statistics.fmean(tpot) * 1000 if tpot else None,
            "engine_step_time_ms_mean": statistics.fmean(step_s) * 1000 if step_s else None,
            "engine_steps": len(step_s)}  # fmt: skip


def run_http(args: argparse.Namespace, config: EngineConfig, tokenizer: Any) -> dict[str, Any]:
    port = free_port()
    log = Path(tempfile.mkdtemp(prefix="roseinfer-overhead-")) / "server.log"
    cmd = [sys.executable, "launch.py", "--port", str(port), "--log-level", "warning", *to_cli_args(config)]
    with launched(cmd, port, log) as url:
        args.base_url = url
        run = asyncio.run(serve.benchmark(args, tokenizer))["runs"][0]
    return {"output_tokens": run["total_output_tokens"], "seconds": run["duration_s"],
            "output_tok_s": run["output_throughput"], "ttft_ms_median": run["ttft_ms"]["median"],
            "decode_step_ms_mean": run["tpot_ms"]["mean"], "failed": run["failed"]}  # fmt: skip


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_workload_args(parser)
    parser.add_argument("--num-warmups", type=int, default=16, help="unmeasured requests first, on both sides")
    parser.add_argument("--skip-hf", action="store_true")
    parser.add_argument("--result-json", default=None)
    ours = parser.parse_args()
    # The HTTP side is bench.serve with all requests at once, capped at the same concurrency as the batch.
    sargs = argparse.ArgumentParser()
    serve.add_args(sargs)
    args = sargs.parse_args(["--num-prompts", str(ours.num_prompts), "--input-len", str(ours.input_len),
                             "--output-len", str(ours.output_len), "--max-concurrency", str(ours.num_prompts),
                             "--seed", str(ours.seed), "--num-warmups", str(ours.num_warmups),
                             "--disable-tqdm"])  # fmt: skip
    tokenizer = serve.load_tokenizer(None)
    args.ignore_eos = True
    prompts = [r.prompt for r in serve.build_requests(args, args.seed, tokenizer)]  # the very prompts HTTP sends
    config = EngineConfig(dtype=ours.dtype, max_num_seqs=ours.num_prompts)
    warmup = [r.prompt for r in serve.warmup_requests(args, 0, tokenizer)]
    direct = run_direct(prompts, warmup, ours.output_len, config)  # type: ignore[arg-type]
    http = run_http(args, config, tokenizer)
    hf = None if ours.skip_hf else bench_hf(prompts, ours.output_len, ours.dtype, ours.num_prompts)  # type: ignore[arg-type]
    overhead = {"throughput_loss": 1 - http["output_tok_s"] / direct["output_tok_s"],
                "decode_step_increase": http["decode_step_ms_mean"] / direct["decode_step_ms_mean"] - 1}  # fmt: skip
    print(f"{' HTTP overhead: ' + f'{ours.num_prompts} x {ours.input_len} in x {ours.output_len} out ':=^72}")
    print(f"{'':<28}{'output tok/s':>14}{'decode step ms':>16}{'TTFT p50 ms':>14}")
    for name, r in (("direct ZMQ (no HTTP)", direct), ("HTTP (launch.py)", http)):
        print(f"{name:<28}{r['output_tok_s']:>14.1f}{r['decode_step_ms_mean']:>16.2f}{r['ttft_ms_median']:>14.1f}")
    print(f"engine step_time_s (direct): {direct['engine_step_time_ms_mean']:.2f} ms mean over "
          f"{direct['engine_steps']} steps")  # fmt: skip
    print(f"HTTP overhead: {overhead['throughput_loss']:.1%} less output tok/s, "
          f"{overhead['decode_step_increase']:+.1%} decode step time")  # fmt: skip
    if hf is not None:
        ratios = {name: r["output_tok_s"] / hf["output_tok_s"] for name, r in (("http", http), ("direct", direct))}
        print(f"HF generate (batch {hf['batch_size']}): {hf['output_tok_s']:.1f} output tok/s; roseinfer over HTTP "
              f"{ratios['http']:.2f}x, direct {ratios['direct']:.2f}x")  # fmt: skip
    if ours.result_json:
        result = {"settings": {**vars(ours), "engine": to_cli_args(config), "machine": serve.machine()},
                  "direct": direct, "http": http, "overhead": overhead, "hf_generate": hf,
                  "ratio_vs_hf": ratios if hf is not None else None}  # fmt: skip
        with open(ours.result_json, "w") as f:
            json.dump(result, f, indent=2)


if __name__ == "__main__":
    main()
