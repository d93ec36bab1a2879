"""Constrained decoding with xgrammar: grammars compiled on a background thread, a matcher per request, and the
batched token mask the sampler applies to the constrained rows of a step.

Life of a constrained request: `GrammarService.attach` starts (or reuses) the compile of its (kind, spec); the
scheduler keeps it out of the queue until `release` finds the grammar ready, so it holds back nobody; its matcher
then replays any tokens it already streamed (a resume after an engine crash). Each step `apply_masks` limits its
logits row to the tokens the grammar allows; after sampling, `RequestGrammar.advance` feeds the matcher the token
and finishes the request with STOP as soon as the grammar allows nothing but the end (or its stop token came).
Preemption keeps the matcher: only KV blocks are recomputed, the tokens and so the grammar state stay.

A reasoning model thinks first (StructuredOutput.reasoning_end): its rows go unmasked, and its matcher takes no
token, until the end of the thinking; where thinking is optional (reasoning_start), the first token may be the
grammar's or the start of the thinking.
"""

from __future__ import annotations

import concurrent.futures as cf
import logging
import threading
from collections import OrderedDict
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from common.messages import FinishReason, StructuredOutput
from common.structured import INVALID_CONSTRAINT, MAX_SPEC_CHARS, error_text, grammar_of
from engine_core.transfer import to_device

if TYPE_CHECKING:
    from engine_core.request import Request

log = logging.getLogger("roseinfer.engine")
Ending = tuple[FinishReason, str | None, str | None]  # how a request ends before it runs: reason, error, code
CACHE_ENTRIES = 256  # compiled grammars kept (tool schemas repeat request after request)
IDLE_WAIT_S = 0.02  # how long an otherwise idle engine sleeps on a compile instead of spinning


class GrammarService:
    """One per engine: the tokenizer's xgrammar view (built once, on first use) and the compile cache."""

    def __init__(self, model_path: Path, vocab_size: int, stop_token_ids: list[int]) -> None:
        self.model_path = model_path
        self.vocab_size = vocab_size  # the logits' width, which may exceed the tokenizer's
        self.stop_token_ids = stop_token_ids
        self._pool = cf.ThreadPoolExecutor(1, thread_name_prefix="grammar")  # xgrammar compiles without the GIL
        self._compiler: Any = None  # xgrammar.GrammarCompiler, made on the pool's thread
        self._cache: OrderedDict[tuple[str, str], cf.Future] = OrderedDict()
        self._lock = threading.Lock()

    def attach(self, req: Request) -> Request:
        so = req.params.structured
        if so is not None:
            req.grammar = RequestGrammar(self._compiled(so), self, so)
        return req

    def _compiled(self, so: StructuredOutput) -> cf.Future:
        key = (so.kind, so.spec)
        with self._lock:
            future = self._cache.get(key)
            if future is None:
                future = self._cache[key] = self._pool.submit(self._compile, so)
                while len(self._cache) > CACHE_ENTRIES:
                    self._cache.popitem(last=False)
            self._cache.move_to_end(key)
            return future

    def _compile(self, so: StructuredOutput) -> Any:
        if len(so.spec) > MAX_SPEC_CHARS:  # the API refuses these; the engine checks every field again
            raise ValueError(f"the specification is longer than {MAX_SPEC_CHARS} characters")
        if self._compiler is None:
            import xgrammar as xgr
            from transformers import AutoTokenizer

            tokenizer = AutoTokenizer.from_pretrained(self.model_path)
            info = xgr.TokenizerInfo.from_huggingface(tokenizer, vocab_size=self.vocab_size,
                                                      stop_token_ids=self.stop_token_ids or None)  # fmt: skip
            self._compiler = xgr.GrammarCompiler(info, max_threads=2)
        return self._compiler.compile_grammar(grammar_of(so))


