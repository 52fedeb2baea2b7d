"""Checkpoints stored quantized, read as stored: compressed-tensors checkpoints written by
the library itself decode to the weights its own decompressor gives; AWQ's packing to what
its converter to compressed-tensors reads; GPTQ's and FP8's to their formulas; an engine
serves a checkpoint with its method found in its config; the refusals."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file

from pdserve.config import ConfigError, EngineConfig
from pdserve.engine.build import build_engine
from pdserve.engine.request import Request
from pdserve.model import loader
from pdserve.model.checkpoint_weights import AWQ_ORDER, CheckpointWeights, UnsupportedCheckpoint
from pdserve.model.quant import QuantWeight, Table
from tests.utils import TINY_LLAMA, greedy, hf_greedy, run_engine, write_compressed

INT4 = {"num_bits": 4, "type": "int", "strategy": "group", "group_size": 32}
INT8 = {"num_bits": 8, "type": "int", "strategy": "channel"}
FP8 = {"num_bits": 8, "type": "float", "strategy": "channel"}
CASES = {"int4": ("pack-quantized", INT4), "int4-asym-g64": (
    "pack-quantized", {**INT4, "group_size": 64, "symmetric": False}),
    "int8-w8a16": ("pack-quantized", INT8), "int8-w8a8": ("int-quantized", INT8),
    "fp8": ("float-quantized", FP8)}


def _library_weights(folder: Path, fmt: str, args: dict) -> dict[str, torch.Tensor]:
    """Every quantized weight as compressed-tensors decompresses it, scales in float32."""
    from compressed_tensors.compressors import BaseCompressor
    from compressed_tensors.quantization import QuantizationArgs, QuantizationScheme

    scheme = QuantizationScheme(targets=["Linear"], weights=QuantizationArgs(**args))
    compressor = BaseCompressor.get_value_from_registry(fmt)
    stored = loader.load_state_dict(folder)
    out = {}
    for stem in {k.rsplit(".", 1)[0] for k in stored if k.endswith(".weight_scale")}:
        module = {k.rsplit(".", 1)[1]: v for k, v in stored.items() if k.startswith(stem + ".")}
        module["weight_scale"] = module["weight_scale"].float()
        out[stem + ".weight"] = compressor.decompress(module, scheme)["weight"].float()
    return out


@pytest.mark.parametrize("case", CASES)
def test_compressed_tensors_checkpoints_read_as_the_library_decompresses(
        case, tiny_llama, tmp_path):
    fmt, args = CASES[case]
    folder = write_compressed(tiny_llama, tmp_path / case, fmt, **args)
    weights = CheckpointWeights(folder)
    want = _library_weights(folder, fmt, args)
    assert len(want) == 2 * 7 and set(weights) == set(loader.shapes(folder))
    for name, w in want.items():
        t = weights[name]
        if args["type"] == "float":  # read dequantized
            assert isinstance(t, torch.Tensor) and torch.equal(t, w), name
            continue
        assert isinstance(t, Table) and t.bits == args["num_bits"], name
        got, step = t.dequantized(), t.scales.float().repeat_interleave(32, 1)
        if case == "int4":  # Q4_0 as stored
            assert torch.equal(got, w) and t.mins is None
        elif t.mins is not None:  # w = q' * s + m, m rounded to float16: within 2^-11 of it
            assert ((got - w).abs() <= 2**-11 * t.mins.float().abs().repeat_interleave(
                32, 1)).all(), name
        else:  # int8: a -128 read as -127, one step up; all else equal
            diff = got - w
            assert ((diff == 0) | (diff == step)).all() and (diff != 0).float().mean() < 0.01
    assert not isinstance(weights["lm_head.weight"], Table)  # the checkpoint ignores it


def test_an_engine_serves_a_checkpoint_in_its_own_format(tiny_llama, tmp_path):
    """No --quantization: the method comes from the checkpoint (vLLM's way); int4 weights
    computed as stored; greedy output equal to transformers' on the weights compressed-tensors
    decompresses, up to steps nearer than the activations' Q8_0 rounding can move."""
    from transformers import AutoModelForCausalLM
    from transformers.utils.quantization_config import CompressedTensorsConfig

    folder = write_compressed(tiny_llama, tmp_path / "w4a16", "pack-quantized",
                              **{**INT4, "symmetric": False})
    config = EngineConfig(model=str(folder), dtype="float32", num_kv_blocks=16)
    engine = build_engine(config)
    layer = engine.runner.model.layers[0]
    assert config.quantization == "compressed-tensors"
    assert isinstance(layer.qkv, QuantWeight) and layer.qkv.bits == 4 and layer.qkv.mins is not None
    prompt = [1, 504, 3458, 282, 4649]
    got = run_engine(engine, [Request("a", prompt, greedy(12))])["a"].token_ids
    hf = AutoModelForCausalLM.from_pretrained(
        folder, dtype=torch.float32,
        quantization_config=CompressedTensorsConfig(run_compressed=False)).eval()
    ref = hf_greedy(hf, prompt, 12)
    pairs = zip(got, ref.tokens, strict=False)
    parted = next((i for i, (a, b) in enumerate(pairs) if a != b), None)
    assert parted is None or ref.margins[parted] < 0.1, (got, ref.tokens, ref.margins)
    with pytest.raises(ConfigError, match="stored quantized with compressed-tensors: serve it "
                                          "without --quantization int4"):
        build_engine(EngineConfig(model=str(folder), quantization="int4", num_kv_blocks=16))


def _folder(tmp: Path, quantization: dict, tensors: dict[str, torch.Tensor]) -> Path:
    """A tiny Llama's config stored quantized, with just `tensors` (the rest unread)."""
    tmp.mkdir(parents=True, exist_ok=True)
    config = {**TINY_LLAMA, "vocab_size": 256, "quantization_config": quantization}
    (tmp / "config.json").write_text(json.dumps(config))
    save_file(tensors, tmp / "model.safetensors")
    return tmp


def _words(values: torch.Tensor, bits: int) -> torch.Tensor:
    """Unsigned values [r, c] packed along c into int32 words, value i at bits i * bits."""
    w = (values.long().unflatten(-1, (-1, 32 // bits)) << torch.arange(0, 32, bits)).sum(-1)
    return torch.where(w >= 2**31, w - 2**32, w).to(torch.int32)


Q = "model.layers.0.self_attn.q_proj"  # [128, 128]
MIN_ROUNDING = 2**-11 * 15 * 0.011  # a min -z * s (z <= 15, s <= 0.011) rounded to float16


def _random(bits: int, groups: int, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    q = torch.randint(0, 1 << bits, (128, 128), generator=g)
    z = torch.randint(0, 1 << bits, (128, groups), generator=g)
    s = (torch.rand(128, groups, generator=g) / 100 + 1e-3).half()
    return q, z, s


def _want(q: torch.Tensor, z: torch.Tensor, s: torch.Tensor) -> torch.Tensor:
    size = q.shape[1] // s.shape[1]
    return (q - z.repeat_interleave(size, 1)) * s.float().repeat_interleave(size, 1)


def test_awq_reads_as_compressed_tensors_converts_it(tmp_path):
    from compressed_tensors.entrypoints.convert.converters import AutoAWQConverter

    q, z, s = _random(4, 2)  # groups of 64
    order = list(AWQ_ORDER)  # AWQ packs each 8 outputs' nibbles in its own order
    tensors = {f"{Q}.qweight": _words(q.t().unflatten(1, (-1, 8))[..., order].flatten(1), 4),
               f"{Q}.qzeros": _words(z.t().unflatten(1, (-1, 8))[..., order].flatten(1), 4),
               f"{Q}.scales": s.t().contiguous()}
    awq = {"quant_method": "awq", "bits": 4, "group_size": 64, "zero_point": True,
           "version": "gemm"}
    got = CheckpointWeights(_folder(tmp_path / "awq", awq, tensors))[f"{Q}.weight"]
    assert torch.allclose(got.dequantized(), _want(q, z, s), atol=MIN_ROUNDING)
    converted = AutoAWQConverter.from_autoawq_config(awq).process(dict(tensors))
    ct = {"quant_method": "compressed-tensors", "format": "pack-quantized", "config_groups": {
        "group_0": {"targets": ["Linear"], "weights": {**INT4, "group_size": 64,
                                                       "symmetric": False}}}}
    again = CheckpointWeights(_folder(tmp_path / "ct", ct, converted))[f"{Q}.weight"]
    assert torch.equal(again.q, got.q) and torch.equal(again.scales, got.scales)
    assert torch.equal(again.mins, got.mins)


def _gptq_tensors(q: torch.Tensor, zeros: torch.Tensor, s: torch.Tensor, g_idx: torch.Tensor,
                  bits: int) -> dict[str, torch.Tensor]:
    """GPTQ's layout: quants packed along the inputs ([k * bits / 32, n]), zero points along
    the outputs ([groups, n * bits / 32]), scales [groups, n], each input's group."""
    return {f"{Q}.qweight": _words(q, bits).t().contiguous(),
            f"{Q}.qzeros": _words(zeros.t().contiguous(), bits),
            f"{Q}.scales": s.t().contiguous(), f"{Q}.g_idx": g_idx.int()}


@pytest.mark.parametrize(("bits", "fmt", "symmetric"), [(4, "gptq", True), (4, "gptq_v2", False),
                                                        (8, "gptq", True)])
def test_gptq_reads_as_its_formula(tmp_path, bits, fmt, symmetric):
    """w = (q - z) * s; v1 files (AutoGPTQ's) store z - 1. Symmetric: z the range's middle."""
    q, z, s = _random(bits, 4)  # groups of 32
    if symmetric:
        z = torch.full_like(z, 1 << bits - 1)
    stored = z - int(fmt == "gptq")
    tensors = _gptq_tensors(q, stored, s, torch.arange(128) // 32, bits)
    gptq = {"quant_method": "gptq", "bits": bits, "group_size": 32, "desc_act": False,
            "sym": symmetric, "checkpoint_format": fmt}
    t = CheckpointWeights(_folder(tmp_path, gptq, tensors))[f"{Q}.weight"]
    want = _want(q, z, s)
    if symmetric:
        if bits == 8:  # -128 read as -127
            want = torch.maximum(want, -127 * s.float().repeat_interleave(32, 1))
        assert t.mins is None and torch.equal(t.dequantized(), want)
    else:
        assert t.mins is not None and torch.allclose(t.dequantized(), want, atol=MIN_ROUNDING)


def test_gptq_act_order_is_refused(tmp_path):
    q, z, s = _random(4, 4)
    order = torch.randperm(128, generator=torch.Generator().manual_seed(0))
    tensors = _gptq_tensors(q, z, s, order // 32, 4)
    weights = CheckpointWeights(_folder(tmp_path, {"quant_method": "gptq", "bits": 4,
                                                   "group_size": 32, "desc_act": True},
                                        tensors))
    with pytest.raises(UnsupportedCheckpoint, match="act-order"):
        weights[f"{Q}.weight"]


def test_compressed_tensors_act_order_is_refused(tiny_llama, tmp_path):
    """llm-compressor's GPTQ with actorder "group" stores each input's group (weight_g_idx)."""
    folder = write_compressed(tiny_llama, tmp_path / "w4a16", "pack-quantized", **INT4)
    tensors = loader.load_state_dict(folder)
    stem = "model.layers.0.self_attn.q_proj"
    tensors[f"{stem}.weight_g_idx"] = torch.arange(128) // 32  # consecutive: read
    config = json.loads((folder / "config.json").read_text())["quantization_config"]
    assert isinstance(CheckpointWeights(_folder(tmp_path / "a", config, tensors))[
        f"{stem}.weight"], Table)
    tensors[f"{stem}.weight_g_idx"] = torch.randperm(128) // 32
    weights = CheckpointWeights(_folder(tmp_path / "b", config, tensors))
    with pytest.raises(UnsupportedCheckpoint, match="act-order"):
        weights[f"{stem}.weight"]


def test_fp8_block_scales_read_dequantized(tmp_path):
    g = torch.Generator().manual_seed(0)
    w8 = (torch.randn(128, 128, generator=g) * 50).to(torch.float8_e4m3fn)
    scale = torch.rand(2, 2, generator=g)  # blocks of 64 x 64
    folder = _folder(tmp_path, {"quant_method": "fp8", "weight_block_size": [64, 64]},
                     {f"{Q}.weight": w8, f"{Q}.weight_scale_inv": scale})
    got = CheckpointWeights(folder)[f"{Q}.weight"]
    want = w8.float() * scale.repeat_interleave(64, 0).repeat_interleave(64, 1)
    assert torch.equal(got, want)


def test_a_method_pdserve_cannot_compute_is_refused_naming_those_it_can(tmp_path):
    folder = _folder(tmp_path, {"quant_method": "bitsandbytes"}, {"x": torch.zeros(1)})
    with pytest.raises(UnsupportedCheckpoint, match="quantized with 'bitsandbytes'; pdserve "
                                                    "serves .*compressed-tensors, gptq, awq, fp8"):
        build_engine(EngineConfig(model=str(folder), num_kv_blocks=16))
