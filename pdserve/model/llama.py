"""Decoder-only forward of the Llama family and its kin (Llama, Mistral, Qwen2/3, Phi-3,
Gemma 2/3, Qwen3-MoE, Mixtral) over a paged KV cache.

One forward runs a flat batch of tokens from many sequences: the projections and MLP see
all tokens at once; attention runs single-token queries (decodes) in groups, one call per
group (on CPU, one kernel call reading the paged cache in place), and each multi-token
chunk (a prefill) as its own call."""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import torch

from pdserve.model import attention, gemma, loader, quant
from pdserve.model.attention import Scores
from pdserve.model.decode_layers import LayerWeights, NativeLayers, Shape
from pdserve.model.elementwise import Elementwise
from pdserve.model.kv_cache import KVCache, KVShape
from pdserve.model.linear import PAIR_ROWS, Gemm, Linear, Weight
from pdserve.model.moe import Experts
from pdserve.model.paged_attention import PagedAttention
from pdserve.model.quant import QuantWeight, Table

# HF model_type values
ARCHITECTURES = ("llama", "mistral", "qwen2", "qwen3", "phi3", "qwen3_moe", "mixtral",
                 *gemma.ARCHITECTURES)
ROPE_TYPES = ("default", "llama3", "linear", "longrope")
_QWEN = ("qwen2", "qwen3", "qwen3_moe")  # sliding windows only with use_sliding_window