class RequestGrammar:
    """One request's grammar: its compile (a future) until ready, then its matcher."""

    __slots__ = ("future", "service", "matcher", "stop_ids", "phase", "think_start", "think_end")

    def __init__(self, future: cf.Future, service: GrammarService, so: StructuredOutput) -> None:
        self.future = future
        self.service = service
        self.matcher: Any = None
        self.stop_ids: list[int] = []
        self.think_start, self.think_end = so.reasoning_start, so.reasoning_end
        # "held": the grammar masks every token; "thinking": none, until think_end; "open": the first token, which
        # the grammar masks but may also be think_start
        self.phase = "held" if self.think_end is None else "thinking" if self.think_start is None else "open"

    @property
    def masks(self) -> bool:
        return self.phase != "thinking"

    def start(self, req: Request) -> Ending | None:
        """Makes the matcher once the grammar is compiled and replays the request's outputs so far. None: it
        may run; otherwise how it ends without running (compile error, or its outputs already end the grammar)."""
        import xgrammar as xgr

        try:
            compiled = self.future.result()
        except Exception as exc:
            log.info("grammar for request %s failed to compile: %s", req.request_id, exc)
            error = f"the structured output constraint could not be compiled: {error_text(exc)}"
            return FinishReason.ERROR, error, INVALID_CONSTRAINT
        # The request's own EOS ids end the grammar, so that its finish is the one check_stop reports.
        self.stop_ids = sorted(req.eos_token_ids) or list(self.service.stop_token_ids)
        self.matcher = xgr.GrammarMatcher(compiled, override_stop_tokens=self.stop_ids or None)
        for token in req.output_token_ids:
            reason = self.advance(token, None)
            if reason is not None:
                error = None if reason == FinishReason.STOP else "resumed output does not match the grammar"
                return reason, error, None
        if not self._allowed().any():  # {"$ref": "#"} compiles, and matches nothing
            return FinishReason.ERROR, "the structured output constraint matches no text at all", INVALID_CONSTRAINT
        return None

    def advance(self, token: int, reason: FinishReason | None) -> FinishReason | None:
        """The matcher takes the sampled token; returns the request's finish reason, given check_stop's."""
        if self.phase == "thinking":
            if token == self.think_end:
                self.phase = "held"
            return reason
        if self.phase == "open":  # the answer's first token: the start of its thinking, or the grammar's
            if token == self.think_start:
                self.phase = "thinking"
                return reason
            self.phase = "held"
        if not self.matcher.accept_token(token):
            return FinishReason.ERROR  # only when the mask was not applied: a bug, not the user's fault
        if self.matcher.is_terminated() or (self.matcher.is_completed() and self._only_stop_allowed()):
            return FinishReason.STOP
        return reason

    def failure(self) -> tuple[str, str | None]:
        """(error, error code) of a request that advance() failed. A grammar that allows no token where the output
        stands has no text to finish with (`root ::= "a" x  x ::= x "b"` after "a"): the request's constraint is at
        fault, a 400 like a compile error. Otherwise the sampler drew a token the mask forbade: ours."""
        if not self._allowed().any():
            return "the structured output constraint allows no token after this output: no text completes it", \
                INVALID_CONSTRAINT  # fmt: skip
        return "sampled token rejected by the grammar", None

    def _allowed(self) -> torch.Tensor:
        """[vocab] True for each token the grammar allows next."""
        import xgrammar as xgr

        bitmask = xgr.allocate_token_bitmask(1, self.service.vocab_size)
        self.matcher.fill_next_token_bitmask(bitmask)
        return _unpack(bitmask[0], self.service.vocab_size)

    def _only_stop_allowed(self) -> bool:
        """Whether the grammar is over: nothing but a stop token may follow (JSON after its last brace)."""
        allowed = self._allowed()
        allowed[self.stop_ids] = False
        return not bool(allowed.any())


def _bit(n: int) -> int:
    """Bit n of an int32 word, as the signed value torch stores it."""
    return 1 << n if n < 31 else -(2**31)


def _unpack(words: torch.Tensor, vocab_size: int) -> torch.Tensor:
    bits = (words[:, None] >> torch.arange(32, dtype=torch.int32)) & 1
    return bits.flatten()[:vocab_size].bool()


def release(gated: list[Request], wait: bool) -> tuple[list[Request], list[tuple[Request, Ending]], list[Request]]:
    """Splits the requests waiting for a grammar into (ready to queue, ended, still compiling); aborted ones drop.
    With `wait` (nothing else to run) it first sleeps briefly on the compiles, so the engine loop does not spin."""
    live = [r for r in gated if not r.finished]
    if wait and live:
        cf.wait([r.grammar.future for r in live], timeout=IDLE_WAIT_S, return_when=cf.FIRST_COMPLETED)
    ready, ended, pending = [], [], []
    for req in live:
        if not req.grammar.future.done():
            pending.append(req)
            continue
        try:
            end = req.grammar.start(req)
        except Exception as exc:  # a matcher that cannot be made fails its request, never the engine
            log.exception("grammar matcher for request %s", req.request_id)
            end = FinishReason.ERROR, f"the structured output constraint failed: {error_text(exc)}", None
        if end is None:
            ready.append(req)
        else:
            ended.append((req, end))
    return ready, ended, pending


_batch_matcher: Any = None


def apply_masks(logits: torch.Tensor, raw: torch.Tensor, requests: list[Request]) -> None:
    """Sets every token the grammar forbids to -inf, on the constrained rows only, all rows in one bitmask. A request
    that has finished (a step sampled after its last one's update: engine_core/overlap.py) is left alone: its
    matcher may have terminated, and its token is dropped."""
    global _batch_matcher
    rows = [i for i, r in enumerate(requests) if r.grammar is not None and r.grammar.masks and not r.finished]
    if not rows:
        return
    import xgrammar as xgr

    if _batch_matcher is None:
        _batch_matcher = xgr.BatchGrammarMatcher(max_threads=2)
    host_mask = xgr.allocate_token_bitmask(len(requests), logits.shape[-1])
    _batch_matcher.batch_fill_next_token_bitmask([requests[i].grammar.matcher for i in rows], host_mask, indices=rows)
    for i in rows:  # an optional thinking may start instead
        if (start := requests[i].grammar.think_start) is not None and requests[i].grammar.phase == "open":
            host_mask[i, start // 32] |= _bit(start % 32)
    bitmask = to_device(host_mask.numpy(), logits.device, torch.int32)
    xgr.apply_token_bitmask_inplace(logits, bitmask, indices=rows)
    # A processor may have banned every token the grammar allows (allowed_token_ids or bad_words that leave none of
    # them): the grammar wins, over the model's own logits. Found without reading the device, which would wait for
    # the step's forward (engine_core/overlap.py samples a launched step so); on the host, where the check is free,
    # only when some row needs it.
    index = to_device(rows, logits.device, torch.long)
    masked = logits[index]
    dead = torch.isneginf(masked).all(dim=-1, keepdim=True)
    if logits.device.type != "cuda" and not bool(dead.any()):
        return
    fallback = raw[index].to(logits.dtype)
    xgr.apply_token_bitmask_inplace(fallback, bitmask[index])
    logits[index] = torch.where(dead, fallback, masked)
