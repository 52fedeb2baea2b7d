"""`pdserve bench weights`: a shape's random weights written as an HF folder hold exactly
what `--load-format dummy` serves, in shards with transformers' index, with the tokenizer."""

from __future__ import annotations

import json
from pathlib import Path

import torch

from pdserve.bench import weights
from pdserve.model import loader
from tests.utils import TINY_LLAMA


def test_the_folder_holds_the_dummy_weights_in_indexed_shards(tmp_path: Path):
    shape = tmp_path / "shape"
    shape.mkdir()
    (shape / "config.json").write_text(json.dumps({**TINY_LLAMA, "vocab_size": 49152,
                                                   "tie_word_embeddings": True}))
    out = tmp_path / "hf"
    assert weights.main(["--model", str(shape), "--out", str(out), "--dtype", "float32",
                         "--shard-gib", str(10e6 / 2**30)]) == 0
    shards = sorted(out.glob("*.safetensors"))
    assert len(shards) > 1 and shards[0].name == f"model-00001-of-{len(shards):05d}.safetensors"
    index = json.loads((out / "model.safetensors.index.json").read_text())["weight_map"]
    want = loader.dummy_state_dict(shape)
    got = loader.load_state_dict(out)
    assert set(index) == set(got) == set(want) - {"lm_head.weight"}  # tied: the embedding
    assert all(torch.equal(got[k], want[k]) for k in got)
    assert (out / "tokenizer.json").exists()
    assert loader.load_config(out)["torch_dtype"] == "float32"
