"""A GGUF file's weights as llama.cpp stores them (`--quantization gguf`): tensors in Q8_0,
Q4_0, Q4_1 and Q4_K are read block by block into quant.Tables and computed as they are
(Q4_K's super-blocks of 256 as their eight groups of 32, each with its scale d * sc and min
-dmin * m rounded to float16). Every other tensor is dequantized to float32 (by the `gguf`
package): norms are used as they are, products in other formats (Q5_K, Q6_K, F16, ...)
quantized again to Q8_0 by the model (quant.bits). Nothing is converted first: the file's
config and tokenizer alone are (loader.resolve without weights).

Block layouts (ggml's): Q8_0 is 32 quants (34 bytes: float16 d, 32 int8); Q4_0 and Q4_1
hold 32 nibbles in 16 bytes, byte j the j-th value in its low half and the (16 + j)-th in its
high half, after d (and m for Q4_1); Q4_K's 256 values are float16 d and dmin, 12 bytes of
6-bit scales and mins, and 4 runs of 32 bytes, run r holding group 2r in its low halves and
2r + 1 in its high ones."""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from pathlib import Path

import gguf
import numpy as np
import torch

from pdserve.model import loader
from pdserve.model.quant import Table

STORED = ("Q8_0", "Q4_0", "Q4_1", "Q4_K")
# Architectures whose tensors llama.cpp's converter stores as transformers names them, but for
# Llama's q and k rows, which it interleaves for its RoPE (so a reader puts them back).
ARCHITECTURES = {"llama": True, "qwen2": False, "qwen3": False}


def _halves(t: torch.Tensor) -> torch.Tensor:
    """[..., 16] bytes as their 32 nibbles, the low halves first."""
    return torch.cat([t & 15, t >> 4], -1).to(torch.int8)


def _half(t: torch.Tensor) -> torch.Tensor:
    return t.contiguous().view(torch.float16).squeeze(-1)


def table(kind: str, blocks: torch.Tensor, n: int) -> Table:
    """The Table of a tensor of n rows of `kind` blocks (its bytes, [n, bytes per row])."""
    if kind == "Q4_K":
        return _q4_k(blocks.view(n, -1, 144))
    size = {"Q8_0": 34, "Q4_0": 18, "Q4_1": 20}[kind]
    b = blocks.view(n, -1, size)
    d = _half(b[..., :2])
    if kind == "Q8_0":
        return Table(b[..., 2:].contiguous().view(torch.int8).flatten(1), d, 8)
    if kind == "Q4_0":
        return Table((_halves(b[..., 2:]) - 8).flatten(1), d, 4)
    return Table(_halves(b[..., 4:]).flatten(1), d, 4, _half(b[..., 2:4]))


def _q4_k(b: torch.Tensor) -> Table:
    n, supers = b.shape[:2]
    d, dmin = _half(b[..., :2]).float(), _half(b[..., 2:4]).float()
    sc, m = (torch.from_numpy(a.astype(np.float32)).view(n, supers, 8) for a in
             gguf.quants.Q4_K.get_scale_min(b[..., 4:16].reshape(-1, 12).numpy()))
    q = _halves(b[..., 16:].reshape(n, supers, 4, 32))  # each run: its two groups in order
    return Table(q.reshape(n, -1), (d.unsqueeze(-1) * sc).half().flatten(1),
                 4, (-(dmin.unsqueeze(-1) * m)).half().flatten(1))


class GGUFWeights(Mapping[str, torch.Tensor | Table]):
    """A GGUF file's weights under transformers' names (those of folder's config: loader.
    shapes), each read from the file when asked for: those in a computable format (STORED)
    as Tables, the others dequantized to float32 by the gguf package."""

    def __init__(self, file: Path, folder: Path) -> None:
        reader = gguf.GGUFReader(file)
        arch = reader.get_field("general.architecture").contents()
        if arch not in ARCHITECTURES:
            raise loader.ModelLoadError(
                f"--quantization gguf reads GGUF files of {', '.join(ARCHITECTURES)} "
                f"models; {file.name} holds a {arch} model (serve it without --quantization "
                "gguf, dequantized)")
        config = loader.load_config(folder)
        self.heads = {"attn_q": config["num_attention_heads"],
                      "attn_k": config.get("num_key_value_heads",
                                           config["num_attention_heads"])}
        self.permuted = ARCHITECTURES[arch]
        names = gguf.get_tensor_name_map(
            {v: k for k, v in gguf.MODEL_ARCH_NAMES.items()}[arch], config["num_hidden_layers"])
        tensors = {t.name: t for t in reader.tensors}
        self.stored = {}
        for name in loader.shapes(folder):
            found = tensors.get(names.get_name(name, try_suffixes=(".weight", ".bias")) or "")
            if found is None and name == "lm_head.weight":  # tied: the file keeps one copy
                found = tensors.get("token_embd.weight")
            if found is not None:
                self.stored[name] = found
        self.shapes = {name: torch.Size(reversed(t.shape.tolist()))
                       for name, t in self.stored.items()}  # GGUF lists dims innermost first

    def __getitem__(self, name: str) -> torch.Tensor | Table:
        stored = self.stored[name]
        kind, shape = stored.tensor_type.name, self.shapes[name]
        if kind in STORED and len(shape) == 2:
            t: torch.Tensor | Table = table(kind, torch.from_numpy(np.array(stored.data)),
                                            shape[0])
        else:
            t = torch.from_numpy(np.array(gguf.quants.dequantize(
                stored.data, stored.tensor_type), dtype=np.float32)).reshape(shape)
        part = stored.name.split(".")[-2]
        if self.permuted and part in self.heads:
            order = _unpermuted(shape[0], self.heads[part])
            t = t.rows(order) if isinstance(t, Table) else t[order]
        return t

    def __contains__(self, name: object) -> bool:
        return name in self.stored

    def __iter__(self) -> Iterator[str]:
        return iter(self.stored)

    def __len__(self) -> int:
        return len(self.stored)


def _unpermuted(n: int, heads: int) -> torch.Tensor:
    """The order of rows that undoes llama.cpp's interleaving of each head's two halves of
    RoPE dimensions (row i of a head of 2h rows stored at 2i for i < h, 2(i - h) + 1 after)."""
    return torch.arange(n).view(heads, -1, 2).transpose(1, 2).reshape(n)

