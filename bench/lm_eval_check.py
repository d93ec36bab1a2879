"""lm-evaluation-harness against the roseinfer server: per-choice log-likelihoods compared with its `hf` model.

Runs the local multiple-choice task bench/lm_eval/roseinfer_mc.yaml (52 hand-written questions in
bench/data/lm_eval_mc.jsonl, no hub) twice on the same fp32 weights (the default model's converted HF directory):
once through `lm_eval --model local-completions` against a roseinfer server this script starts (launch.py,
--dtype float32, a free port), once through `lm_eval --model hf`. Then it compares, per choice, the two
log-likelihoods, and per question the argmax choice, and writes bench/results/lm_eval.json. Exit 1 when a run fails
or a difference exceeds --tolerance.

lm_eval is not a dependency of roseinfer: it lives in its own venv (torch first, so pip takes the CPU wheel):

    python3 -m venv /work/lmeval-venv
    /work/lmeval-venv/bin/pip install torch==2.13.0
    /work/lmeval-venv/bin/pip install "lm_eval[api,hf]==0.4.13" torch==2.13.0 transformers==5.23.0
    .venv/bin/python bench/lm_eval_check.py --lm-eval /work/lmeval-venv/bin/lm_eval

which runs (from the repository root, with HF_DATASETS_OFFLINE=1 HF_HUB_OFFLINE=1; MODEL_DIR is the converted
directory, ~/.cache/roseinfer/models/SmolLM2-135M-Instruct.Q4_1-<hash>):

    .venv/bin/python launch.py --dtype float32 --port PORT --log-level warning
    lm_eval --model local-completions --tasks roseinfer_mc --include_path bench/lm_eval --log_samples \
        --output_path OUT/api --model_args model=SmolLM2-135M-Instruct,\
base_url=http://127.0.0.1:PORT/v1/completions,tokenizer_backend=huggingface,tokenizer=MODEL_DIR,\
tokenized_requests=True,num_concurrent=8,max_retries=1
    lm_eval --model hf --tasks roseinfer_mc --include_path bench/lm_eval --log_samples --output_path OUT/hf \
        --model_args pretrained=MODEL_DIR,dtype=float32 --device cpu --batch_size 8
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import httpx

REPO = Path(__file__).resolve().parent.parent
if str(REPO) not in sys.path:  # run as a file (python bench/x.py): make the repository importable
    sys.path.insert(0, str(REPO))

from common.model_source import resolve_model  # noqa: E402

TASK = "roseinfer_mc"
INCLUDE_PATH = "bench/lm_eval"
OFFLINE = {"HF_DATASETS_OFFLINE": "1", "HF_HUB_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false"}


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start_server(port: int, log: Path) -> subprocess.Popen[bytes]:
    cmd = [sys.executable, "launch.py", "--dtype", "float32", "--port", str(port), "--log-level", "warning"]
    with open(log, "wb") as out:
        proc = subprocess.Popen(cmd, cwd=REPO, env={**os.environ, **OFFLINE}, stdout=out, stderr=subprocess.STDOUT)
    deadline = time.monotonic() + 300
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise SystemExit(f"launch.py exited with {proc.returncode}:\n{log.read_text(errors='replace')[-3000:]}")
        try:
            if httpx.get(f"http://127.0.0.1:{port}/health", timeout=5).status_code == 200:
                return proc
        except httpx.TransportError:
            pass
        time.sleep(0.5)
    stop_server(proc)
    raise SystemExit(f"server not healthy after 300 s:\n{log.read_text(errors='replace')[-3000:]}")


def stop_server(proc: subprocess.Popen[bytes]) -> None:
    if proc.poll() is None:
        proc.send_signal(signal.SIGTERM)
    try:
        proc.wait(timeout=60)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()


def run_lm_eval(lm_eval: str, model: str, model_args: str, out: Path, extra: list[str]) -> tuple[list[str], float]:
    """One harness run; its log goes to out/lm_eval.log. Returns the command and its wall time; exits on failure."""
    cmd = [
        lm_eval,
        "--model",
        model,
        "--model_args",
        model_args,
        "--tasks",
        TASK,
        "--include_path",
        INCLUDE_PATH,
        "--log_samples",
        "--output_path",
        str(out),
        *extra,
    ]
    out.mkdir(parents=True, exist_ok=True)
    print("+", " ".join(cmd), flush=True)
    start = time.perf_counter()
    with open(out / "lm_eval.log", "wb") as log:
        env = {**os.environ, **OFFLINE}
        rc = subprocess.run(cmd, cwd=REPO, env=env, stdout=log, stderr=subprocess.STDOUT).returncode
    elapsed = time.perf_counter() - start
    if rc != 0:
        text = (out / "lm_eval.log").read_text(errors="replace")
        first_error = next((line for line in text.splitlines() if " ERROR " in line), "")
        print(text[-4000:], "\nfirst error:", first_error[:3000])
        raise RuntimeError(f"lm_eval --model {model} exited with {rc} (log: {out / 'lm_eval.log'})")
    return cmd, elapsed


def load_run(out: Path) -> tuple[dict[int, list[tuple[float, bool]]], dict[str, Any]]:
    """Per doc, (log-likelihood, is_greedy) per choice from the sample log; the run's results file."""
    samples_file = next(out.glob(f"**/samples_{TASK}_*.jsonl"))
    results = json.loads(next(out.glob("**/results_*.json")).read_text())
    per_doc: dict[int, list[tuple[float, bool]]] = {}
    for line in samples_file.read_text().splitlines():
        row = json.loads(line)
        # resps: one [[ll, is_greedy]] per choice, written as strings by the sample logger
        per_doc[row["doc_id"]] = [(float(r[0][0]), str(r[0][1]) == "True") for r in row["resps"]]
    return per_doc, results


