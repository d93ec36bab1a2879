"""SchedulerOutput and SampledTokens: one step's batch, as the scheduler builds it and the runner answers it."""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from common.messages import Logprobs
from engine_core.request import Request


@dataclass
class SchedulerOutput:
    """The batch of one step, decodes first (the runner's decode path relies on it): the entries whose positions are
    outputs (`decodes`), whose every token is a decode row."""

    requests: list[Request] = field(default_factory=list)
    num_new_tokens: list[int] = field(default_factory=list)
    # Whether an entry reaches the end of its tokens this step, so that its last position is sampled.
    sample: list[bool] = field(default_factory=list)
    # How far past its request's num_computed_tokens an entry starts: the tokens that the step in flight computes
    # for it (engine_core/overlap.py), whose update has not counted them yet. 0 in synchronous steps.
    ahead: list[int] = field(default_factory=list)

    @property
    def total_tokens(self) -> int:
        return sum(self.num_new_tokens)

    def add(self, req: Request, n: int, ahead: int = 0, sample: bool | None = None) -> None:
        """n counts the request's draft tokens (engine_core/speculative.py) too: each is one more decode row. sample:
        by default, whether the entry reaches the request's last token."""
        self.requests.append(req)
        self.num_new_tokens.append(n)
        self.ahead.append(ahead)
        if sample is None:
            sample = req.num_computed_tokens + ahead + n - len(req.draft_token_ids) == req.num_tokens
        self.sample.append(sample)

    def start(self, i: int) -> int:
        """The position entry i starts at."""
        return self.requests[i].num_computed_tokens + self.ahead[i]

    def decodes(self, i: int) -> bool:
        """Whether entry i's positions are outputs (Request.decoding, as of this step)."""
        return self.start(i) >= self.requests[i].num_prompt_tokens

    def in_flight_input(self, i: int) -> bool:
        """Whether entry i's input is the token that the step in flight samples, on the device only."""
        return self.start(i) == self.requests[i].num_tokens

    @property
    def sampled_requests(self) -> list[Request]:
        """The requests of the sampled entries, in order: one token row each (drafts aside)."""
        return [r for r, s in zip(self.requests, self.sample, strict=True) if s]

    def part(self, rows: slice) -> SchedulerOutput:
        return SchedulerOutput(self.requests[rows], self.num_new_tokens[rows], self.sample[rows], self.ahead[rows])

    def put_decodes_first(self) -> None:
        order = sorted(range(len(self.requests)), key=lambda i: not self.decodes(i))
        for name in ("requests", "num_new_tokens", "sample", "ahead"):
            values = getattr(self, name)
            setattr(self, name, [values[i] for i in order])


@dataclass
class SampledTokens:
    token_ids: list[int]  # one per sampled entry of the SchedulerOutput, in order (1 + its drafts for a draft's)
    logprobs: list[Logprobs | None]


@dataclass
class LogprobRows:
    """A step's logprobs as tensors: each sampled token's, and each row's top n (n: the most any row asked for)."""

    chosen: torch.Tensor  # [rows]
    top_ids: torch.Tensor | None  # [rows, n]; None where no row asked for alternatives
    top_values: torch.Tensor | None
    wanted: list[int | None]  # each row's n; None: no logprobs for it

    def to_host(self) -> LogprobRows:
        """Copies queued into pinned host memory, without waiting: valid once the step's event has passed."""
        return LogprobRows(*(_to_pinned(t) for t in (self.chosen, self.top_ids, self.top_values)), self.wanted)

    def to_lists(self) -> list[Logprobs | None]:
        chosen = self.chosen.tolist()
        ids = self.top_ids.tolist() if self.top_ids is not None else None
        values = self.top_values.tolist() if self.top_values is not None else None
        return [None if n is None else Logprobs([chosen[i]], [ids[i][:n] if ids and n else []],
                                                [values[i][:n] if values and n else []])
                for i, n in enumerate(self.wanted)]  # fmt: skip


def _to_pinned(t: torch.Tensor | None) -> torch.Tensor | None:
    if t is None or t.device.type != "cuda":
        return t
    host = torch.empty(t.shape, dtype=t.dtype, pin_memory=True)
    return host.copy_(t, non_blocking=True)


@dataclass
class InFlight:
    """A launched step whose tokens are still being computed (engine_core/overlap.py)."""

    sched: SchedulerOutput
    started: float  # perf_counter at launch
    # The sampled rows' logits while their sampling waits for the update of the step before (ModelRunner.sample_late)
    logits: torch.Tensor | None = None
    tokens: torch.Tensor | None = None  # [n] sampled token ids, on the device
    host: torch.Tensor | None = None  # their copy in pinned host memory, valid once `done` has passed
    logprobs: LogprobRows | None = None  # the rows' logprobs, on the host as `host` is; None where no row asked
    done: torch.cuda.Event | None = None  # None on the CPU, where the step ran synchronously

    def record(self, tokens: torch.Tensor, logprobs: LogprobRows | None) -> None:
        """Takes the sampled tokens: their copies to the host are queued, and an event marks when they are there."""
        self.logits, self.tokens = None, tokens
        if tokens.device.type != "cuda":
            self.host, self.logprobs = tokens, logprobs
            return
        self.host, self.logprobs = _to_pinned(tokens), logprobs.to_host() if logprobs is not None else None
        self.done = torch.cuda.Event()
        self.done.record()

    def result(self) -> SampledTokens:
        """Waits for the step's tokens (the only wait of an overlapped step)."""
        assert self.host is not None, "a step whose sampling never ran"
        if self.done is not None:
            self.done.synchronize()
        logprobs = self.logprobs.to_lists() if self.logprobs is not None else [None] * len(self.sched.requests)
        return SampledTokens(self.host.tolist(), logprobs)
