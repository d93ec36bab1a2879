"""Tensor parallelism over torch.distributed (gloo, CPU, float32): two ranks serve over HTTP token for token what
transformers generates greedily, on the default model and on tiny random Llama (one KV head, replicated), Qwen2
(q/k/v biases, odd vocabulary), Qwen2-MoE (experts split unevenly) and GPT-2 (odd vocabulary) configs, a GPTQ
checkpoint (transformers on the float weights it stands for), and a Qwen3
classifier's probabilities over /classify; two "nodes" on loopback form one group; the group dies and restarts as
one, whichever of its processes is killed.

The servers start together (module fixtures) and load while the references are computed. Tiny models get a
word-level tokenizer ("t0", "t1", ...), so a completion's text gives back its token ids.
"""

from __future__ import annotations

import asyncio
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest
import torch
import transformers
from tokenizers import Tokenizer, models, pre_tokenizers

from bench.quantize_checkpoint import convert
from engine_core.models.parallel import HeadSplit, head_split, split, vocab_shard
from tests.conftest import REPO, Server, free_port
from tests.test_model_parity import randomized

TP = ["--tensor-parallel-size", "2", "--device", "cpu"]  # gloo on CPU cores, on a GPU machine too (one GPU)
MAX_TOKENS = 10
TINY = {  # name -> (config, HF class)
    "llama": (lambda: transformers.LlamaConfig(hidden_size=64, intermediate_size=96, num_hidden_layers=2,
                                               num_attention_heads=4, num_key_value_heads=1, vocab_size=128,
                                               architectures=["LlamaForCausalLM"]), transformers.LlamaForCausalLM),
    "qwen2": (lambda: transformers.Qwen2Config(hidden_size=64, intermediate_size=96, num_hidden_layers=2,
                                               num_attention_heads=4, num_key_value_heads=2, vocab_size=127,
                                               tie_word_embeddings=True, architectures=["Qwen2ForCausalLM"]),
              transformers.Qwen2ForCausalLM),
    # Gemma 3's layer, a sliding window of 8 on one of its two layers: both ranks mask past it.
    "gemma3": (lambda: transformers.Gemma3TextConfig(hidden_size=64, intermediate_size=96, num_hidden_layers=2,
                                                     num_attention_heads=4, num_key_value_heads=2, head_dim=16,
                                                     vocab_size=128, sliding_window=8, max_position_embeddings=256,
                                                     layer_types=["sliding_attention", "full_attention"],
                                                     architectures=["Gemma3ForCausalLM"]),
               transformers.Gemma3ForCausalLM),
    # Qwen2-MoE: every expert's columns and the shared expert's split unevenly (23 and 37 over two ranks; such odd
    # sizes need transformers' eager experts, whose grouped_mm wants 16-byte strides)
    "qwen2-moe": (lambda: transformers.Qwen2MoeConfig(hidden_size=64, intermediate_size=96, moe_intermediate_size=23,
                                                      shared_expert_intermediate_size=37, num_experts=6,
                                                      num_experts_per_tok=2, num_hidden_layers=2, num_attention_heads=4,
                                                      num_key_value_heads=2, vocab_size=128,
                                                      experts_implementation="eager",
                                                      architectures=["Qwen2MoeForCausalLM"]),
                  transformers.Qwen2MoeForCausalLM),
    "gpt2": (lambda: transformers.GPT2Config(n_embd=64, n_layer=2, n_head=4, vocab_size=129, n_positions=256,
                                             architectures=["GPT2LMHeadModel"]), transformers.GPT2LMHeadModel),
}  # fmt: skip
# A pooling server's classifier (a reranker's shape, three labels): its head's rows whole on both ranks.
CLASSIFIER = (lambda: transformers.Qwen3Config(hidden_size=64, intermediate_size=96, num_hidden_layers=2,
                                               num_attention_heads=4, num_key_value_heads=2, head_dim=16,
                                               vocab_size=128, num_labels=3),
              transformers.Qwen3ForSequenceClassification)  # fmt: skip
