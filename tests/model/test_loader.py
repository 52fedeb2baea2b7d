"""Finding weights: random ones of a config's shape (`--load-format dummy`), and a folder
with a config but no weights refused with the way out named."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from pdserve.config import EngineConfig
from pdserve.engine.build import build_engine
from pdserve.engine.request import Request
from pdserve.model import loader
from tests.utils import TINY_LLAMA, greedy, run_engine

REPO = Path(__file__).parent.parent.parent


@pytest.fixture
def config_only(tmp_path: Path) -> Path:
    (tmp_path / "config.json").write_text(json.dumps({**TINY_LLAMA, "vocab_size": 49152}))
    return tmp_path


def test_dummy_weights_have_transformers_shapes_and_the_same_values_each_time(config_only):
    a, b = loader.dummy_state_dict(config_only), loader.dummy_state_dict(config_only)
    # each made as it is read, seeded by its name: the same whatever the order
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in reversed(list(a)))
    h, i = TINY_LLAMA["hidden_size"], TINY_LLAMA["intermediate_size"]
    assert a["model.embed_tokens.weight"].shape == (49152, h)
    assert a["model.layers.1.mlp.down_proj.weight"].shape == (h, i)
    assert torch.equal(a["model.norm.weight"], torch.ones(h))
    assert 0.015 < a["model.layers.0.self_attn.q_proj.weight"].std() < 0.025


def test_a_config_without_weights_is_refused_naming_dummy(config_only):
    with pytest.raises(loader.ModelLoadError, match="no \\*.safetensors.*--load-format dummy"):
        loader.load_state_dict(config_only)


@pytest.mark.parametrize("quantization", [None, "int8", "int4"])
def test_an_engine_serves_dummy_weights_with_the_embedded_tokenizer(config_only, quantization):
    engine = build_engine(EngineConfig(model=str(config_only), dtype="float32",
                                       load_format="dummy", quantization=quantization,
                                       num_kv_blocks=16))
    assert engine.tokenizer.vocab_size == 49152
    out = run_engine(engine, [Request("a", engine.tokenizer.encode("Hello"), greedy(4))])
    assert len(out["a"].token_ids) == 4


@pytest.mark.parametrize("name", ["llama-3.2-1b", "qwen3-0.6b", "llama-3.1-8b"])
def test_the_benchmark_shapes_are_configs_transformers_reads(name):
    from transformers import AutoConfig

    config = AutoConfig.from_pretrained(REPO / "benchmarks" / "models" / name)
    assert config.vocab_size == 49152
    assert config.tie_word_embeddings == (name != "llama-3.1-8b")  # as the originals
