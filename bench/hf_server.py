"""Reference server for bench.compare: transformers `generate` behind a minimal streaming /v1/completions.

Honest and simple on purpose: greedy only, one `generate` call at a time over a naive static batch (whatever is
queued when the model is free, up to --batch-size, left-padded; nothing joins a running batch). Tokens stream per
step through a generate() streamer; the final chunk carries usage (prompt and completion token counts).

python -m bench.hf_server --port 8001 [--dtype bfloat16] [--batch-size 1]
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import logging
import os
import time
import uuid
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import Any

import torch
import uvicorn
from fastapi import FastAPI
from fastapi.responses import JSONResponse, StreamingResponse
from pydantic import BaseModel
from transformers import AutoModelForCausalLM, AutoTokenizer, StoppingCriteria, StoppingCriteriaList
from transformers.generation.streamers import BaseStreamer

from common.model_source import DEFAULT_MODEL_NAME, resolve_model


class CompletionBody(BaseModel):
    model: str | None = None
    prompt: str | list[int]
    max_tokens: int = 16
    stream: bool = False
    stream_options: dict[str, Any] | None = None
    ignore_eos: bool = False
    temperature: float | None = None  # accepted and ignored: this reference server is greedy only


@dataclass
class Job:
    prompt_ids: list[int]
    max_tokens: int
    ignore_eos: bool
    loop: asyncio.AbstractEventLoop
    tokens: asyncio.Queue[int | None] = field(default_factory=asyncio.Queue)  # None: finished
    output_ids: list[int] = field(default_factory=list)
    finish_reason: str | None = None
    cancelled: bool = False

    def push(self, token: int, eos_ids: set[int]) -> None:
        """Called from the generate thread with this row's next token."""
        if self.finish_reason is not None or self.cancelled:
            return  # finished rows keep being decoded (static batch) or padded: their tokens are dropped
        self.output_ids.append(token)
        self.loop.call_soon_threadsafe(self.tokens.put_nowait, token)
        if not self.ignore_eos and token in eos_ids:
            self.finish("stop")
        elif len(self.output_ids) >= self.max_tokens:
            self.finish("length")

    def finish(self, reason: str) -> None:
        if self.finish_reason is None:
            self.finish_reason = reason
            self.loop.call_soon_threadsafe(self.tokens.put_nowait, None)


class _BatchStreamer(BaseStreamer):
    """generate() hands us the prompt first (2-D), then each step's new tokens, one per row (1-D)."""

    def __init__(self, jobs: list[Job], eos_ids: set[int]) -> None:
        self.jobs, self.eos_ids = jobs, eos_ids

    def put(self, value: torch.Tensor) -> None:
        if value.dim() == 1:
            for job, token in zip(self.jobs, value.tolist(), strict=True):
                job.push(token, self.eos_ids)

    def end(self) -> None:
        for job in self.jobs:
            job.finish("length")


class _AllFinished(StoppingCriteria):
    """Per-row stop flags from the jobs themselves: a batch ends as soon as every request in it is done."""

    def __init__(self, jobs: list[Job]) -> None:
        self.jobs = jobs

    def __call__(self, input_ids: torch.Tensor, scores: Any, **kwargs: Any) -> torch.Tensor:
        done = [job.finish_reason is not None or job.cancelled for job in self.jobs]
        return torch.tensor(done, dtype=torch.bool, device=input_ids.device)


