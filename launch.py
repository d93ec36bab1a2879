"""python launch.py: spawn the engine core, gate on its EngineReady, serve the API, restart a dead engine, drain.

Process layout: this process (API + ZMQ sockets, never imports torch) -> one child per engine core (one, or
--data-parallel-size of them, each on its own cores or GPU). uvicorn runs
in this process's event loop next to the engine client, so "the API server died" and "launch.py exits" are one
event: the engine is stopped, the ipc files removed, and the exit code says which way it went. A dead or hung
engine is replaced (epoch + 1) while --max-engine-restarts per --engine-restart-window allows (each engine has its
own budget); past that the engine is retired, and once none is left the server stops with exit code 1.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import logging
import os
import signal
import socket
import sys
from pathlib import Path

import uvicorn

from common import ipc, vllm_flags
from common.config import EngineConfig, ServerConfig, SpeculativeConfig, add_cli_args, check_max_logprobs, from_cli_args
from common.lora import LoraModule, lora_modules
from common.model_source import ModelSourceError, is_model_path, parse_hf_overrides, resolve_model, tokenizer_dir
from common.pooling import read_pooling
from common.vllm_flags import VllmFlags
from engine_core.tp_procs import layout as tp_layout
from engine_core.tp_procs import run_node_agent
from frontend.api.api_server import create_app
from frontend.api.conversations import ConversationStore
from frontend.api.http_options import check_http_flags, http_options
from frontend.api.lora_adapters import LoraRegistry, runtime_updates_allowed
from frontend.api.responses_store import ResponseStore
from frontend.api.sampling_defaults import GenerationConfigError, load_sampling_defaults
from frontend.api.serving import ServingContext
from frontend.engine.engine_client import AsyncEngineClient, supervisors
from frontend.engine.engine_handle import EngineHandle
from frontend.engine.spawn import EngineStartError
from frontend.engine.supervisor import RestartBudget
from frontend.metrics import Metrics
from frontend.request_log import RequestLog
from frontend.stats_log import StatsLog
from frontend.text.tokenizer import Tokenizer, TokenizerError
from frontend.tools.reasoning import ReasoningTokens, thinking_tokens

log = logging.getLogger("roseinfer.launch")


def parse_args(argv: list[str] | None = None) -> tuple[EngineConfig, ServerConfig]:
    parser = argparse.ArgumentParser(prog="python launch.py", description="OpenAI-compatible roseinfer server")
    parser.add_argument("model_tag", nargs="?", help="the model, first, as `vllm serve MODEL` takes it (or --model)")
    add_cli_args(parser, EngineConfig)
    add_cli_args(parser, ServerConfig)
    add_cli_args(parser, VllmFlags)  # vLLM's flags with no setting of their own here
    ns = parser.parse_args(argv)
    vllm_flags.fold_into(parser, ns)
    if ns.model_tag is not None:
        if ns.model not in (None, ns.model_tag):
            parser.error(f"the model is given twice: {ns.model_tag} and --model {ns.model}")
        ns.model = ns.model_tag
    elif ns.model is None and (path := next(filter(is_model_path, ns.served_model_name), None)):
        # `--served-model-name a ./model` takes the model as a second name and would serve the default model
        parser.error(f"{path} is a path, taken as a --served-model-name: put the model first (python launch.py "
                     f"{path} --served-model-name ...) or give it with --model")  # fmt: skip
    try:
        check_max_logprobs(ns.max_logprobs)
    except ValueError as exc:
        parser.error(str(exc))
    if ns.api_key is None:  # a key in the environment stays out of the process list
        ns.api_key = os.environ.get("ROSEINFER_API_KEY") or os.environ.get("VLLM_API_KEY")
    return from_cli_args(EngineConfig, ns), from_cli_args(ServerConfig, ns)


class _Server(uvicorn.Server):
    """uvicorn minus its signal handlers: launch.py owns SIGINT/SIGTERM (uvicorn would re-raise them at exit)."""

    @contextlib.contextmanager
    def capture_signals(self):  # type: ignore[override]
        yield


def bind_http(host: str, port: int) -> socket.socket:
    """Bound before the engine loads, so a taken port fails in a second, not after the model is up."""
    sock = socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind((host, port))
    except OSError:
        sock.close()
        raise
    return sock


class Launch:
    def __init__(self, engine_config: EngineConfig, config: ServerConfig, adapters: list[LoraModule]) -> None:
        self.engine_config = engine_config
        self.config = config
        self.adapters = adapters  # --lora-modules, checked
        addresses = ipc.Addresses.new_ipc()
        spares = config.engine_spare and config.max_engine_restarts > 0  # a spare only ever serves a restart
        self.client = AsyncEngineClient(addresses,
                                        supervisors(engine_config, addresses, config.data_parallel_size, spares),
                                        config.engine_ping_timeout, config.max_queued_requests)  # fmt: skip
        # --max-engine-restarts 0: a dead engine fails what is in flight and /health stays 503 (for an outer
        # supervisor to act on); otherwise unfinished requests wait for the replacement and resume.
        self.client.resumable = config.max_engine_restarts > 0
        self.client.restart_timeout = config.engine_restart_timeout
        self.client.pacing.per_token_streams = max(1, config.stream_merge_above)
        self.client.pacing.max_hold_s = config.stream_max_hold
        self.stopping = asyncio.Event()
        self.server: _Server | None = None
        self.exit_code: int | None = None  # set when the server stops itself
        self.tasks: list[asyncio.Task] = []  # engine supervision, the stats line: cancelled at exit

    def on_signal(self, sig: signal.Signals) -> None:
        if self.stopping.is_set():  # a second signal: stop waiting for in-flight requests
            log.warning("%s again: ending in-flight requests now", sig.name)
            self.client.fail_all("the server is shutting down")
            if self.server is not None:
                self.server.force_exit = True
            return
        log.info("%s: no new connections; in-flight requests get %g s to finish", sig.name, self.config.drain_timeout)
        self.stopping.set()
        if self.server is not None:
            self.server.should_exit = True
            asyncio.get_running_loop().call_later(self.config.drain_timeout, self.client.fail_all,
                                                  "the server is shutting down")  # fmt: skip

    async def run(self) -> int:
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGINT, signal.SIGTERM):
            loop.add_signal_handler(sig, self.on_signal, sig)
        try:
            http = bind_http(self.config.host, self.config.port)
        except OSError as exc:
            print(f"error: cannot listen on {self.config.host}:{self.config.port}: {exc}", file=sys.stderr)
            await self.client.close()
            return 1
        if self.client.resumable:
            self.tasks.append(asyncio.create_task(self._supervise()))
        try:
            return await self._run(http)
        except (EngineStartError, ModelSourceError, TokenizerError, GenerationConfigError) as exc:
            print(f"error: {exc}", file=sys.stderr)
            return 1
        finally:
            http.close()
            for task in self.tasks:
                task.cancel()
                with contextlib.suppress(asyncio.CancelledError):
                    await task
            await self.client.close()  # stops the engine core, removes the ipc files

    async def _supervise(self) -> None:
        """Each engine is replaced while its budget allows; past it, it is retired (its requests failed). Once no
        engine is left, the server stops with exit code 1."""
        handles = self.client.handles
        for handle in handles:
            handle.budget = RestartBudget(self.config.max_engine_restarts, self.config.engine_restart_window)
        jobs = {asyncio.ensure_future(h.supervise(self.config.engine_ready_timeout, self.stopping)): h for h in handles}
        try:
            await self._retire(jobs)
        finally:
            for job in jobs:
                job.cancel()

    async def _retire(self, jobs: dict[asyncio.Future, EngineHandle]) -> None:
        handles = self.client.handles
        while jobs:
            done, _ = await asyncio.wait(jobs, return_when=asyncio.FIRST_COMPLETED)
            for job in done:
                handle, cause = jobs.pop(job), job.result()
                if cause is None:
                    continue
                if any(not h.life.retired for h in handles if h is not handle):
                    log.error("%s retired: %s; the other engines serve on", handle.label, cause)
                    handle.life.give_up(f"{cause}; the {handle.label} keeps failing and is retired")
                    continue
                log.error("engine core down: %s; no engine left: stopping the server", cause)
                handle.life.give_up(f"{cause}; the engine core keeps failing and the server is stopping")
                self.exit_code = 1
                self.stopping.set()
                if self.server is not None:
                    self.server.should_exit = True

    async def _run(self, http: socket.socket) -> int:
        starting = asyncio.ensure_future(self.client.start(self.config.engine_ready_timeout))
        stop_wait = asyncio.ensure_future(self.stopping.wait())
        await asyncio.wait({starting, stop_wait}, return_when=asyncio.FIRST_COMPLETED)
        stop_wait.cancel()
        if not starting.done():  # a signal while the engine loads: just stop
            starting.cancel()
            return 0
        ready = starting.result()
        # After EngineReady: the engine resolved (and for a .gguf, converted) the model, so this is a cache hit.
        overrides = parse_hf_overrides(self.engine_config.hf_overrides)
        source = resolve_model(self.engine_config.model, overrides=overrides, tokenizer=self.engine_config.tokenizer)
        pooling = read_pooling(source.path, overrides) if ready.runner == "pooling" else None
        names = list(dict.fromkeys(self.config.served_model_name)) or [ready.model]  # each once, in order
        loras = LoraRegistry(self.adapters, self.engine_config.enable_lora, self.engine_config.max_lora_rank,
                             runtime_updates_allowed())  # fmt: skip
        if loras.runtime_updates:
            log.warning("LoRA adapters can be loaded and unloaded at run time (VLLM_ALLOW_RUNTIME_LORA_UPDATING): "
                        "whoever can call the API can make the server read a directory of their choice")
        if taken := [name for name in names if name in loras.refs]:
            print(f"error: --lora-modules: the adapter name {taken[0]!r} is the base model's name", file=sys.stderr)
            return 2
        metrics = Metrics(names[0], len(self.client.handles), lora=loras.enabled, prefix=self.config.metrics_prefix)
        self.client.metrics = metrics
        tokenizer = Tokenizer(source.tokenizer, parse_special_in_content=self.config.parse_special_tokens_in_content,
                              chat_template=self.config.chat_template)  # fmt: skip
        if tokenizer.vocab_size > ready.vocab_size:  # a --tokenizer of another model: its last ids have no embedding
            log.warning("the tokenizer (%s) has %d tokens, the model %d: prompts holding the others are refused",
                        source.tokenizer, tokenizer.vocab_size, ready.vocab_size)  # fmt: skip
        defaults = load_sampling_defaults(source.path, self.config.generation_config,
                                          self.config.override_generation_config)  # fmt: skip
        if overridden := defaults.overridden():  # said at start, as vLLM does: not the API's usual defaults
            log.warning("sampling defaults from the generation config (--generation-config vllm: none): %s", overridden)
        thinking = thinking_tokens(self.config.reasoning_parser, tokenizer)
        if self.config.reasoning_parser and thinking is None:
            log.warning("--reasoning-parser: <think> and </think> are not tokens of their own in this tokenizer, so a "
                        "grammar (response format, forced call) holds a whole answer, which is not split")
        ctx = ServingContext(self.client, tokenizer, names[0], ready.max_model_len, ready.vocab_size,
                             tool_call_parser=self.config.tool_call_parser,
                             reasoning_parser=self.config.reasoning_parser, thinking=thinking,
                             reasoning_tokens=ReasoningTokens.of(self.config.reasoning_parser, tokenizer),
                             priority_scheduling=self.engine_config.scheduling_policy == "priority",
                             sampling_defaults=defaults, loras=loras, model_aliases=tuple(names[1:]),
                             pooling=pooling, pair_template=self.config.chat_template is not None,
                             prompt_tokens_details=self.config.enable_prompt_tokens_details,
                             max_logprobs=self.engine_config.logprobs_limit(ready.vocab_size),
                             tokens_as_ids=self.config.return_tokens_as_token_ids,
                             responses=ResponseStore(self.config.responses_store_mib << 20),
                             conversations=ConversationStore(self.config.responses_store_mib << 20))  # fmt: skip
        app = create_app(ctx, self.config, metrics)
        self.server = _Server(uvicorn.Config(app, host=self.config.host, port=self.config.port, lifespan="off",
                                             timeout_graceful_shutdown=int(self.config.drain_timeout) + 5,
                                             **http_options(self.config)))  # fmt: skip
        request_log = RequestLog(lambda ids: tokenizer.decode(ids, False), self.config.max_log_len)
        if self.config.enable_log_requests and not self.config.disable_log_requests:
            self.client.request_log = request_log
        if self.config.enable_log_outputs:
            self.client.output_log = request_log.output
        if not self.config.disable_log_stats:
            stats = StatsLog(metrics, len(self.client.handles), lambda: self.client.refresh_stats(timeout=1.0))
            self.tasks.append(asyncio.create_task(stats.run()))
        if self.stopping.is_set():
            return self.exit_code or 0
        host, port = http.getsockname()[:2]  # uvicorn says nothing of a socket handed to it; --port 0 picks one
        log.info("serving %s on %s://%s:%d", names[0], "https" if self.config.ssl_certfile else "http",
                 f"[{host}]" if ":" in host else host, port)  # fmt: skip
        try:
            await self.server.serve(sockets=[http])
        except SystemExit as exc:  # uvicorn could not start: it logged why
            log.error("API server failed to start (exit %s)", exc.code)
            return 1
        if self.exit_code is not None:
            return self.exit_code
        if not self.stopping.is_set():
            log.error("API server stopped on its own")
            return 1
        return 0


def main(argv: list[str] | None = None) -> int:
    engine_config, config = parse_args(argv)
    logging.basicConfig(level=config.log_level.upper(), format="%(asctime)s %(name)s %(levelname)s %(message)s")
    try:
        tp_layout(engine_config)
        parse_hf_overrides(engine_config.hf_overrides)  # bad JSON fails here, before the engine loads
        tokenizer_dir(engine_config.tokenizer)  # likewise a --tokenizer that is not one
        SpeculativeConfig.parse(engine_config.speculative_config)  # a bad one fails here, before the engine loads
        adapters = lora_modules(engine_config)  # each adapter's config, likewise
        # The flags' own generation config and override, checked before the engine loads (the model's, once it has)
        gen = "vllm" if config.generation_config == "auto" else config.generation_config
        load_sampling_defaults(Path(), gen, config.override_generation_config)
        if config.enable_auto_tool_choice and config.tool_call_parser is None:  # vLLM refuses this too
            raise ValueError("--enable-auto-tool-choice needs --tool-call-parser (hermes, llama3_json, pythonic, "
                             "mistral)")
        if engine_config.nnodes > 1 and config.data_parallel_size > 1:  # the engine cores would share one port
            raise ValueError("--data-parallel-size > 1 with --nnodes > 1 is not supported")
        check_http_flags(config)
    except (ValueError, ModelSourceError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    if engine_config.node_rank > 0:  # another node of a multi-node group: its tensor-parallel workers, no API
        return run_node_agent(engine_config)

    async def run() -> int:  # the sockets and tasks belong to this loop
        return await Launch(engine_config, config, adapters).run()

    return asyncio.run(run())


if __name__ == "__main__":
    sys.exit(main())