# A GPTQ checkpoint of a Llama (bench.quantize_checkpoint, groups of 32) whose row-parallel linears' inputs split
# into whole groups on both ranks: each rank takes its rows or its columns of the 4-bit weights and their scales.
GPTQ_LLAMA = (lambda: transformers.LlamaConfig(hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                               num_attention_heads=4, num_key_value_heads=2, vocab_size=128,
                                               architectures=["LlamaForCausalLM"]), transformers.LlamaForCausalLM)
# Token-id prompts: different lengths in one batch, and a second round that hits the first one's cached prefix.
PROMPTS = [[5, 9, 17, 3, 44, 2, 8], list(range(10, 50)), [7] * 3]
PREFIX_HIT = list(range(10, 50))[:33] + [1, 2, 3]


def save_tiny(name: str, root: Path, spec=None) -> tuple[Path, transformers.PreTrainedModel]:
    """A seeded random model (every weight, bias and norm randomised) with a word-level tokenizer; `spec`: its
    (config, class) where it is not TINY's."""
    config, hf_class = spec or TINY[name]
    torch.manual_seed(0)
    hf = randomized(hf_class(config()).eval())
    path = root / name
    hf.save_pretrained(path)
    vocab = hf.config.vocab_size
    tok = Tokenizer(models.WordLevel({f"t{i}": i for i in range(vocab)}, unk_token="t0"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tok.save(str(path / "tokenizer.json"))
    return path, hf


@torch.inference_mode()
def hf_greedy(hf, prompt: list[int], n: int = MAX_TOKENS) -> list[int]:
    ids = list(prompt)
    for _ in range(n):
        ids.append(int(hf(torch.tensor([ids])).logits[0, -1].argmax()))
    return ids[len(prompt) :]


async def _complete(url: str, prompts: list, **kw) -> list[str]:
    async with httpx.AsyncClient(timeout=300) as client:
        bodies = [{"prompt": p, "max_tokens": MAX_TOKENS, "temperature": 0, **kw} for p in prompts]
        replies = await asyncio.gather(*(client.post(url + "/v1/completions", json=b) for b in bodies))
    assert all(r.status_code == 200 for r in replies), [r.text for r in replies]
    return [r.json()["choices"][0]["text"] for r in replies]


def tiny_greedy_over_http(server: Server, prompts: list[list[int]]) -> list[list[int]]:
    texts = asyncio.run(_complete(server.url, prompts, ignore_eos=True))
    return [[int(t) for t in re.findall(r"t(\d+)", text)] for text in texts]


def children(pid: int) -> list[int]:
    try:
        return [int(c) for c in Path(f"/proc/{pid}/task/{pid}/children").read_text().split()]
    except FileNotFoundError:
        return []


def replaced(server: Server, engine: int, timeout: float = 300.0) -> None:
    """Waits for launch.py's next engine core, and for it to be ready."""
    deadline = time.monotonic() + timeout
    while set(children(server.proc.pid)) <= {engine}:
        assert time.monotonic() < deadline, server.log_text()
        time.sleep(0.1)
    server.wait_healthy(timeout=timeout)


def gone(pid: int, timeout: float = 15.0) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            if Path(f"/proc/{pid}/stat").read_text().split(")")[-1].split()[0] in "ZX":
                return True
        except FileNotFoundError:
            return True
        time.sleep(0.1)
    return False


@pytest.fixture(scope="module")
def tiny_models(tmp_path_factory) -> dict[str, tuple[Path, transformers.PreTrainedModel]]:
    root = tmp_path_factory.mktemp("tiny")
    plain, _ = save_tiny("gptq-plain", root, GPTQ_LLAMA)
    convert(plain, root / "gptq", "gptq", 32, False, "gptq", root / "gptq-ref")  # ref: the weights it stands for
    gptq = root / "gptq", transformers.AutoModelForCausalLM.from_pretrained(root / "gptq-ref", dtype=torch.float32)
    return {**{name: save_tiny(name, root) for name in TINY}, "classifier": save_tiny("classifier", root, CLASSIFIER),
            "gptq": gptq}  # fmt: skip


class TwoNodes:
    """TP=2 over two process trees on loopback: node 0 is launch.py with the API and rank 0; node 1 is
    `launch.py --node-rank 1`, which runs only rank 1 (and replaces it when the group restarts)."""

    def __init__(self, tmp: Path, model: Path) -> None:
        port = free_port()
        flags = [*TP, "--model", str(model), "--nnodes", "2", "--master-addr", "127.0.0.1", "--master-port",
                 str(port)]  # fmt: skip
        self.node1_log = open(tmp / "node1.log", "wb")  # noqa: SIM115 (closed in stop)
        self.node1 = subprocess.Popen([sys.executable, "launch.py", *flags, "--node-rank", "1", "--dtype", "float32"],
                                      cwd=REPO, stdout=self.node1_log, stderr=subprocess.STDOUT)  # fmt: skip
        self.node0 = Server(tmp, *flags, "--node-rank", "0")

    def stop(self) -> None:
        self.node0.stop()
        self.node1.send_signal(signal.SIGTERM)
        code = self.node1.wait(timeout=30)
        self.node1_log.close()
        assert code == 0, Path(self.node1_log.name).read_text(errors="replace")[-2000:]


@pytest.fixture(scope="module")
def servers(tmp_path_factory, tiny_models):
    """One TP=2 server per model, all starting at once; Qwen2's spans two "nodes"."""
    started: dict[str, Server] = {"smollm2": Server(tmp_path_factory.mktemp("tp-smollm2"), *TP)}
    for name in ("llama", "qwen2-moe", "gptq"):
        started[name] = Server(tmp_path_factory.mktemp(f"tp-{name}"), *TP, "--model", str(tiny_models[name][0]))
    # A small token budget: the 40-token prompt is prefilled in chunks, in steps that also decode the others.
    started["gpt2"] = Server(tmp_path_factory.mktemp("tp-gpt2"), *TP, "--model", str(tiny_models["gpt2"][0]),
                             "--max-num-batched-tokens", "16")  # fmt: skip
    started["gemma3"] = Server(tmp_path_factory.mktemp("tp-gemma3"), *TP, "--model", str(tiny_models["gemma3"][0]),
                               "--max-num-batched-tokens", "16")  # fmt: skip
    started["classifier"] = Server(tmp_path_factory.mktemp("tp-classifier"), *TP, "--model",
                                   str(tiny_models["classifier"][0]))  # fmt: skip
    two_nodes = TwoNodes(tmp_path_factory.mktemp("tp-two-nodes"), tiny_models["qwen2"][0])
    started["qwen2"] = two_nodes.node0
    seen: set[int] = set()  # every engine core and worker healthy() saw
    try:
        yield started, two_nodes, seen
    finally:
        for name, server in started.items():
            if name != "qwen2":
                server.stop()
        two_nodes.stop()
    assert all(gone(pid) for pid in seen), "a rank outlived its server"


def healthy(servers, name: str) -> Server:
    server = servers[0][name].wait_healthy(timeout=300)
    assert server.engine_pid is not None
    if name == "qwen2":  # rank 1 is node 1's child, not the engine core's
        assert children(server.engine_pid) == [] and len(children(servers[1].node1.pid)) == 1
        servers[2].update(children(servers[1].node1.pid))
    else:
        assert len(children(server.engine_pid)) == 1  # rank 0 and its one worker
        servers[2].update(children(server.engine_pid))
    servers[2].add(server.engine_pid)
    return server


def test_splits():
    assert split(1536, 2, 1) == (768, 1536) and split(9, 2, 0) == (0, 5)
    # SmolLM2: 9 query heads in 3 KV groups -> one rank holds one group, the other two.
    assert [head_split(9, 3, 2, r) for r in (0, 1)] == [HeadSplit(0, 6, 0, 2), HeadSplit(6, 9, 2, 3)]
    assert head_split(4, 1, 2, 1) == HeadSplit(2, 4, 0, 1)  # one KV head: replicated on both ranks
    with pytest.raises(ValueError):
        head_split(6, 2, 4, 0)
    assert vocab_shard(127, 2, 1) == (64, 127, 64)  # the last shard is padded to 64 rows


def test_default_model_greedy_equals_transformers(servers):
    from common.model_source import resolve_model

    path = resolve_model(None).path
    tok = transformers.AutoTokenizer.from_pretrained(path)
    hf = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    texts = ["Once upon a time, there was a dragon who", "The capital of France is"]
    refs = [hf.generate(torch.tensor([tok(t)["input_ids"]]), max_new_tokens=MAX_TOKENS, do_sample=False)[0]
            for t in texts]  # fmt: skip
    refs = [tok.decode(r[len(tok(t)["input_ids"]) :], skip_special_tokens=True)
            for r, t in zip(refs, texts, strict=True)]  # fmt: skip
    server = healthy(servers, "smollm2")
    assert asyncio.run(_complete(server.url, texts)) == refs


def test_a_classifier_gives_transformers_probabilities(servers, tiny_models):
    _, hf = tiny_models["classifier"]
    server = healthy(servers, "classifier")
    data = httpx.post(server.url + "/classify", json={"input": PROMPTS}, timeout=300).json()["data"]
    for prompt, answer in zip(PROMPTS, data, strict=True):
        with torch.inference_mode():
            want = torch.softmax(hf(torch.tensor([prompt])).logits[0], -1)
        assert answer["probs"] == pytest.approx(want.tolist(), abs=1e-5)


@pytest.mark.parametrize("name", list(TINY))
def test_tiny_greedy_equals_transformers(servers, tiny_models, name):
    _, hf = tiny_models[name]
    refs = [hf_greedy(hf, p) for p in [*PROMPTS, PREFIX_HIT]]
    server = healthy(servers, name)
    assert tiny_greedy_over_http(server, PROMPTS) == refs[:-1]
    assert tiny_greedy_over_http(server, [PREFIX_HIT]) == refs[-1:]  # its first 32 tokens come from the cache


def test_a_gptq_checkpoint_splits_over_the_ranks(servers, tiny_models):
    _, hf = tiny_models["gptq"]
    assert tiny_greedy_over_http(healthy(servers, "gptq"), PROMPTS) == [hf_greedy(hf.eval(), p) for p in PROMPTS]


def test_group_dies_and_restarts_as_one(servers, tiny_models):
    """kill -9 of the engine core takes its worker along and a fresh group serves; kill -9 of the worker takes the
    engine core along, and again a fresh group serves."""
    _, hf = tiny_models["llama"]
    ref = [hf_greedy(hf, PROMPTS[0])]
    server = healthy(servers, "llama")
    for victim in ("engine", "worker"):
        engine = server.engine_pid
        assert engine is not None
        (worker,) = children(engine)
        subprocess.run(["kill", "-9", str(engine if victim == "engine" else worker)], check=True)
        assert gone(worker) and gone(engine), victim
        replaced(server, engine)
        assert server.engine_pid != engine and len(children(server.engine_pid)) == 1
        assert tiny_greedy_over_http(server, [PROMPTS[0]]) == ref


def test_two_nodes_group_restarts(servers, tiny_models):
    """kill -9 of node 0's engine core ends node 1's worker too (the rendezvous store is gone); node 1 starts a
    fresh one, which joins the new group. kill -9 of node 1's worker: node 1 starts a fresh one, which finds its
    rank held in the old group and reports it broken; node 0's engine core exits and the group restarts."""
    _, hf = tiny_models["qwen2"]
    ref = [hf_greedy(hf, PROMPTS[1])]
    node0, node1 = healthy(servers, "qwen2"), servers[1].node1
    for victim in ("engine", "worker"):
        (worker,) = children(node1.pid)
        engine = node0.engine_pid
        assert engine is not None
        subprocess.run(["kill", "-9", str(engine if victim == "engine" else worker)], check=True)
        assert gone(worker), victim
        replaced(node0, engine)
        assert tiny_greedy_over_http(node0, [PROMPTS[1]]) == ref
        assert node1.poll() is None and children(node1.pid) not in ([], [worker])
