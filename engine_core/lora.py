"""LoRA adapters on the model's linear layers (vLLM's --enable-lora). The adapters of --lora-modules load at start,
others when first named (a runtime load); each stays resident until unloaded. A layer an adapter changes is wrapped
in a LoraLinear that holds each adapter's A and B, and a step's rows that an adapter serves get x A^T B^T (scaled as
PEFT scales) added to the base layer's output. Rows of other adapters and of the base model share the same step:
the adapter is a property of each token row.

The base layers run as they do without adapters (packed bf16 or int8 kernels on CPU). The one-call CPU decode stack
adds the adapters itself, bit for bit as the wrappers do (engine_core/models/cpu_decode.py: attach_lora); any other
step with adapter rows runs eagerly through the Python layers, since the CUDA graphs hold the base weights only.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterator
from contextlib import contextmanager

import torch
from torch import nn

from common.lora import LoraModule
from common.messages import LoraRef
from common.model_errors import ConfigError
from engine_core.lora_weights import adapter_weights, stack_shards
from engine_core.models.layers import PackedLinear, can_pack_bf16
from engine_core.models.llama import LlamaForCausalLM
from engine_core.models.moe import MoeForCausalLM
from engine_core.transfer import to_device

log = logging.getLogger("roseinfer.lora")

# A group's rows are padded to this many before its matmuls: MKL's fp32 GEMM and oneDNN's bf16 one sum very few rows
# in another order, and a row's delta must not depend on how many rows its adapter serves in the step.
MIN_GROUP_ROWS = 8


class LoraStep:
    """This step's rows of each adapter: (adapter index, row indices padded to MIN_GROUP_ROWS, how many are real);
    the indices are None where the adapter serves every row of the step, and enough of them."""

    def __init__(self) -> None:
        self.groups: list[tuple[int, torch.Tensor | None, int]] = []


class LoraLinear(nn.Module):
    """A linear layer and the low-rank update of it of each adapter that changes it: x -> (x A^T) B^T, two linears
    (`low_rank`), B block-diagonal over a fused layer's shards (q/k/v, gate/up), the scale folded in."""

    def __init__(self, base: nn.Module, dtype: torch.dtype, step: LoraStep, count: int) -> None:
        super().__init__()
        self.base, self.step, self.dtype = base, step, dtype
        self.updates = nn.ModuleDict()  # registered as submodules, by adapter index
        self.by_index: list[nn.Module | None] = [None] * count  # adapter index (LoraAdapters.index) -> update or None

    def put(self, index: int, update: nn.Module | None) -> None:
        self.by_index[index] = update
        if update is None:
            if str(index) in self.updates:
                del self.updates[str(index)]
        else:
            self.updates[str(index)] = update

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = self.base(x)
        for index, rows, n in self.step.groups:
            update = self.by_index[index]
            if update is None:
                continue
            delta = update((x if rows is None else x.index_select(0, rows)).to(self.dtype)).to(out.dtype)
            if rows is None:  # the same sums as the scatter below: a row's bits do not depend on the path
                out.add_(delta)
            else:
                out.index_add_(0, rows[:n], delta[:n])
        return out


def low_rank(a: torch.Tensor, b: torch.Tensor, device: torch.device, dtype: torch.dtype) -> nn.Module:
    """(x A^T) B^T as two linears, packed for our CPU kernels (or oneDNN's) where the base layers are: a few rows'
    products then cost what reading A and B costs, where a plain bf16 matmul reorders both in every call, and each
    row's bits do not depend on the rows beside it (prepare_linears)."""
    linears = []
    packed = device.type == "cpu" and dtype in (torch.bfloat16, torch.float32)
    for weight in (a, b):
        linear = nn.Linear(weight.shape[1], weight.shape[0], bias=False, device="meta")
        linear.weight = nn.Parameter(weight.to(device, dtype), requires_grad=False)
        linears.append(PackedLinear(linear) if packed else linear)
    return nn.Sequential(*linears)