@dataclass(slots=True, frozen=True)
class ModelConfig:
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float
    rope_theta: float
    rope_scaling: dict | None
    tie_word_embeddings: bool
    qkv_bias: bool
    max_position_embeddings: int
    eos_token_ids: tuple[int, ...]
    qk_norm: bool = False  # Qwen3, Gemma 3: an RMSNorm over each head of q and k, before RoPE
    # Per layer: the sliding window (attention sees only the last this many tokens, its own
    # included) or None; () when no layer has one.
    layer_windows: tuple[int | None, ...] = ()
    rotary_dim: int = 0  # the dims of each head RoPE rotates, when not all (Phi-4-mini)
    local_rope_theta: float | None = None  # Gemma 3: the sliding layers' RoPE base
    norm_offset: float = 0.0  # Gemma: RMSNorm multiplies by (offset + weight)
    activation: str = "silu"  # the MLP's gate: silu | gelu_tanh (GeGLU)
    gemma: gemma.Gemma | None = None
    # Mixture of experts: the layers whose MLP is routed, and its shape.
    moe_layers: tuple[int, ...] = ()
    num_experts: int = 0
    experts_per_token: int = 0
    expert_size: int = 0  # each expert's intermediate size
    renormalise_experts: bool = True

    @classmethod
    def from_hf(cls, c: dict) -> ModelConfig:
        c = gemma.text_config(c)
        arch = c.get("model_type", "llama")
        if arch not in ARCHITECTURES:
            raise ValueError(f"unsupported model_type {arch!r}; supported: "
                             f"{', '.join(ARCHITECTURES)}")
        extra = gemma.config_fields(c) if arch in gemma.ARCHITECTURES else {}
        rope = extra.pop("rope_parameters", None) or c.get("rope_parameters") or \
            c.get("rope_scaling") or {}
        rope_type = rope.get("rope_type", rope.get("type", "default"))
        if arch == "phi3" and rope_type in ("su", "yarn"):  # transformers' names for LongRoPE
            rope_type = "longrope"
        if rope_type not in ROPE_TYPES:
            raise ValueError(f"unsupported rope scaling {rope_type!r} (supported: "
                             f"{', '.join(ROPE_TYPES)})")
        eos = c.get("eos_token_id")
        heads = c["num_attention_heads"]
        head_dim = c.get("head_dim") or c["hidden_size"] // heads
        partial = rope.get("partial_rotary_factor", c.get("partial_rotary_factor", 1.0))
        return cls(
            vocab_size=c["vocab_size"], hidden_size=c["hidden_size"],
            intermediate_size=c["intermediate_size"], num_layers=c["num_hidden_layers"],
            num_heads=heads, num_kv_heads=c.get("num_key_value_heads", heads),
            head_dim=head_dim, rms_norm_eps=c.get("rms_norm_eps", 1e-6),
            rope_theta=rope.get("rope_theta", c.get("rope_theta", 10000.0)),
            rope_scaling=_rope_scaling(rope_type, rope, c),
            rotary_dim=int(head_dim * partial) if partial != 1.0 else 0,
            tie_word_embeddings=c.get("tie_word_embeddings", arch in gemma.ARCHITECTURES),
            qkv_bias=c.get("attention_bias", arch == "qwen2"),
            max_position_embeddings=c.get("max_position_embeddings", 4096),
            eos_token_ids=tuple(eos if isinstance(eos, list) else [eos] if eos is not None
                                else []),
            qk_norm=arch in ("qwen3", "qwen3_moe", "gemma3_text"),
            layer_windows=extra.pop("layer_windows", None) or _windows(arch, c),
            **_moe(arch, c), **extra,
        )

    @classmethod
    def from_folder(cls, folder: Path) -> ModelConfig:
        """The config.json of an HF folder (ModelLoadError naming what is wrong)."""
        try:
            return cls.from_hf(loader.load_config(folder))
        except (KeyError, ValueError) as e:
            raise loader.ModelLoadError(f"{folder / 'config.json'}: {e}") from None

    def shard(self, tp_size: int) -> ModelConfig:
        """This config as one of `tp_size` tensor-parallel ranks sees it: a slice of the
        attention heads, KV heads and MLP width each."""
        if tp_size == 1:
            return self
        sizes = {"attention heads": self.num_heads, "KV heads": self.num_kv_heads,
                 "MLP width (intermediate_size)": self.intermediate_size}
        if self.num_experts:
            sizes["experts' width"] = self.expert_size
        if bad := [f"{v} {k}" for k, v in sizes.items() if v % tp_size]:
            fits = [t for t in range(1, self.num_kv_heads + 1)
                    if all(v % t == 0 for v in sizes.values())]
            raise ValueError(f"--tensor-parallel-size {tp_size} cannot split this model: its "
                             f"{' and '.join(bad)} do not divide by {tp_size} (sizes that "
                             f"work: {', '.join(map(str, fits))})")
        return dataclasses.replace(
            self, num_heads=self.num_heads // tp_size, num_kv_heads=self.num_kv_heads // tp_size,
            intermediate_size=self.intermediate_size // tp_size,
            expert_size=self.expert_size // tp_size)

    def window(self, layer: int) -> int | None:
        return self.layer_windows[layer] if self.layer_windows else None

    def scores(self, layer: int) -> Scores:
        if self.gemma is None:
            return Scores(self.head_dim ** -0.5, None, self.window(layer))
        return Scores(self.gemma.query_scale, self.gemma.attn_softcap, self.window(layer))

    def long_rope_limit(self) -> int | None:
        """LongRoPE's original_max_position_embeddings. Within it transformers rotates with
        the short factors; once a sequence grows past it, generate drops its cache and
        computes the whole sequence again with the long factors (Phi-3's
        prepare_inputs_for_generation), which pdserve does not do: the engine refuses a
        --max-model-len past it."""
        s = self.rope_scaling
        return s["original_max_position_embeddings"] if s and s["rope_type"] == "longrope" \
            else None

    def kv_shape(self, block_size: int, layout: str) -> KVShape:
        return KVShape(self.num_layers, self.num_kv_heads, self.head_dim, block_size, layout)


@dataclass(slots=True)
class Chunk:
    """A multi-token query of one sequence: flat tokens [start, end) at positions
    [pos, pos + end - start), reading blocks `table`."""
    start: int
    end: int
    pos: int
    table: torch.Tensor  # [1, n] block ids covering pos + (end - start) tokens


def longs(values: Sequence[int]) -> torch.Tensor:
    """An int64 tensor of values (nested: rows of equal length), through numpy: torch.tensor
    of a list takes ~5x longer (64 ints 7.5 us, 600 ints 53 us, against 1.5 and 7.4)."""
    return torch.from_numpy(np.array(values, dtype=np.int64))


@dataclass(slots=True)
class DecodeGroup:
    """Single-token queries attended in one call: flat tokens `index` [g], reading block
    tables [g, n], `lens` [g] tokens each."""
    index: torch.Tensor
    tables: torch.Tensor
    lens: torch.Tensor

    @classmethod
    def build(cls, index: list[int], tables: torch.Tensor, lens: list[int]) -> DecodeGroup:
        return cls(longs(index), tables, longs(lens))


@dataclass(slots=True)
class Batch:
    input_ids: torch.Tensor  # [T]
    positions: torch.Tensor  # [T]
    slot_blocks: torch.Tensor  # [T]: where each token's K/V is stored
    slot_offsets: torch.Tensor  # [T]
    logits_index: torch.Tensor  # [B]: tokens whose next-token logits are wanted
    decodes: list[DecodeGroup] = field(default_factory=list)
    chunks: list[Chunk] = field(default_factory=list)

    def to(self, device: torch.device) -> Batch:
        if device.type == "cpu":
            return self
        move = {k: v.to(device, non_blocking=True) for k in self.__slots__
                if isinstance(v := getattr(self, k), torch.Tensor)}
        chunks = [Chunk(c.start, c.end, c.pos, c.table.to(device)) for c in self.chunks]
        decodes = [DecodeGroup(*(x.to(device, non_blocking=True)
                                 for x in (d.index, d.tables, d.lens)))
                   for d in self.decodes]
        return Batch(**{**{k: getattr(self, k) for k in self.__slots__}, **move,
                        "chunks": chunks, "decodes": decodes})


@dataclass(slots=True)
class Layer:
    ln1: torch.Tensor
    qkv: Linear
    qkv_bias: torch.Tensor | None
    q_norm: torch.Tensor | None  # [head_dim], with k_norm (Qwen3)
    k_norm: torch.Tensor | None
    o: Linear
    ln2: torch.Tensor  # before the MLP
    gate_up: Linear | None  # a dense MLP's, or
    down: Linear | None
    experts: Experts | None  # a mixture of experts
    scores: Scores  # its attention's scale, cap and window
    rope: int = 0  # which of the model's RoPE tables (Gemma 3: 1 for sliding layers)
    post_attn: torch.Tensor | None = None  # Gemma: norms of the attention's and the MLP's
    post_mlp: torch.Tensor | None = None  # outputs, before the residual sum


class LlamaModel:
    """`config` is this rank's (ModelConfig.shard); under tensor parallelism q/k/v and
    gate/up are split by output rows (heads), o and down by input columns, and `all_reduce`
    sums the partial o/down outputs across ranks. Embeddings and lm_head are replicated."""

    def __init__(self, config: ModelConfig, weights: Mapping[str, torch.Tensor],
                 dtype: torch.dtype, device: torch.device | str = "cpu",
                 max_len: int = 4096, tp_rank: int = 0,
                 all_reduce: Callable[[torch.Tensor], torch.Tensor] | None = None,
                 quantization: str | None = None, kv_dtype: torch.dtype | None = None
                 ) -> None:
        """kv_dtype: the cache's, where it is not dtype (--kv-cache-dtype fp8)."""
        self.config = config
        self.dtype = dtype
        weights = _unfused(weights, config)
        self.all_reduce = all_reduce or (lambda t: t)
        # Weights read as they are asked for (dummy, a GGUF file's) say their shapes: they
        # are not made just to be counted.
        shapes = weights.shapes.values() if hasattr(weights, "shapes") else \
            (t.shape for t in weights.values())
        self.gemm = gemm = Gemm.for_model(dtype, device, sum(
            s.numel() for s in shapes) * dtype.itemsize, quantization)
        self.ops = Elementwise.for_model(dtype, device)
        # The paged kernels read a cache of the model's dtype; an fp8 one is read by torch.
        self.paged = PagedAttention.for_model(config.num_heads, config.num_kv_heads,
                                              config.head_dim, dtype, device) \
            if kv_dtype in (None, dtype) else None
        sizes = {"q": config.num_heads * config.head_dim, "k": config.num_kv_heads *
                 config.head_dim, "v": config.num_kv_heads * config.head_dim,
                 "o": config.num_heads * config.head_dim, "gate": config.intermediate_size,
                 "up": config.intermediate_size, "down": config.intermediate_size}

        def w(name: str) -> torch.Tensor | Table:
            if name not in weights:
                raise ValueError(f"weights are missing tensor {name!r}")
            t = weights[name]
            if name.endswith("norm.weight") and config.norm_offset:  # before rounding
                t = t.float() + config.norm_offset
            stem = name.split(".")[-2]
            part = stem.removesuffix("_proj") if stem.endswith("_proj") else None
            if part in sizes:  # this rank's rows (column-parallel) or columns (row-parallel)
                n = config.expert_size if ".experts." in name else sizes[part]
                t = t.narrow(1 if part in ("o", "down") and len(t.shape) == 2 else 0,
                             tp_rank * n, n)
            return t if isinstance(t, Table) else t.to(device=device, dtype=dtype).contiguous()

        silu = config.activation == "silu"

        def mlp(prefix: str) -> Linear:  # gate and up, as one GEMM
            return gemm.weight(_cat([w(f"{prefix}.gate_proj.weight"),
                                      w(f"{prefix}.up_proj.weight")]), gated=silu)

        def experts(i: int) -> Experts | None:
            if i not in config.moe_layers:
                return None
            e = range(config.num_experts)
            return Experts(gemm.weight(w(f"{p}{i}.mlp.gate.weight")),
                           [mlp(f"{p}{i}.mlp.experts.{x}") for x in e],
                           [gemm.weight(w(f"{p}{i}.mlp.experts.{x}.down_proj.weight"))
                            for x in e], config.experts_per_token, config.renormalise_experts)

        p = "model.layers."
        g = config.gemma is not None  # Gemma's post_attention_layernorm follows attention

        def gemma_norm(i: int, name: str) -> torch.Tensor | None:
            return w(f"{p}{i}.{name}.weight") if g else None

        # Fused projections: one GEMM for q/k/v and one for gate/up.
        self.layers = [Layer(
            ln1=w(f"{p}{i}.input_layernorm.weight"),
            qkv=gemm.weight(_cat([w(f"{p}{i}.self_attn.{x}_proj.weight") for x in "qkv"])),
            qkv_bias=(torch.cat([w(f"{p}{i}.self_attn.{x}_proj.bias") for x in "qkv"])
                      if config.qkv_bias else None),
            q_norm=w(f"{p}{i}.self_attn.q_norm.weight") if config.qk_norm else None,
            k_norm=w(f"{p}{i}.self_attn.k_norm.weight") if config.qk_norm else None,
            o=gemm.weight(w(f"{p}{i}.self_attn.o_proj.weight")),
            ln2=w(f"{p}{i}.{'pre_feedforward' if g else 'post_attention'}_layernorm.weight"),
            gate_up=None if i in config.moe_layers else mlp(f"{p}{i}.mlp"),
            down=None if i in config.moe_layers else
            gemm.weight(w(f"{p}{i}.mlp.down_proj.weight")),
            experts=experts(i), scores=config.scores(i),
            rope=int(config.local_rope_theta is not None and config.window(i) is not None),
            post_attn=gemma_norm(i, "post_attention_layernorm"),
            post_mlp=gemma_norm(i, "post_feedforward_layernorm"),
        ) for i in range(config.num_layers)]
        # Quantized, the lm_head keeps 8 bits (Q8_0), as llama.cpp's quantizer keeps its output
        # tensor at 6 to 8 bits: at 4 the embedded SmolLM2 lost 30 % of perplexity, 21 % with
        # it at 8 (docs/quantization.md). A tied embedding is the same copy; an untied one,
        # read a row per token, takes the weights' bits.
        tied = config.tie_word_embeddings
        embed = w("model.embed_tokens.weight")
        self.lm_head = gemm.weight(embed if tied else w("lm_head.weight"), head=True)
        self.embed: torch.Tensor | QuantWeight = \
            self.lm_head if tied and isinstance(self.lm_head, QuantWeight) else \
            embed.packed() if isinstance(embed, Table) else \
            quant.quantize(embed, gemm.bits) if gemm.bits else embed
        self.norm = w("model.norm.weight")
        self.ropes = [_rope_table(config, theta, config.rope_scaling if i == 0 else None,
                                  max_len, device, dtype)
                      for i, theta in enumerate([config.rope_theta, config.local_rope_theta])
                      if theta is not None]
        self.embed_scale = gemma.embed_scale(config.hidden_size, dtype) if g else None
        # The MLP's first product and its gate: silu's in one call (Gemm.silu_mul).
        self.mlp_in: Callable[[torch.Tensor, Linear], torch.Tensor] = (
            (lambda x, w: gemm.silu_mul(x, w, self.ops.silu_mul)) if silu
            else lambda x, w: self.ops.gelu_tanh_mul(gemm(x, w)))
        # Called before each layer's attention and each of its MLP's GEMMs, a few ms apart in
        # a prefill: one borrowing idle cores adjusts its threads there (engine/core_loan.py).
        self.checkpoint: Callable[[], None] = _no_checkpoint
        self.native = self._native_layers(all_reduce is None)

    def _native_layers(self, one_rank: bool) -> NativeLayers | None:
        """Decode steps' layers in one native call, where every layer is a plain Llama one
        with its products pair-packed (no biases, q/k norms, post-norms, experts or second
        RoPE table; SiLU; one rank)."""
        c, lib = self.config, self.gemm.lib
        plain = one_rank and lib is not None and self.paged is not None and all(
            all(isinstance(w, Weight) for w in (x.qkv, x.o, x.gate_up, x.down))
            and x.gate_up.gated and x.qkv_bias is None and x.q_norm is None and
            x.post_attn is None and x.post_mlp is None and x.experts is None and x.rope == 0
            for x in self.layers)
        if not plain:
            return None
        return NativeLayers(lib, [LayerWeights(x.ln1, x.qkv.pairs, x.o.pairs, x.ln2,
                                               x.gate_up.pairs, x.down.pairs, x.scores)
                                  for x in self.layers],
                            Shape(c.hidden_size, c.num_heads, c.num_kv_heads, c.head_dim,
                                  c.intermediate_size, c.rms_norm_eps), PAIR_ROWS)

    @torch.inference_mode()
    def forward(self, batch: Batch, cache: KVCache) -> torch.Tensor:
        """Run the batch, store its K/V in `cache`, return float32 logits [B, vocab]."""
        c = self.config
        # index_select: a third of indexing's cost in a decode step (3 against 9 us)
        h = quant.rows(self.embed, batch.input_ids, self.dtype) if isinstance(
            self.embed, QuantWeight) else self.embed.index_select(0, batch.input_ids)
        if self.embed_scale is not None:
            h = h * self.embed_scale
        ropes = [(cos.index_select(0, batch.positions), sin.index_select(0, batch.positions))
                 for cos, sin in self.ropes]
        delta = None
        if self.native is not None and not batch.chunks and len(batch.decodes) == 1 and \
                h.shape[0] <= self.native.max_rows:
            d = batch.decodes[0]
            delta = self.native.run(h, ropes[0], (batch.slot_blocks, batch.slot_offsets),
                                    (d.index, d.tables, d.lens), cache,
                                    None if self.checkpoint is _no_checkpoint else self.checkpoint)
            if delta is None:  # this CPU's build cannot: the Python loop from now on
                self.native = None
        if delta is None:
            delta = self._layers(h, batch, cache, ropes)
        rows = batch.logits_index  # the last sum only where logits are wanted
        h = self.ops.rms_norm(h.index_select(0, rows), self.norm, c.rms_norm_eps,
                              delta.index_select(0, rows))
        # The sampler and logprobs see the capped logits, as HF's generate does.
        return gemma.softcap(self.gemm(h, self.lm_head).float(),
                             c.gemma.final_softcap if c.gemma else None)

    def _layers(self, h: torch.Tensor, batch: Batch, cache: KVCache,
                ropes: list[tuple[torch.Tensor, torch.Tensor]]) -> torch.Tensor:
        """The decoder layers over h (summed in place); returns the last one's output."""
        c, linear = self.config, self.gemm
        # The residual stream h takes each attention's and MLP's output (`delta`) in the
        # call of the norm after it: the sum and the norm in one pass.
        delta = None
        for i, layer in enumerate(self.layers):
            self.checkpoint()
            x = self.ops.rms_norm(h, layer.ln1, c.rms_norm_eps, delta)
            qkv = linear(x, layer.qkv, layer.qkv_bias)
            if layer.q_norm is not None:
                self._qk_norm(qkv, layer)
            q, k, v = self.ops.rope_store(qkv, c.num_heads, *ropes[layer.rope], cache, i,
                                          batch.slot_blocks, batch.slot_offsets)
            out = self.all_reduce(linear(self._attention(i, q, k, v, batch, cache), layer.o))
            delta = self._post_norm(out, layer.post_attn)
            self.checkpoint()
            x = self.ops.rms_norm(h, layer.ln2, c.rms_norm_eps, delta)
            if layer.experts is not None:
                delta = self.all_reduce(layer.experts(x, linear, self.ops))
                continue
            x = self.mlp_in(x, layer.gate_up)
            self.checkpoint()
            delta = self._post_norm(self.all_reduce(linear(x, layer.down)), layer.post_mlp)
        return delta

    def _post_norm(self, x: torch.Tensor, weight: torch.Tensor | None) -> torch.Tensor:
        return x if weight is None else self.ops.rms_norm(x, weight, self.config.rms_norm_eps)

    def _qk_norm(self, qkv: torch.Tensor, layer: Layer) -> None:
        """Normalise each head of q and k (the first two parts of qkv), in place."""
        c, n = self.config, qkv.shape[0]
        for weight, first, heads in ((layer.q_norm, 0, c.num_heads),
                                     (layer.k_norm, c.num_heads, c.num_kv_heads)):
            part = qkv[:, first * c.head_dim:(first + heads) * c.head_dim]
            normed = self.ops.rms_norm(part.reshape(n * heads, c.head_dim), weight,
                                       c.rms_norm_eps)
            part.copy_(normed.view(n, heads * c.head_dim))

    def _attention(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                   batch: Batch, cache: KVCache) -> torch.Tensor:
        out = torch.empty_like(q)
        scores = self.layers[layer].scores
        for d in batch.decodes:
            if self.paged is not None:
                self.paged.decode(q, out, d.index, cache, layer, d.tables, d.lens, scores)
                continue
            kc, vc = (x.to(q.dtype) for x in cache.gather(layer, d.tables))
            out[d.index] = attention.decode(q[d.index], kc, vc, d.lens, scores)
        for ch in batch.chunks:
            if self.paged is not None:
                self.paged.chunk(q[ch.start:ch.end], out[ch.start:ch.end], cache, layer,
                                 ch.table, ch.pos, scores)
                continue
            # Nothing cached before this chunk: attend to its own K/V (as the cache holds them,
            # unless it rounds them to fp8: then to the cache's, as later chunks do).
            if ch.pos == 0 and cache.tensor.dtype == q.dtype:
                kc, vc = k[ch.start:ch.end].transpose(0, 1), v[ch.start:ch.end].transpose(0, 1)
            else:
                kc, vc = (x[0].to(q.dtype) for x in cache.gather(layer, ch.table))
            out[ch.start:ch.end] = attention.chunk(q[ch.start:ch.end], kc, vc, ch.pos, scores)
        return out.flatten(1)


def _cat(parts: list[torch.Tensor | Table]) -> torch.Tensor | Table:
    """Weights joined into one product's (q/k/v, gate/up). Stored in different formats (a
    Q4_K_M file's v in Q6_K beside q and k in Q4_K), they are joined dequantized, and the
    model quantizes the product to Q8_0."""
    if all(isinstance(t, torch.Tensor) for t in parts):
        return torch.cat(parts)
    if all(isinstance(t, Table) for t in parts) and \
            len({(t.bits, t.mins is None) for t in parts}) == 1:
        return Table.cat(parts)
    return torch.cat([t.dequantized() if isinstance(t, Table) else t.float() for t in parts])


def _no_checkpoint() -> None:
    pass


def _windows(arch: str, c: dict) -> tuple[int | None, ...]:
    """Each layer's sliding window, as transformers assigns them: layer_types where the
    config lists them; Qwen's layers from max_window_layers on; else every layer."""
    window = c.get("sliding_window")
    if not window or not c.get("use_sliding_window", arch not in _QWEN):
        return ()
    if types := c.get("layer_types"):
        return tuple(window if t == "sliding_attention" else None for t in types)
    first = c.get("max_window_layers", 0) if arch in _QWEN else 0
    return tuple(window if i >= first else None for i in range(c["num_hidden_layers"]))


def _rope_scaling(kind: str, rope: dict, c: dict) -> dict | None:
    """The RoPE scaling parameters _rope_table reads, with transformers' defaults filled in."""
    if kind == "default":
        return None
    if kind != "longrope":
        return {**rope, "rope_type": kind}
    old = rope.get("original_max_position_embeddings") or c["original_max_position_embeddings"]
    factor = rope.get("factor") or c["max_position_embeddings"] / old
    scale = rope.get("attention_factor") or (
        math.sqrt(1 + math.log(factor) / math.log(old)) if factor > 1 else 1.0)
    return {"rope_type": kind, "short_factor": rope["short_factor"],
            "long_factor": rope["long_factor"], "original_max_position_embeddings": old,
            "attention_factor": scale}


def _moe(arch: str, c: dict) -> dict:
    """ModelConfig's mixture-of-experts fields from an HF config."""
    if arch == "mixtral":  # every layer routed, over experts of intermediate_size
        return {"moe_layers": tuple(range(c["num_hidden_layers"])),
                "num_experts": c["num_local_experts"],
                "experts_per_token": c["num_experts_per_tok"],
                "expert_size": c["intermediate_size"]}
    # Qwen's own configs say num_experts; transformers 5 writes num_local_experts.
    experts = c.get("num_experts") or c.get("num_local_experts")
    if arch != "qwen3_moe" or not experts:
        return {}
    step, dense = c.get("decoder_sparse_step", 1), set(c.get("mlp_only_layers") or [])
    return {"moe_layers": tuple(i for i in range(c["num_hidden_layers"])
                                if i not in dense and (i + 1) % step == 0),
            "num_experts": experts, "experts_per_token": c["num_experts_per_tok"],
            "expert_size": c["moe_intermediate_size"],
            "renormalise_experts": bool(c.get("norm_topk_prob", False))}


# Mixtral's names for its routed MLP, and Qwen3-MoE's (Llama's style) for the same.
_MIXTRAL_NAMES = ((".block_sparse_moe.", ".mlp."), (".w1.", ".gate_proj."),
                  (".w3.", ".up_proj."), (".w2.", ".down_proj."))
# A multimodal Gemma 3's language model (transformers 5's names, then earlier ones).
_LM_PREFIXES = (("model.language_model.", "model."), ("language_model.model.", "model."),
                ("language_model.lm_head.", "lm_head."))


def _unfused(weights: Mapping[str, torch.Tensor], config: ModelConfig
             ) -> Mapping[str, torch.Tensor]:
    """Weights under one set of names. Phi-3 stores q/k/v as one qkv_proj and gate/up as
    one gate_up_proj: split into Llama's names, so that tensor parallelism slices each part
    (the fused tensors hold every rank's heads). Mixtral's experts are renamed, and a
    multimodal Gemma 3's language model (its vision tower is left unread). Weights already
    so named are returned as they are (dummy weights are made as they are read)."""
    renamed = tuple(old for old, _ in _LM_PREFIXES)
    if not any(n.startswith(renamed) or ".block_sparse_moe." in n or
               n.endswith(("qkv_proj.weight", "gate_up_proj.weight")) for n in weights):
        return weights
    out = {}
    for name, t in weights.items():
        for old, new in _LM_PREFIXES:
            if name.startswith(old):
                name = new + name.removeprefix(old)
        if ".block_sparse_moe." in name:
            for old, new in _MIXTRAL_NAMES:
                name = name.replace(old, new)
        out[name] = t
    for name in [n for n in weights if n.endswith(("qkv_proj.weight", "gate_up_proj.weight"))]:
        t, base = out.pop(name), name.rsplit(".", 2)[0]
        if name.endswith("gate_up_proj.weight"):
            out[f"{base}.gate_proj.weight"], out[f"{base}.up_proj.weight"] = t.chunk(2)
            continue
        # Rows: q, then k and v, in the proportion num_heads : num_kv_heads : num_kv_heads
        # (this rank's config keeps the proportion of the whole model's).
        unit = t.shape[0] // (config.num_heads + 2 * config.num_kv_heads)
        q, kv = config.num_heads * unit, config.num_kv_heads * unit
        for part, rows in zip("qkv", t.split([q, kv, kv]), strict=True):
            out[f"{base}.{part}_proj.weight"] = rows
    return out


def _rope_table(c: ModelConfig, theta: float, scaling: dict | None, max_len: int,
                device: torch.device | str, dtype: torch.dtype
                ) -> tuple[torch.Tensor, torch.Tensor]:
    """cos and sin [max_len, rotary dims] for positions 0 .. max_len - 1 (sin with
    rotate_half's sign in its first half), computed in float32 and rounded to dtype.
    LongRoPE: its short factors, which transformers uses while a sequence is within
    original_max_position_embeddings (the engine refuses longer ones), and its attention
    factor on both."""
    dim = c.rotary_dim or c.head_dim
    exponents = torch.arange(0, dim, 2, dtype=torch.float32) / dim
    kind, gain = scaling["rope_type"] if scaling else "default", 1.0
    if kind == "longrope":
        factors = torch.tensor(scaling["short_factor"], dtype=torch.float32)
        inv_freq = 1.0 / (factors * theta ** exponents)
        gain = scaling["attention_factor"]
    else:
        inv_freq = 1.0 / (theta ** exponents)
    if kind == "llama3":
        inv_freq = _llama3_scaling(inv_freq, scaling)
    elif kind == "linear":
        inv_freq = inv_freq / scaling["factor"]
    freqs = torch.outer(torch.arange(max_len, dtype=torch.float32), inv_freq)
    cos, sin = freqs.cos() * gain, freqs.sin() * gain
    return (torch.cat((cos, cos), -1).to(device, dtype),
            torch.cat((-sin, sin), -1).to(device, dtype))


def _llama3_scaling(inv_freq: torch.Tensor, s: dict) -> torch.Tensor:
    """Llama 3.1's frequency-dependent RoPE scaling."""
    factor, low, high = s["factor"], s["low_freq_factor"], s["high_freq_factor"]
    old_len = s["original_max_position_embeddings"]
    wavelen = 2 * math.pi / inv_freq
    smooth = (old_len / wavelen - low) / (high - low)
    scaled = torch.where(wavelen > old_len / low, inv_freq / factor, inv_freq)
    mid = (wavelen <= old_len / low) & (wavelen >= old_len / high)
    return torch.where(mid, (1 - smooth) * inv_freq / factor + smooth * inv_freq, scaled)
