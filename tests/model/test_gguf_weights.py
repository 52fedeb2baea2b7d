"""A GGUF file's tensors read as stored (`--quantization gguf`): each block format decoded to
the weights the `gguf` package's own dequantizer gives, the embedded model's file to the
tensors transformers converts it to (q and k rows in its order), a whole engine serving it,
and the refusals."""

from __future__ import annotations

import gguf
import numpy as np
import pytest
import torch

from pdserve.config import ConfigError, EngineConfig
from pdserve.engine.build import build_engine
from pdserve.engine.request import Request
from pdserve.model import gguf_weights, loader, quant
from pdserve.model.llama import _cat
from pdserve.model.quant import Table
from tests.utils import greedy, run_engine

KINDS = gguf.GGMLQuantizationType


def _blocks(kind: str, w: np.ndarray) -> np.ndarray:
    """w [n, k] in `kind`, as llama.cpp stores it. The gguf package quantizes all but Q4_K;
    Q4_K blocks are random bytes under finite float16 d and dmin (any such bytes are one)."""
    if kind != "Q4_K":
        return gguf.quants.quantize(w, KINDS[kind])
    rng = np.random.default_rng(0)
    blocks = rng.integers(0, 256, (w.shape[0], w.shape[1] // 256, 144), dtype=np.uint8)
    blocks[..., :4] = rng.uniform(0.001, 0.01, (*blocks.shape[:2], 2)).astype(
        np.float16).view(np.uint8)
    return blocks.reshape(w.shape[0], -1)


@pytest.mark.parametrize("kind", gguf_weights.STORED)
def test_each_block_format_decodes_to_the_gguf_packages_weights(kind):
    w = np.random.default_rng(1).standard_normal((24, 512)).astype(np.float32)
    blocks = _blocks(kind, w)
    t = gguf_weights.table(kind, torch.from_numpy(blocks), 24)
    assert t.shape == (24, 512) and t.bits == (8 if kind == "Q8_0" else 4)
    assert (t.mins is not None) == (kind in ("Q4_1", "Q4_K"))
    want = torch.from_numpy(gguf.quants.dequantize(blocks, KINDS[kind]))
    got = t.dequantized()
    if kind != "Q4_K":
        assert torch.equal(got, want)
        return
    # Q4_K's group scale d * sc and min dmin * m rounded to float16: within 2^-11 of each
    scale, low = t.scales.float().unsqueeze(-1), t.mins.float().unsqueeze(-1).abs()
    bound = 2**-11 * (15 * scale + low) * 1.001
    assert ((got - want).abs().unflatten(-1, (-1, 32)) <= bound).all()
    assert t.q.min() >= 0 and t.q.max() <= 15


@pytest.mark.parametrize(("kind", "bits"), [("Q8_0", 8), ("Q4_0", 4)])
def test_int8_and_int4_quantize_as_llama_cpps_quantizer(kind, bits):
    """--quantization int8 / int4 make, from float weights, the file llama-quantize would:
    the same quants and scales (the gguf package holds llama.cpp's reference quantizers)."""
    w = torch.randn(64, 1024, generator=torch.Generator().manual_seed(2)) * torch.logspace(
        -3, 2, 1024)
    want = gguf_weights.table(kind, torch.from_numpy(gguf.quants.quantize(w.numpy(),
                                                                          KINDS[kind])), 64)
    q, scales, _ = quant.unpacked(quant.quantize(w, bits))
    assert torch.equal(q, want.q) and torch.equal(scales, want.scales.float())


def test_the_embedded_file_reads_as_transformers_converts_it():
    """Every Q4_1 and Q8_0 tensor decoded, q and k rows put back in transformers' order, the
    norms read: equal to the float32 folder transformers converts the file to, weight for
    weight, with no conversion of the weights made first."""
    stored = gguf_weights.GGUFWeights(loader.embedded_gguf(), loader.resolve(None, False))
    converted = loader.load_state_dict(loader.resolve(None))
    assert set(stored) == set(converted) | {"lm_head.weight"}  # tied: the embedding's
    assert not list(loader.resolve(None, False).glob("*.safetensors"))  # read from the file
    kinds = {}
    for name, want in converted.items():
        t = stored[name]
        kinds[name] = (t.bits, t.mins is not None) if isinstance(t, Table) else "float"
        got = t.dequantized() if isinstance(t, Table) else t
        assert torch.equal(got, want), name
    assert kinds["model.embed_tokens.weight"] == (8, False)  # Q8_0
    assert kinds["model.layers.0.self_attn.k_proj.weight"] == (4, True)  # Q4_1
    assert kinds["model.norm.weight"] == "float"
    assert sum(k == (4, True) for k in kinds.values()) == 30 * 7


def test_an_engine_serves_the_embedded_file_as_stored():
    engine = build_engine(EngineConfig(dtype="float32", quantization="gguf", num_kv_blocks=16))
    model = engine.runner.model
    assert model.layers[0].qkv.mins is not None and model.embed.bits == 8
    assert model.lm_head is model.embed  # tied: one copy
    out = run_engine(engine, [Request("a", engine.tokenizer.encode("The capital of France is"),
                                      greedy(6))])
    assert "Paris" in engine.tokenizer.decode(out["a"].token_ids)


def test_products_joined_from_different_formats_are_joined_dequantized():
    ones = _blocks("Q4_1", np.ones((8, 64), np.float32))
    q4 = gguf_weights.table("Q4_1", torch.from_numpy(ones), 8)
    v = torch.randn(8, 64)
    assert torch.equal(_cat([q4, v]), torch.cat([q4.dequantized(), v]))
    assert isinstance(_cat([q4, q4]), Table)


def test_an_hf_folder_or_dummy_weights_are_refused_with_the_way_out(tmp_path):
    with pytest.raises(ConfigError, match="--load-format dummy makes random ones"):
        EngineConfig(quantization="gguf", load_format="dummy").validate()
    folder = loader.resolve(None)  # an HF folder (the embedded file's conversion)
    with pytest.raises(loader.ModelLoadError, match="is an HF folder .*int8 or int4"):
        build_engine(EngineConfig(model=str(folder), quantization="gguf", num_kv_blocks=16))


def test_a_file_of_another_architecture_is_refused_naming_those_read(tmp_path):
    path = tmp_path / "other.gguf"
    writer = gguf.GGUFWriter(path, "gpt2")
    writer.add_tensor("token_embd.weight", np.zeros((4, 32), np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    with pytest.raises(loader.ModelLoadError, match="llama, qwen2, qwen3 models; other.gguf "
                                                    "holds a gpt2 model"):
        gguf_weights.GGUFWeights(path, tmp_path)
