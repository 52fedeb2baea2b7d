"""Gemma 2 and Gemma 3 (text) as a Llama with differences, read from their HF config:
embeddings scaled by sqrt(hidden), RMSNorm weights stored as an offset from 1, GeGLU (tanh
GELU), norms after attention and around the MLP, scores scaled by query_pre_attn_scalar,
Gemma 2's soft-capping of attention scores and final logits, Gemma 3's q/k head norms and
its own RoPE base for sliding layers, sliding-window layers interleaved with global ones."""

from __future__ import annotations

from dataclasses import dataclass

import torch

ARCHITECTURES = ("gemma2", "gemma3_text", "gemma3")
# HF's names for tanh-approximated GELU; Gemma's checkpoints name the first.
GELU_TANH = ("gelu_pytorch_tanh", "gelu_python_tanh")


@dataclass(frozen=True, slots=True)
class Gemma:
    query_scale: float  # query_pre_attn_scalar ** -0.5, in place of head_dim ** -0.5
    attn_softcap: float | None  # Gemma 2: scores become cap * tanh(score / cap)
    final_softcap: float | None  # and so do the logits


def text_config(c: dict) -> dict:
    """A `gemma3` (multimodal) config's language model: its text_config, as gemma3_text."""
    if c.get("model_type") != "gemma3":
        return c
    return {**c["text_config"], "model_type": "gemma3_text",
            "eos_token_id": c["text_config"].get("eos_token_id", c.get("eos_token_id"))}


def config_fields(c: dict) -> dict:
    """ModelConfig's fields for a Gemma 2 / Gemma 3 text config (ValueError if unsupported)."""
    arch = c["model_type"]
    act = c.get("hidden_activation") or c.get("hidden_act", GELU_TANH[0])
    if act not in GELU_TANH:
        raise ValueError(f"unsupported hidden_activation {act!r} (supported: "
                         f"{', '.join(GELU_TANH)})")
    if c.get("use_bidirectional_attention"):
        raise ValueError("use_bidirectional_attention (an embedding model) is not supported")
    n = c["num_hidden_layers"]
    default = ["sliding_attention" if (i + 1) % (2 if arch == "gemma2" else
               c.get("sliding_window_pattern", 6)) else "full_attention" for i in range(n)]
    types = c.get("layer_types") or default
    window = c.get("sliding_window")
    gemma2 = arch == "gemma2"
    fields = {
        "gemma": Gemma(c.get("query_pre_attn_scalar", 256) ** -0.5,
                       c.get("attn_logit_softcapping") if gemma2 else None,  # HF's Gemma 3
                       c.get("final_logit_softcapping")),                    # ignores it
        "layer_windows": tuple(window if t == "sliding_attention" else None for t in types),
        "norm_offset": 1.0, "activation": "gelu_tanh",
    }
    if not gemma2:
        fields.update(_gemma3_rope(c))
    return fields


def _gemma3_rope(c: dict) -> dict:
    """Global layers' RoPE (base and scaling) and sliding layers' base: transformers 5 nests
    them by layer type in rope_parameters; earlier configs say rope_theta, rope_scaling and
    rope_local_base_freq."""
    nested = c.get("rope_parameters") or {}
    if "full_attention" in nested:
        full, local = nested["full_attention"] or {}, nested.get("sliding_attention") or {}
    else:
        full = {"rope_theta": c.get("rope_theta", 1e6), **(c.get("rope_scaling") or {})}
        local = {"rope_theta": c.get("rope_local_base_freq", 1e4)}
    if local.get("rope_type", local.get("type", "default")) != "default":
        raise ValueError("unsupported RoPE scaling on sliding-window layers")
    return {"rope_parameters": full, "local_rope_theta": local.get("rope_theta", 1e4)}


def softcap(x: torch.Tensor, cap: float | None) -> torch.Tensor:
    return x if cap is None else torch.tanh(x / cap) * cap


def embed_scale(hidden_size: int, dtype: torch.dtype) -> torch.Tensor:
    """sqrt(hidden) rounded to the model's dtype, as HF multiplies embeddings by it."""
    return torch.tensor(hidden_size ** 0.5, dtype=dtype)
