"""SchedulerOutput and SampledTokens: one step's batch, as the scheduler builds it and the runner answers it."""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from common.messages import Logprobs
from engine_core.request import Request


@dataclass
class SchedulerOutput:
    """The batch of one step, decodes first (the runner's decode path relies on it): the entries of requests whose
    next positions are outputs (Request.decoding), whose every token is a decode row."""

    requests: list[Request] = field(default_factory=list)
    num_new_tokens: list[int] = field(default_factory=list)
    # Whether an entry reaches the end of its tokens this step, so that its last position is sampled.
    sample: list[bool] = field(default_factory=list)

    @property
    def total_tokens(self) -> int:
        return sum(self.num_new_tokens)

    def add(self, req: Request, n: int) -> None:
        """n counts the request's draft tokens (engine_core/speculative.py) too: each is one more decode row."""
        self.requests.append(req)
        self.num_new_tokens.append(n)
        self.sample.append(req.num_computed_tokens + n - len(req.draft_token_ids) == req.num_tokens)

    def put_decodes_first(self) -> None:
        order = sorted(range(len(self.requests)), key=lambda i: not self.requests[i].decoding)
        self.requests = [self.requests[i] for i in order]
        self.num_new_tokens = [self.num_new_tokens[i] for i in order]
        self.sample = [self.sample[i] for i in order]


@dataclass
class SampledTokens:
    token_ids: list[int]  # one per sampled entry of the SchedulerOutput, in order (1 + its drafts for a draft's)
    logprobs: list[Logprobs | None]


@dataclass
class InFlight:
    """A launched decode step whose tokens are still being computed (engine_core/overlap.py)."""

    sched: SchedulerOutput
    tokens: torch.Tensor  # [n] sampled token ids, on the device
    host: torch.Tensor  # their copy in pinned host memory, valid once `done` has passed
    done: torch.cuda.Event | None  # None on the CPU, where the step ran synchronously
    started: float  # perf_counter at launch

    @staticmethod
    def start(sched: SchedulerOutput, tokens: torch.Tensor, started: float) -> InFlight:
        if tokens.device.type != "cuda":
            return InFlight(sched, tokens, tokens, None, started)
        host = torch.empty(tokens.shape, dtype=tokens.dtype, pin_memory=True)
        host.copy_(tokens, non_blocking=True)
        done = torch.cuda.Event()
        done.record()
        return InFlight(sched, tokens, host, done, started)

    def result(self) -> SampledTokens:
        """Waits for the step's tokens (the only wait of an overlapped step)."""
        if self.done is not None:
            self.done.synchronize()
        return SampledTokens(self.host.tolist(), [None] * len(self.sched.requests))
