"""What wrapping each block of a model would free and cost, measured in one forward.

:func:`measure_blocks` runs the model once with autograd on and attributes to every
candidate block (a submodule with parameters whose first op is not in place) the bytes its
ops save for backward, its inputs, its expensive ops' outputs and its FLOPs; :class:`Block`
turns them into :class:`Choice` s, one per policy it may be wrapped under. The search over
them is :mod:`trunksplit.planning.wrap`'s.
"""
from dataclasses import dataclass
from typing import Dict, List, Tuple

import torch
from torch import nn
from torch.utils.flop_counter import flop_registry

from ..chains.blocks import layer_splittable_before
from ..recompute.policies import RECOMPUTE, SAVE_EXPENSIVE
from ..recompute.wrapper import is_checkpoint_wrapped
from .memory import TorchDispatchMode, tensors_in


@dataclass
class Block:
    name: str
    module: nn.Module
    saved: int = 0  # bytes its ops save for backward (parameters excluded), each storage once
    inputs: int = 0  # bytes of its tensor inputs: what a checkpoint keeps instead
    flops: int = 0
    expensive_out: int = 0  # bytes its expensive ops (conv, matmul, attention) output: what "save_expensive" keeps too
    saved_expensive: int = 0  # the part of ``saved`` that expensive ops output: what "save_expensive" does not rebuild
    selective: bool = True  # False where an op writes in place into an expensive op's output (torch's selective checkpoint refuses it)

    def choices(self) -> List["Choice"]:
        """The ways to wrap it that free memory. Running a block again costs its FLOPs and the
        bytes it writes again (a norm or an activation does no FLOP a counter sees, yet is not
        free); under "save_expensive" only the cheap ops run again, and they count no FLOP."""
        cheap = self.saved - self.saved_expensive
        options = [Choice(self, RECOMPUTE.name, self.saved - self.inputs, max(1, self.flops + self.saved), self.saved)]
        if self.selective:
            options.append(Choice(self, SAVE_EXPENSIVE.name, self.saved - self.inputs - self.expensive_out, max(1, cheap), cheap))
        return [c for c in options if c.freed > 0]


@dataclass(frozen=True)
class Choice:
    """A block wrapped under a policy: what it frees, what running it again costs, what its backward rebuilds at once."""

    block: Block
    policy: str
    freed: int
    cost: int
    rebuild: int

    @property
    def name(self) -> str:
        return self.block.name


def candidates(model: nn.Module, condition) -> List[Block]:
    found = []
    for name, m in model.named_modules():
        if not name or isinstance(m, (nn.ModuleList, nn.ModuleDict)) or is_checkpoint_wrapped(m):
            continue
        if not any(p.requires_grad for p in m.parameters()) or not layer_splittable_before(m):
            continue
        if condition is None or condition(name, m):
            found.append(Block(name, m))
    return found


class _Attribution(TorchDispatchMode):
    """Adds each op's FLOPs, and an expensive op's output bytes, to every block on the call stack.

    Storages are told apart by address, so every tensor whose address is recorded is held
    until the measurement ends: a storage freed during the forward (an attention score that
    nothing saves) would hand its address to a later tensor, which would then count as an
    expensive output or as written in place, depending on where the allocator put it."""

    def __init__(self, stack: List[Block]):
        super().__init__()
        self.stack = stack
        self.total = 0
        self.expensive: Dict[int, set] = {}  # per block: the storages its expensive ops output
        self.written: set = set()  # storages an op wrote into in place
        self.held: List[torch.Tensor] = []  # the tensors behind those addresses, kept alive (see above)

    def __exit__(self, *exc):
        self.held.clear()
        return super().__exit__(*exc)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        positional = [a for a in func._schema.arguments if not a.kwarg_only]
        for i, arg in enumerate(func._schema.arguments):  # what an in-place op (relu_, add_, out=) writes into
            if arg.alias_info is None or not arg.alias_info.is_write:
                continue
            value = args[positional.index(arg)] if not arg.kwarg_only and positional.index(arg) < len(args) else kwargs.get(arg.name)
            if isinstance(value, torch.Tensor):
                self.written.add(value.untyped_storage().data_ptr())
                self.held.append(value)
        count = flop_registry.get(getattr(func, "overloadpacket", func))
        if count is not None:
            flops = count(*args, **kwargs, out_val=out)
            self.total += flops
            outputs = list(tensors_in(out))
            self.held += outputs
            for b in self.stack:
                b.flops += flops
                b.expensive_out += sum(t.untyped_storage().nbytes() for t in outputs)
                self.expensive.setdefault(id(b), set()).update(t.untyped_storage().data_ptr() for t in outputs)
        return out


def measure_blocks(model: nn.Module, inputs: Tuple, condition) -> Tuple[List[Block], int]:
    """Every candidate block's saved bytes, input bytes and FLOPs, from one forward with autograd on."""
    blocks = candidates(model, condition)
    stack: List[Block] = []
    seen: Dict[int, set] = {id(b): set() for b in blocks}
    params = {p.untyped_storage().data_ptr() for p in model.parameters()}

    def pre(block):
        def hook(module, args, kwargs):
            block.inputs += sum(t.untyped_storage().nbytes() for t in tensors_in((args, kwargs)))
            stack.append(block)
        return hook

    def post(block):
        def hook(module, args, kwargs, out):
            stack.remove(block)
        return hook

    def pack(t):
        key = t.untyped_storage().data_ptr()
        if key not in params:
            for b in stack:
                if key not in seen[id(b)]:
                    seen[id(b)].add(key)
                    b.saved += t.untyped_storage().nbytes()
                    if key in attribution.expensive.get(id(b), ()):
                        b.saved_expensive += t.untyped_storage().nbytes()
        # not t itself: an op's saved output would hold its own node through autograd's C++ side, a
        # cycle gc cannot free (this forward never runs backward): the graph and parameters leaked
        return t.detach()

    attribution = _Attribution(stack)
    handles = [h for b in blocks for h in (b.module.register_forward_pre_hook(pre(b), with_kwargs=True),
                                            b.module.register_forward_hook(post(b), with_kwargs=True))]
    try:
        with kept_as_it_was(model), torch.enable_grad(), torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t), attribution:
            model(*inputs)
    finally:
        for h in handles:
            h.remove()
    for b in blocks:
        b.selective = not (attribution.expensive.get(id(b), set()) & attribution.written)
    return blocks, attribution.total


class kept_as_it_was:
    """Put the model's gradients, buffers, train/eval modes and the RNG back afterwards: measuring trains nothing."""

    def __init__(self, model: nn.Module):
        self.model = model

    def __enter__(self):
        m = self.model
        self.grads = [(p, p.grad) for p in m.parameters()]
        self.buffers = [(b, b.detach().clone()) for b in m.buffers()]
        self.modes = [(sub, sub.training) for sub in m.modules()]
        # every GPU the model is on, found by its parameters too: a model without buffers (a ViT) kept none, and its
        # measured steps' dropout moved the GPU's generator
        devices = sorted({t.device.index for t in [*m.parameters(), *m.buffers()] if t.device.type == "cuda"})
        self.rng = torch.random.fork_rng(devices=devices)
        self.rng.__enter__()
        return self

    def __exit__(self, *exc):
        self.rng.__exit__(*exc)
        with torch.no_grad():
            for b, value in self.buffers:
                b.copy_(value)
        for p, g in self.grads:
            p.grad = g
        for sub, training in self.modes:
            sub.training = training
        return False
