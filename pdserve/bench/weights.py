"""Write a shape's random weights out as an HF folder, so that peers which cannot make them
(llama.cpp's converter, vLLM) load the very weights `--load-format dummy` serves: the
config, the weights (loader.DummyWeights, in safetensors shards of at most --shard-gib) and
the tokenizer (the config folder's, or the embedded model's for SmolLM2's vocabulary).

    pdserve bench weights --model benchmarks/models/llama-3.2-1b --out /tmp/llama-1b-hf
    ../shared/peer/llamacpp.sh gguf /tmp/llama-1b-hf /tmp/llama-1b-Q4_0.gguf Q4_0"""

from __future__ import annotations

import argparse
import json
import shutil
import sys
from pathlib import Path

import torch
from safetensors.torch import save_file

from pdserve.model import loader
from pdserve.model.loader import TORCH_DTYPES

TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja",
                   "special_tokens_map.json")


def _parse(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="pdserve bench weights", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", required=True, type=Path, help="a config folder")
    p.add_argument("--out", required=True, type=Path, help="the HF folder to write")
    p.add_argument("--dtype", default="bfloat16", choices=sorted(TORCH_DTYPES))
    p.add_argument("--shard-gib", type=float, default=2.0)
    return p.parse_args(argv)


def write(model: Path, out: Path, dtype: torch.dtype, shard_bytes: int) -> list[Path]:
    """The folder's files, weights shard by shard (the whole model is never in memory)."""
    weights = loader.dummy_state_dict(model)
    out.mkdir(parents=True, exist_ok=True)
    parts: list[Path] = []
    shard: dict[str, torch.Tensor] = {}
    index: dict[str, int] = {}

    def flush() -> None:
        parts.append(out / f"part-{len(parts) + 1}.safetensors")
        save_file(shard, parts[-1], metadata={"format": "pt"})
        shard.clear()

    tied = loader.load_config(model).get("tie_word_embeddings", False)
    for name in weights:
        if tied and name == "lm_head.weight":  # the embedding's: peers must not read another
            continue
        t = weights[name].to(dtype)
        if shard and sum(x.nbytes for x in shard.values()) + t.nbytes > shard_bytes:
            flush()
        shard[name], index[name] = t, len(parts) + 1
    flush()
    total = len(parts)
    names = ["model.safetensors"] if total == 1 else \
        [f"model-{i:05d}-of-{total:05d}.safetensors" for i in range(1, total + 1)]
    files = [part.rename(out / name) for part, name in zip(parts, names, strict=True)]
    if total > 1:  # the index transformers (and llama.cpp's converter) reads
        (out / "model.safetensors.index.json").write_text(json.dumps(
            {"metadata": {}, "weight_map": {k: names[i - 1] for k, i in index.items()}},
            indent=1))
    config = loader.load_config(model) | {"torch_dtype": str(dtype).removeprefix("torch.")}
    (out / "config.json").write_text(json.dumps(config, indent=2))
    tokenizer = loader.tokenizer_folder(model)
    for name in TOKENIZER_FILES:
        if (tokenizer / name).exists():
            shutil.copy(tokenizer / name, out / name)
    return files


def main(argv: list[str] | None = None) -> int:
    args = _parse(argv)
    try:
        files = write(args.model, args.out, TORCH_DTYPES[args.dtype],
                      int(args.shard_gib * 2**30))
    except loader.ModelLoadError as e:
        print(f"pdserve bench weights: error: {e}", file=sys.stderr)
        return 2
    print(f"wrote {args.out}: {len(files)} safetensors file(s), "
          f"{sum(f.stat().st_size for f in files) / 1e9:.2f} GB")
    return 0


if __name__ == "__main__":
    sys.exit(main())
