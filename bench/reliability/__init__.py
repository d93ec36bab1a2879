"""Reliability probe: bounded, loopback-only load and abuse scenarios against a roseinfer server.

python -m bench.reliability --url http://127.0.0.1:8000 [--pid API_PID] [--api-key K]
    [--scenarios all | streams,mix,big-body,hostile] [--scale 1.0] [--result-json bench/results/reliability.json]
python -m bench.reliability --launch [--server-args "--log-level warning"] ...
    (starts launch.py on a free port, waits for /health, SIGTERMs it at the end; its pid gives the API RSS)

Scenarios (every loop is bounded in requests and seconds; exit code 1 when any saw an unexpected result):
  streams   512 concurrent streaming chat requests (ignore_eos): each ends with [DONE] and exactly max_tokens tokens
  mix       3,000 seeded random requests, 64 at a time, 12% of the streams closed by us mid-way; then the engine
            must drain to 0 running, 0 waiting and 0 KV blocks in use
  big-body  a 20 MB JSON body while /health is polled every 20 ms: expects an early 413, a responsive /health
            and a flat API RSS
  hostile   8 streams, then an out-of-range top_k in the middle: expects 400 and the 8 streams untouched
"""
