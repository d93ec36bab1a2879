"""PrefixRouter: which data-parallel engine gets a request: the one that holds its prompt's prefix, unless another
is so much less loaded that computing the prefix again there is cheaper."""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Sequence
from typing import Protocol, TypeVar

MAX_ENTRIES = 1 << 16  # block hashes remembered (LRU): about 8 MB at most
MAX_BLOCKS = 256  # full blocks hashed per prompt: bounds the work for a huge prompt


class Routable(Protocol):
    index: int

    @property
    def load(self) -> int: ...


E = TypeVar("E", bound=Routable)


class PrefixRouter:
    """Prefix-cache affinity on the API side. A prompt's full KV blocks are hashed as a chain (block i's hash covers
    blocks 0..i, as the engine's prefix cache keys them), and each hash remembers the engines that were sent it: a
    bit mask, since a popular prefix (a system prompt) lives in several caches. The choice minimises
    load + uncached prompt tokens: the tokens the engine has in flight plus those it would have to prefill anew.
    So two requests with a long shared prefix meet on one engine, while a short shared prefix (a chat template's
    system prompt) weighs little against the load and requests still spread. The engines' own caches may have
    evicted a block since: the table is a guess, and a wrong guess only costs a prefill, as without routing."""

    def __init__(self, block_size: int, max_entries: int = MAX_ENTRIES, max_blocks: int = MAX_BLOCKS) -> None:
        self.block_size = block_size
        self.max_entries = max_entries
        self.max_blocks = max_blocks
        self._engines: OrderedDict[int, int] = OrderedDict()  # chain hash -> bit mask of engine indices

    def block_hashes(self, prompt: Sequence[int], scope: tuple[int, str] = (0, "")) -> list[int]:
        # The engine caches a prompt's full blocks but the last token's (it must compute the first output's logits),
        # each under the LoRA adapter that computed it and the request's cache_salt: `scope`.
        n = min((len(prompt) - 1) // self.block_size, self.max_blocks)
        hashes, h = [], hash(scope) if any(scope) else 0
        for i in range(n):
            h = hash((h, tuple(prompt[i * self.block_size : (i + 1) * self.block_size])))
            hashes.append(h)
        return hashes

    def choose(self, prompt: Sequence[int], engines: Sequence[E], scope: tuple[int, str] = (0, "")) -> E:
        """The engine for `prompt` (its LoRA adapter and cache_salt: `scope`) among `engines` (those that take new
        requests now); remembers the choice."""
        hashes = self.block_hashes(prompt, scope)
        masks = [self._engines.get(h, 0) for h in hashes]

        def cost(engine: E) -> tuple[int, int]:
            bit, cached = 1 << engine.index, 0
            for mask in masks:
                if not mask & bit:
                    break
                cached += self.block_size
            return engine.load + len(prompt) - cached, engine.index

        best = min(engines, key=cost)
        self._remember(hashes, best.index)
        return best

    def _remember(self, hashes: list[int], index: int) -> None:
        bit = 1 << index
        for h in hashes:
            self._engines[h] = self._engines.get(h, 0) | bit
            self._engines.move_to_end(h)
        while len(self._engines) > self.max_entries:
            self._engines.popitem(last=False)

    def forget(self, index: int) -> None:
        """Engine `index` restarted with an empty cache."""
        bit = 1 << index
        for h, mask in list(self._engines.items()):
            if mask & bit:
                if mask == bit:
                    del self._engines[h]
                else:
                    self._engines[h] = mask & ~bit