def compare(api: dict[int, list[tuple[float, bool]]], hf: dict[int, list[tuple[float, bool]]]) -> dict[str, Any]:
    if api.keys() != hf.keys():
        raise RuntimeError(f"the runs scored different docs: {sorted(api.keys() ^ hf.keys())}")
    diffs: list[float] = []
    argmax_disagree: list[int] = []
    greedy_disagree = 0
    worst = (0.0, -1, -1)
    for doc in sorted(hf):
        a, h = api[doc], hf[doc]
        if len(a) != len(h):
            raise RuntimeError(f"doc {doc}: {len(a)} choices scored by the server, {len(h)} by hf")
        for i, ((lla, ga), (llh, gh)) in enumerate(zip(a, h, strict=True)):
            d = abs(lla - llh)
            diffs.append(d)
            worst = max(worst, (d, doc, i))
            greedy_disagree += ga != gh
        if max(range(len(a)), key=lambda i: a[i][0]) != max(range(len(h)), key=lambda i: h[i][0]):
            argmax_disagree.append(doc)
    return {
        "docs": len(hf),
        "choices_compared": len(diffs),
        "max_abs_ll_diff": max(diffs),
        "mean_abs_ll_diff": sum(diffs) / len(diffs),
        "worst": {
            "doc_id": worst[1],
            "choice": worst[2],
            "api_ll": api[worst[1]][worst[2]][0],
            "hf_ll": hf[worst[1]][worst[2]][0],
        },
        "argmax_agree": len(hf) - len(argmax_disagree),
        "argmax_disagree_docs": argmax_disagree,
        "is_greedy_disagree": greedy_disagree,
    }


def tree_version() -> str:
    """The checkout the server ran from (git describe, -dirty with uncommitted edits), or why there is none."""
    git = subprocess.run(["git", "describe", "--always", "--dirty"], cwd=REPO, capture_output=True, text=True)
    return git.stdout.strip() if git.returncode == 0 else "not a git checkout"


def metrics(results: dict[str, Any]) -> dict[str, float]:
    r = results["results"][TASK]
    return {"acc": r["acc,none"], "acc_norm": r["acc_norm,none"]}