class LoraAdapters:
    """The loaded adapters, by id (LoraRef.id; a request's slot, 0 for the base model). Those of --lora-modules load
    at start; any other on first use (a runtime load, or a request resumed on a restarted engine). An unloaded one
    retires: its weights go once no live request uses it. Ids are never reused, so a retired adapter's blocks in the
    prefix cache (keyed by id) can never answer for another; the wrappers hold the loaded ones at compact indices,
    which are reused, so memory follows what is loaded, not how many loads there were."""

    def __init__(self, model: nn.Module, max_rank: int, device: torch.device, dtype: torch.dtype) -> None:
        self.model, self.max_rank, self.device = model, max_rank, device
        # The adapters compute in the model's dtype where its matmuls are fast (CUDA, fp32, bf16 on a CPU that packs
        # bf16 linears: a quarter of fp32's time for a prefill chunk's products), else in fp32.
        fast = device.type == "cuda" or dtype == torch.float32 or (dtype == torch.bfloat16 and can_pack_bf16())
        self.compute = dtype if fast and dtype in (torch.float32, torch.bfloat16, torch.float16) else torch.float32
        self.step = LoraStep()
        self.layers: dict[str, LoraLinear] = {}  # our layer's name -> its wrapper (in the model once attached)
        self.names: dict[int, str] = {}  # id -> name, of every adapter whose weights are loaded
        self.index: dict[int, int] = {}  # id -> its place in every wrapper's by_index (and the decode stack's arrays)
        self._free: list[int] = []  # places released adapters left
        self.unloaded: set[int] = set()  # ids the API unloaded (never served again but by requests sent before)
        self.retiring: set[int] = set()  # of those, the ones whose weights wait for their last request
        self.count = 0  # every wrapper's by_index length: the most adapters loaded at once so far
        self.attached = False
        self.in_stack = False  # whether the CPU decode stack adds the adapters itself (attach)
        self.tick: Callable[[], None] = lambda: None  # liveness while a load runs (engine_core/pulse.py)

    @staticmethod
    def load(model: nn.Module, modules: list[LoraModule], max_rank: int, device: torch.device,
             dtype: torch.dtype) -> LoraAdapters:  # fmt: skip
        """The adapters of --lora-modules, on the device (so that a GPU's memory profile counts them), in wrappers
        that attach() puts in the model. `dtype`: the model's."""
        adapters = LoraAdapters(model, max_rank, device, dtype)
        for module in modules:
            adapters.add(module)
        return adapters

    def add(self, module: LoraModule) -> None:
        """Loads one adapter's weights; ValueError naming the problem, with nothing changed, if they do not fit."""
        if isinstance(self.model, MoeForCausalLM):  # an expert runs a subset of the step's rows, unknown to LoraStep
            raise ConfigError("LoRA adapters are not served on mixtures of experts")
        if not isinstance(self.model, LlamaForCausalLM):  # Gemma 3's layers are the Llama family's
            raise ConfigError(f"LoRA adapters are served on the Llama family and Gemma 3, not "
                              f"{type(self.model).__name__}")  # fmt: skip
        shards: dict[str, dict[int, tuple[torch.Tensor, torch.Tensor]]] = {}  # layer -> shard -> A, B
        for target, shard, a, b in adapter_weights(self.model, module, self.model.packed_modules):
            if a.shape[0] > self.max_rank:
                raise ConfigError(f"LoRA adapter {module.name!r}: {target} has rank {a.shape[0]}, above "
                                  f"--max-lora-rank {self.max_rank}")  # fmt: skip
            shards.setdefault(target, {})[shard] = (a.float(), b.float() * module.config.scale(len(a)))
            self.tick()
        updates = {}
        for target, parts in shards.items():
            a, b = stack_shards(self._base(target), parts, module.name, target)
            updates[target] = low_rank(a, b, self.device, self.compute)
            self.tick()
        index = self._free.pop() if self._free else self.count
        self.count = max(self.count, index + 1)
        for wrapper in self.layers.values():
            wrapper.by_index += [None] * (self.count - len(wrapper.by_index))
        for target, update in updates.items():
            if target not in self.layers:
                self.layers[target] = LoraLinear(self._base(target), self.compute, self.step, self.count)
                if self.attached:
                    self._put_in_model(target)
            self.layers[target].put(index, update)
        self.names[module.id], self.index[module.id] = module.name, index
        self._restack()

    def ensure(self, ref: LoraRef) -> str | None:
        """The adapter of a request or a runtime load, loaded now if it is not yet; why it cannot be, or None."""
        if ref.id in self.names:
            return None
        if ref.id < 1:
            return f"LoRA adapter {ref.name!r}: id {ref.id} is not an adapter's"
        try:
            self.add(LoraModule.read(ref, self.max_rank))
        except Exception as exc:  # the files it names: the request (or the load) fails alone
            return str(exc) if isinstance(exc, ValueError) else f"LoRA adapter {ref.name!r}: {exc!r}"
        log.info("loaded LoRA adapter %r (id %d) from %s", ref.name, ref.id, ref.path)
        if ref.id in self.unloaded:  # a request sent just before the unload reached us: its weights go after it
            self.retiring.add(ref.id)
        return None

    def retire(self, lora_id: int) -> None:
        """The API unloaded it: its weights go once no live request uses it (release)."""
        self.unloaded.add(lora_id)
        if lora_id in self.names:
            self.retiring.add(lora_id)

    def release(self, in_use: set[int]) -> None:
        """Frees the weights of every retiring adapter no live request uses (`in_use`: their ids)."""
        done = self.retiring - in_use
        for lora_id in done:
            index = self.index.pop(lora_id)
            for wrapper in self.layers.values():
                wrapper.put(index, None)
            self._free.append(index)
            log.info("unloaded LoRA adapter %r (id %d)", self.names.pop(lora_id), lora_id)
        self.retiring -= done
        if done:
            self._restack()

    def attach(self) -> None:
        """Puts the wrappers in place of their base layers (after the decode stack and the CUDA graphs took those),
        and gives the decode stack the adapters where it can add them itself."""
        self.attached = True
        for target in self.layers:
            self._put_in_model(target)
        self._restack()

    def _base(self, target: str) -> nn.Module:
        return self.layers[target].base if target in self.layers else self.model.get_submodule(target)

    def _put_in_model(self, target: str) -> None:
        parent, _, attr = target.rpartition(".")
        setattr(self.model.get_submodule(parent), attr, self.layers[target])

    def _restack(self) -> None:
        stack = getattr(self.model, "decode_stack", None)
        if self.attached and stack is not None and self.layers:
            self.in_stack = stack.attach_lora(self.layers, self.step)

    @property
    def active(self) -> bool:
        return bool(self.step.groups)

    def plan(self, slots: list[int]) -> None:
        """Sets this step's rows of each adapter from every row's slot (its adapter's id; 0: the base model only)."""
        self.step.groups = []
        if not self.names:
            return
        for slot in sorted(set(slots) - {0}):
            rows = [i for i, s in enumerate(slots) if s == slot]
            n = len(rows)
            if n == len(slots) >= MIN_GROUP_ROWS:
                self.step.groups.append((self.index[slot], None, n))
                continue
            rows += rows[-1:] * (MIN_GROUP_ROWS - n)
            self.step.groups.append((self.index[slot], to_device(rows, self.device, torch.long), n))

    @contextmanager
    def eager(self, model: nn.Module) -> Iterator[None]:
        """The Python layers for this step, unless the one-call C decode stack adds the adapters itself."""
        stack = None if self.in_stack else getattr(model, "decode_stack", None)
        if stack is not None:
            model.decode_stack = None
        try:
            yield
        finally:
            if stack is not None:
                model.decode_stack = stack