class HFGenerator:
    def __init__(self, path: str, dtype: str, batch_size: int, batch_wait_s: float) -> None:
        torch.set_num_threads(len(os.sched_getaffinity(0)))
        self.tokenizer = AutoTokenizer.from_pretrained(path)
        torch_dtype = {"bfloat16": torch.bfloat16, "float32": torch.float32}[dtype]
        self.model = AutoModelForCausalLM.from_pretrained(path, dtype=torch_dtype).eval()
        eos = self.model.generation_config.eos_token_id  # an int, a list, or None
        self.eos_ids = {self.tokenizer.eos_token_id, *(eos if isinstance(eos, list) else [eos])} - {None}
        self.pad_id = self.tokenizer.pad_token_id if self.tokenizer.pad_token_id is not None else 0
        self.batch_size, self.batch_wait_s = batch_size, batch_wait_s
        self.queue: asyncio.Queue[Job] = asyncio.Queue()

    async def run(self) -> None:
        """The one loop that calls generate: a static batch at a time, never two at once."""
        while True:
            batch = [await self.queue.get()]
            deadline = time.monotonic() + self.batch_wait_s
            while len(batch) < self.batch_size and (left := deadline - time.monotonic()) > 0:
                try:
                    job = await asyncio.wait_for(self.queue.get(), left)
                except TimeoutError:
                    break
                batch.append(job)
            # Rows of one generate() share its EOS handling, so ignore_eos requests are batched apart.
            for flag in (True, False):
                if group := [j for j in batch if j.ignore_eos is flag and not j.cancelled]:
                    try:
                        await asyncio.to_thread(self._generate, group)
                    except Exception:  # one bad batch must not stop the loop that serves every later request
                        logging.exception("generate failed")
                        for job in group:
                            job.finish("error")

    def _generate(self, jobs: list[Job]) -> None:
        width = max(len(j.prompt_ids) for j in jobs)
        ids = torch.tensor([[self.pad_id] * (width - len(j.prompt_ids)) + j.prompt_ids for j in jobs])
        mask = torch.tensor([[0] * (width - len(j.prompt_ids)) + [1] * len(j.prompt_ids) for j in jobs])
        max_new = max(j.max_tokens for j in jobs)
        # ignore_eos: forbid EOS until max_new, as bench.offline does for its HF baseline.
        extra = {"min_new_tokens": max_new} if jobs[0].ignore_eos else {}
        with torch.inference_mode():
            self.model.generate(ids, attention_mask=mask, max_new_tokens=max_new, do_sample=False,
                                pad_token_id=self.pad_id, streamer=_BatchStreamer(jobs, self.eos_ids),
                                stopping_criteria=StoppingCriteriaList([_AllFinished(jobs)]), **extra)  # fmt: skip


def create_app(gen: HFGenerator, model_name: str) -> FastAPI:
    @contextlib.asynccontextmanager
    async def lifespan(_: FastAPI) -> AsyncIterator[None]:
        worker = asyncio.create_task(gen.run())
        yield
        worker.cancel()

    app = FastAPI(lifespan=lifespan)

    @app.get("/health")
    async def health() -> dict[str, str]:
        return {"status": "ok"}

    @app.get("/v1/models")
    async def models() -> dict[str, Any]:
        return {"object": "list", "data": [{"id": model_name, "object": "model", "owned_by": "transformers"}]}

    @app.post("/v1/completions")
    async def completions(body: CompletionBody) -> Any:
        ids = body.prompt if isinstance(body.prompt, list) else gen.tokenizer(body.prompt)["input_ids"]
        job = Job(ids, body.max_tokens, body.ignore_eos, asyncio.get_running_loop())
        await gen.queue.put(job)
        head = {"id": f"cmpl-{uuid.uuid4().hex}", "created": int(time.time()), "model": model_name}

        def usage() -> dict[str, int]:
            n_out = len(job.output_ids)
            return {"prompt_tokens": len(ids), "completion_tokens": n_out, "total_tokens": len(ids) + n_out}

        async def events() -> AsyncIterator[str]:
            sent = ""
            try:
                while (await job.tokens.get()) is not None:
                    text = gen.tokenizer.decode(job.output_ids, skip_special_tokens=True)
                    if not text.endswith("\ufffd") and len(text) > len(sent):  # hold back half a character
                        yield _sse({**head, "object": "text_completion", "choices": [
                            {"index": 0, "text": text[len(sent):], "finish_reason": None}]})  # fmt: skip
                        sent = text
                yield _sse({**head, "object": "text_completion", "choices": [
                    {"index": 0, "text": "", "finish_reason": job.finish_reason}]})  # fmt: skip
                if (body.stream_options or {}).get("include_usage"):
                    yield _sse({**head, "object": "text_completion", "choices": [], "usage": usage()})
                yield "data: [DONE]\n\n"
            finally:
                job.cancelled = True  # a disconnected client stops costing decode steps

        if body.stream:
            return StreamingResponse(events(), media_type="text/event-stream")
        async for _ in events():
            pass
        text = gen.tokenizer.decode(job.output_ids, skip_special_tokens=True)
        choice = {"index": 0, "text": text, "finish_reason": job.finish_reason}
        return JSONResponse({**head, "object": "text_completion", "choices": [choice], "usage": usage()})

    return app


def _sse(obj: dict[str, Any]) -> str:
    return f"data: {json.dumps(obj)}\n\n"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=8001)
    parser.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32"])
    parser.add_argument("--batch-size", type=int, default=1, help="most requests in one static batch")
    parser.add_argument("--batch-wait-ms", type=float, default=20.0, help="how long a batch waits to fill")
    args = parser.parse_args()
    gen = HFGenerator(str(resolve_model(None).path), args.dtype, args.batch_size, args.batch_wait_ms / 1000)
    uvicorn.run(create_app(gen, DEFAULT_MODEL_NAME), host=args.host, port=args.port, log_level="warning")


if __name__ == "__main__":
    main()