def probe(port: int, tokenizer_dir: Path, served: str) -> None:
    """On a failed server run: the request the harness sends for one choice, and what came back."""
    from transformers import AutoTokenizer

    ids = AutoTokenizer.from_pretrained(tokenizer_dir)("Question: What is 2 plus 2?\nAnswer: 4").input_ids
    body = {
        "model": served,
        "prompt": [ids],
        "temperature": 0,
        "max_tokens": 1,
        "logprobs": 1,
        "seed": 1234,
        "echo": True,
    }
    print("probe request:", json.dumps(body))
    try:
        r = httpx.post(f"http://127.0.0.1:{port}/v1/completions", json=body, timeout=60)
        print("probe response:", r.status_code, r.text[:4000])
    except httpx.HTTPError as e:
        print("probe failed:", repr(e))


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument(
        "--lm-eval",
        default=os.environ.get("LM_EVAL") or shutil.which("lm_eval") or "lm_eval",
        help="the lm_eval executable of its own venv (default: $LM_EVAL, else lm_eval on PATH)",
    )
    ap.add_argument("--num-concurrent", type=int, default=8)
    ap.add_argument("--hf-batch-size", type=int, default=8)
    ap.add_argument("--tolerance", type=float, default=1e-3, help="largest per-choice |ll difference| that passes")
    ap.add_argument("--output-dir", type=Path, default=None, help="lm_eval output (default: a temporary directory)")
    ap.add_argument("--result-json", type=Path, default=REPO / "bench" / "results" / "lm_eval.json")
    args = ap.parse_args()

    model = resolve_model(None)  # converts the default GGUF once; server and hf both load this directory
    out = args.output_dir or Path(tempfile.mkdtemp(prefix="roseinfer-lm-eval-"))
    out.mkdir(parents=True, exist_ok=True)
    port = free_port()
    api_args = (
        f"model={model.name},base_url=http://127.0.0.1:{port}/v1/completions,tokenizer_backend=huggingface,"
        f"tokenizer={model.path},tokenized_requests=True,num_concurrent={args.num_concurrent},max_retries=1"
    )
    server = start_server(port, out / "server.log")
    try:
        try:
            api_cmd, api_s = run_lm_eval(args.lm_eval, "local-completions", api_args, out / "api", [])
        except RuntimeError:
            probe(port, model.path, model.name)
            raise
    finally:
        stop_server(server)
    hf_cmd, hf_s = run_lm_eval(
        args.lm_eval,
        "hf",
        f"pretrained={model.path},dtype=float32",
        out / "hf",
        ["--device", "cpu", "--batch_size", str(args.hf_batch_size)],
    )

    api, api_results = load_run(out / "api")
    hf, hf_results = load_run(out / "hf")
    cmp = compare(api, hf)
    report = {
        "task": TASK,
        "model": model.name,
        "model_dir": str(model.path),
        "dtype": "float32",
        "lm_eval_version": hf_results.get("lm_eval_version"),
        "transformers_version": hf_results.get("transformers_version"),
        "roseinfer_version": tree_version(),
        "local_completions": {**metrics(api_results), "wall_s": round(api_s, 1), "command": api_cmd},
        "hf": {**metrics(hf_results), "wall_s": round(hf_s, 1), "command": hf_cmd},
        "comparison": cmp,
        "tolerance": args.tolerance,
        "passed": cmp["max_abs_ll_diff"] <= args.tolerance,
    }
    args.result_json.parent.mkdir(parents=True, exist_ok=True)
    args.result_json.write_text(json.dumps(report, indent=2) + "\n")
    lc, h = report["local_completions"], report["hf"]
    print(
        f"lm_eval {report['lm_eval_version']}, task {TASK}: {cmp['docs']} questions, {cmp['choices_compared']} choices"
    )
    print(f"acc       local-completions {lc['acc']:.4f}  hf {h['acc']:.4f}")
    print(f"acc_norm  local-completions {lc['acc_norm']:.4f}  hf {h['acc_norm']:.4f}")
    print(
        f"|ll diff| max {cmp['max_abs_ll_diff']:.3e}  mean {cmp['mean_abs_ll_diff']:.3e}  "
        f"(worst: doc {cmp['worst']['doc_id']} choice {cmp['worst']['choice']})"
    )
    print(
        f"argmax choice agrees on {cmp['argmax_agree']}/{cmp['docs']} questions; "
        f"is_greedy differs on {cmp['is_greedy_disagree']} choices"
    )
    print(f"{'PASS' if report['passed'] else 'FAIL'} (tolerance {args.tolerance}); wrote {args.result_json}")
    return 0 if report["passed"] else 1


if __name__ == "__main__":
    sys.exit(main())
