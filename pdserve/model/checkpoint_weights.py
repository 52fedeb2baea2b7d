"""An HF checkpoint stored quantized by the tools vLLM users quantize with, its weights
computed as stored (the method is the checkpoint's own `quantization_config.quant_method`,
as vLLM reads it):

- compressed-tensors (llm-compressor): `pack-quantized` int4 or int8 (W4A16, W8A16),
  `int-quantized` / `naive-quantized` int8 (W8A8), per channel or in groups of a multiple of
  32, symmetric (int4 also asymmetric); `float-quantized` FP8 weights are read dequantized;
- gptq (AutoGPTQ, GPTQModel): 4 or 8 bits, in groups (no act-order);
- awq (AutoAWQ, GEMM layout): 4 bits with zero points;
- fp8 (vLLM's and Qwen's FP8 checkpoints): float8 weights with a scale per tensor, channel
  or block, read dequantized.

A quantized weight becomes a quant.Table (groups of 32): a scale per 64 or 128 inputs, or per
channel, is repeated over its groups of 32, and float16 holds it (a float32 or bfloat16 scale
is rounded to it). Symmetric int4 is Q4_0 as it is (q in -8..7, w = q * s); with a zero point
z, w = (q - z) * s is q' * s + m with q' = q - z + z's offset in 0..15 and m = -(offset) * s,
rounded to float16 (Q4_1's form). Int8 quants are Q8_0's, but the kernel's 8-bit products
take -127..127: a -128 (a symmetric int8 range's low end) is read as -127. Weights the
checkpoint keeps unquantized (an lm_head it ignores, embeddings) and those read dequantized
are quantized to Q8_0 by the model, as a GGUF file's other formats are (quant.bits)."""

from __future__ import annotations

from collections.abc import Callable, Iterator, Mapping
from pathlib import Path

import torch

from pdserve.config import CHECKPOINT_QUANTIZATIONS as METHODS
from pdserve.model import loader
from pdserve.model.quant import GROUP, Table

AWQ_ORDER = (0, 2, 4, 6, 1, 3, 5, 7)  # the output each of a word's eight nibbles holds


class UnsupportedCheckpoint(loader.ModelLoadError):
    """A checkpoint quantized in a way pdserve does not compute."""


def method(folder: Path) -> str | None:
    """The quantization a checkpoint is stored in (None: none); refused where it is one
    pdserve cannot serve, naming those it can."""
    qc = loader.load_config(folder).get("quantization_config")
    if qc is None:
        return None
    name = qc.get("quant_method")
    if name not in METHODS:
        raise UnsupportedCheckpoint(
            f"{folder} is quantized with {name!r}; pdserve serves checkpoints quantized with "
            f"{', '.join(METHODS)} (or a GGUF file, or weights it quantizes at load with "
            "--quantization int8 or int4 from a float checkpoint)")
    return name


def _unpacked(words: torch.Tensor, bits: int) -> torch.Tensor:
    """int32 words [..., w] as their values of `bits` 4 or 8 [..., w * 32 / bits], element i
    of a word at bits i * bits up (uint8 values)."""
    b = words.contiguous().view(torch.uint8)  # little-endian: a word's low byte first
    return b if bits == 8 else torch.stack([b & 15, b >> 4], -1).flatten(-2)


