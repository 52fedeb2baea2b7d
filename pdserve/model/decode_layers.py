"""A decode step's decoder layers in one native call (csrc/decode_layers.cpp).

A decode step calls eight kernels a layer. Python between those 240 calls took 1.3-2.5 ms of
a 10-40 ms step (SmolLM2, 2 Zen 5 cores; 6-14 % of it), the other core idle meanwhile and the
interpreter slowed by caches the kernels had just filled. The C++ loop calls the same kernels
with the same arguments, so a step's numbers are the same bits; Python keeps the embedding,
the final norm, lm_head and sampling.

It takes plain Llama layers (LlamaModel._native_layers says which) and steps of decodes alone, each
product within the pairs kernel's rows; LlamaModel.forward runs everything else itself."""

from __future__ import annotations

import ctypes
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch

from pdserve.model.attention import Scores
from pdserve.model.kv_cache import KVCache

_P, _I, _F = ctypes.c_void_p, ctypes.c_int64, ctypes.c_float


class _Layer(ctypes.Structure):  # csrc/decode_layers.cpp's Layer
    _fields_ = [*((n, _P) for n in ("ln1", "qkv", "o", "ln2", "gate_up", "down")),
                ("scale", _F), ("cap", _F), ("window", _I)]


class _Step(ctypes.Structure):  # csrc/decode_layers.cpp's Step
    _fields_ = [*((n, _P) for n in ("h", "delta", "x", "qkv", "attn", "act", "cos", "sin",
                                    "slot_blocks", "slot_offsets", "index", "tables", "lens",
                                    "k0")),
                *((n, _I) for n in ("rows", "hidden", "heads", "kv_heads", "dim",
                                    "intermediate", "rot", "width", "block_size", "s_layer",
                                    "s_block", "s_kv", "s_token", "s_head")),
                ("eps", _F), ("threads", ctypes.c_int32)]


@dataclass(frozen=True, slots=True)
class LayerWeights:
    """One layer's bf16 tensors, the products' pair-packed (linear.Weight.pairs)."""
    ln1: torch.Tensor
    qkv: torch.Tensor
    o: torch.Tensor
    ln2: torch.Tensor
    gate_up: torch.Tensor  # gated: gate's and up's blocks interleaved
    down: torch.Tensor
    scores: Scores


@dataclass(frozen=True, slots=True)
class Shape:
    hidden: int
    heads: int
    kv_heads: int
    head_dim: int
    intermediate: int
    eps: float


class NativeLayers:
    """A model's layers as the native call's table, and the call over one step."""

    def __init__(self, lib: ctypes.CDLL, layers: Sequence[LayerWeights], shape: Shape,
                 max_rows: int) -> None:
        self.lib, self.shape, self.max_rows = lib, shape, max_rows
        self.weights = list(layers)  # what the table points at stays alive with it
        self.table = (_Layer * len(layers))(*(
            _Layer(*(t.data_ptr() for t in (w.ln1, w.qkv, w.o, w.ln2, w.gate_up, w.down)),
                   w.scores.scale, w.scores.cap or 0.0, w.scores.window or 0)
            for w in layers))

    def run(self, h: torch.Tensor, rope: tuple[torch.Tensor, torch.Tensor],
            slots: tuple[torch.Tensor, torch.Tensor],
            decodes: tuple[torch.Tensor, torch.Tensor, torch.Tensor], cache: KVCache,
            checkpoint: Callable[[], None] | None) -> torch.Tensor | None:
        """The layers over h [rows, hidden] (the residual stream, summed in place): rope
        (cos, sin) [rows, rot]; slots (blocks, offsets) [rows] where each row's K/V goes;
        decodes (index, tables, lens) as a DecodeGroup's. Returns the last layer's output,
        which the final norm adds to h; None where this CPU's build cannot (nothing done).
        A checkpoint is called before each layer, which then runs in a call of its own."""
        s, rows = self.shape, h.shape[0]
        cos, sin = rope
        index, tables, lens = decodes
        delta, x = torch.empty_like(h), torch.empty_like(h)
        qkv = h.new_empty(rows, (s.heads + 2 * s.kv_heads) * s.head_dim)
        attn = h.new_empty(rows, s.heads * s.head_dim)
        act = h.new_empty(rows, s.intermediate)
        k0, block, kv, token, head = cache.layer_slots(0)
        step = _Step(*(t.data_ptr() for t in (h, delta, x, qkv, attn, act, cos, sin, *slots,
                                              index, tables, lens)), k0,
                     rows, s.hidden, s.heads, s.kv_heads, s.head_dim, s.intermediate,
                     cos.shape[-1], tables.shape[1], cache.shape.block_size,
                     cache.tensor.stride(1), block, kv, token, head, s.eps,
                     torch.get_num_threads())
        n = len(self.table)
        for first, last in ((0, n),) if checkpoint is None else ((i, i + 1) for i in range(n)):
            if checkpoint is not None:
                checkpoint()
                step.threads = torch.get_num_threads()  # a core loan may change them
            rc = self.lib.pdserve_decode_layers(ctypes.addressof(step), self.table, first, last)
            if rc == 1:
                return None
            if rc:
                raise RuntimeError(f"a kernel refused decoder layer {first} of a decode step")
        return delta