def _per_group(t: torch.Tensor, k: int) -> torch.Tensor:
    """Values per output and group of inputs [n, g] (g dividing k into groups of a multiple
    of 32) as float16 per group of 32 [n, k / 32]."""
    size = k // t.shape[1]
    if size % GROUP:
        raise UnsupportedCheckpoint(f"quantization groups of {size} inputs: pdserve computes "
                                    f"groups of a multiple of {GROUP}")
    return t.float().repeat_interleave(size // GROUP, 1).half()


def _table(q: torch.Tensor, scales: torch.Tensor, bits: int,
           zeros: torch.Tensor | None = None) -> Table:
    """The Table of w = (q - zeros) * scales, quants q [n, k] signed (-8..7, -128..127),
    scales and zeros (signed alike) [n, groups]."""
    k = q.shape[1]
    s = _per_group(scales, k)
    if bits == 8:
        if zeros is not None and zeros.any():
            raise UnsupportedCheckpoint("int8 weights with zero points: pdserve computes "
                                        "symmetric int8 (and int4 with or without)")
        return Table(q.clamp(min=-127).to(torch.int8), s, 8)
    if zeros is None or not zeros.any():
        return Table(q.to(torch.int8), s, 4)
    mins = _per_group(-(zeros.float() + 8) * scales.float(), k)
    return Table((q + 8).to(torch.int8), s, 4, mins)


def _consecutive(g_idx: torch.Tensor | None, k: int, groups: int, stem: str) -> None:
    """Refuses a weight whose inputs' groups (g_idx) are not consecutive runs: quantized with
    act-order (GPTQ's desc_act, llm-compressor's actorder "group")."""
    if g_idx is not None and not torch.equal(g_idx.long(), torch.arange(k) // (k // groups)):
        raise UnsupportedCheckpoint(f"{stem} was quantized with act-order (GPTQ's desc_act, "
                                    "llm-compressor's actorder group): pdserve computes "
                                    "groups of consecutive inputs")


def _float(q: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """A float8 weight [n, k] times its scale, per tensor ([] or [1]), channel ([n, 1]) or
    block ([ceil(n / bn), ceil(k / bk)]), in float32."""
    w, s = q.float(), scale.float()
    if s.dim() == 2 and s.shape[1] > 1:  # blocks
        bn, bk = -(-w.shape[0] // s.shape[0]), -(-w.shape[1] // s.shape[1])
        s = s.repeat_interleave(bn, 0)[:w.shape[0]].repeat_interleave(bk, 1)[:, :w.shape[1]]
    return w * s


Reader = Callable[[Mapping[str, torch.Tensor], str], torch.Tensor | Table | None]


def _compressed_tensors(qc: dict) -> Reader:
    groups = list(qc.get("config_groups", {}).values())
    args = [g.get("weights") or {} for g in groups]
    if len({(a.get("num_bits"), a.get("type")) for a in args}) > 1:
        raise UnsupportedCheckpoint("compressed-tensors checkpoints with weights of several "
                                    "kinds: pdserve reads one kind per checkpoint")
    bits, kind = (args[0].get("num_bits"), args[0].get("type")) if args else (None, None)
    if kind == "int" and bits not in (4, 8):
        raise UnsupportedCheckpoint(f"compressed-tensors int{bits} weights: pdserve computes "
                                    "int4 and int8")
    if kind not in ("int", "float"):
        raise UnsupportedCheckpoint(f"compressed-tensors {kind} weights: pdserve computes int4 "
                                    "and int8 and reads FP8")

    def read(t: Mapping[str, torch.Tensor], stem: str) -> torch.Tensor | Table | None:
        zeros = t.get(f"{stem}.weight_zero_point")
        if (packed := t.get(f"{stem}.weight_packed")) is not None:
            n, k = t[f"{stem}.weight_shape"].tolist()
            _consecutive(t.get(f"{stem}.weight_g_idx"), k, t[f"{stem}.weight_scale"].shape[1],
                         stem)
            q = _unpacked(packed, bits)[:, :k].int() - (1 << bits - 1)
            if zeros is not None:  # packed along the outputs
                zeros = _unpacked(zeros.t(), bits).t()[:n].int() - (1 << bits - 1)
            return _table(q, t[f"{stem}.weight_scale"], bits, zeros)
        w = t.get(f"{stem}.weight")
        if w is None or f"{stem}.weight_scale" not in t:
            return w
        if w.dtype == torch.int8:
            return _table(w.int(), t[f"{stem}.weight_scale"], 8, zeros)
        return _float(w, t[f"{stem}.weight_scale"])
    return read


def _gptq(qc: dict) -> Reader:
    bits, offset = qc.get("bits", 4), 0 if qc.get("checkpoint_format") == "gptq_v2" else 1
    if bits not in (4, 8):
        raise UnsupportedCheckpoint(f"GPTQ int{bits}: pdserve computes int4 and int8")

    def read(t: Mapping[str, torch.Tensor], stem: str) -> torch.Tensor | Table | None:
        if (qweight := t.get(f"{stem}.qweight")) is None:
            return t.get(f"{stem}.weight")
        q = _unpacked(qweight.t(), bits).int()  # [n, k]: packed along the inputs
        scales = t[f"{stem}.scales"].t()
        _consecutive(t.get(f"{stem}.g_idx"), q.shape[1], scales.shape[1], stem)
        # v1 checkpoints (AutoGPTQ's) store each zero point minus one
        zeros = _unpacked(t[f"{stem}.qzeros"], bits).int().t() + offset
        middle = 1 << bits - 1
        return _table(q - middle, scales, bits, zeros - middle)
    return read


def _awq(qc: dict) -> Reader:
    if qc.get("bits", 4) != 4 or qc.get("version", "gemm").lower() != "gemm" or \
            not qc.get("zero_point", True):
        raise UnsupportedCheckpoint("AWQ checkpoints: pdserve reads 4-bit GEMM ones with "
                                    "zero points (AutoAWQ's default)")
    order = torch.tensor(AWQ_ORDER).argsort()

    def nibbles(words: torch.Tensor) -> torch.Tensor:  # [r, n / 8] words as [n, r] values
        v = _unpacked(words, 4).unflatten(-1, (-1, 8))[..., order]
        return v.flatten(1).t().int()

    def read(t: Mapping[str, torch.Tensor], stem: str) -> torch.Tensor | Table | None:
        if (qweight := t.get(f"{stem}.qweight")) is None:
            return t.get(f"{stem}.weight")
        return _table(nibbles(qweight) - 8, t[f"{stem}.scales"].t(), 4,
                      nibbles(t[f"{stem}.qzeros"]) - 8)
    return read


def _fp8(qc: dict) -> Reader:
    def read(t: Mapping[str, torch.Tensor], stem: str) -> torch.Tensor | None:
        w = t.get(f"{stem}.weight")
        scale = t.get(f"{stem}.weight_scale_inv", t.get(f"{stem}.weight_scale"))
        return w if scale is None or w is None else _float(w, scale)
    return read


READERS: dict[str, Callable[[dict], Reader]] = {
    "compressed-tensors": _compressed_tensors, "gptq": _gptq, "awq": _awq, "fp8": _fp8}


class CheckpointWeights(Mapping[str, torch.Tensor | Table]):
    """A quantized checkpoint's weights under transformers' names (those of loader.shapes),
    each made when it is asked for: a Table where stored quantized in a computable form, a
    float tensor otherwise. The stored tensors are read at once (they are the small ones)."""

    def __init__(self, folder: Path) -> None:
        self.read = READERS[method(folder)](loader.load_config(folder)["quantization_config"])
        self.tensors = loader.load_state_dict(folder)
        self.shapes = {name: shape for name, shape in loader.shapes(folder).items()
                       if self._stored(name)}

    def _stored(self, name: str) -> bool:
        stem = name.removesuffix(".weight")
        return name in self.tensors or any(f"{stem}.{leaf}" in self.tensors for leaf in (
            "weight_packed", "qweight"))

    def __getitem__(self, name: str) -> torch.Tensor | Table:
        if name not in self.shapes:
            raise KeyError(name)
        if not name.endswith(".weight"):
            return self.tensors[name]
        t = self.read(self.tensors, name.removesuffix(".weight"))
        if t is None:
            raise KeyError(name)
        if t.shape != self.shapes[name]:
            raise loader.ModelLoadError(f"{name} is stored as {list(t.shape)}; the model's "
                                        f"config makes it {list(self.shapes[name])}")
        return t

    def __contains__(self, name: object) -> bool:
        return name in self.shapes

    def __iter__(self) -> Iterator[str]:
        return iter(self.shapes)

    def __len__(self) -> int:
        return len(self.shapes)
