"""Session fixtures: the embedded model is converted, loaded and run once per test session."""

from __future__ import annotations

import os
from collections.abc import Callable
from pathlib import Path

import pytest
import torch

from pdserve.config import EngineConfig
from pdserve.engine.build import build_engine
from pdserve.engine.engine import LLMEngine
from pdserve.model.loader import resolve
from pdserve.model.tokenizer import Tokenizer
from tests.reliability import (  # noqa: F401  (the reliability report plugin)
    pytest_runtest_makereport,
    pytest_sessionfinish,
    reliability_row,
)
from tests.utils import Reference, hf_greedy, write_tiny_llama

# Nothing above imports transformers; it (and every server the tests start) must find no hub.
os.environ.setdefault("HF_HUB_OFFLINE", "1")

ENGINE_KV_BLOCKS = 512  # 8192 tokens: every test's concurrent batch fits without preemption


@pytest.fixture(scope="session")
def model_folder() -> Path:
    # PDSERVE_TEST_MODEL: an HF folder in place of the embedded model, for a machine that
    # lacks the wheel (scripts/device_check.sh makes one on a lent GPU machine).
    folder = os.environ.get("PDSERVE_TEST_MODEL")
    return Path(folder) if folder else resolve(None)


@pytest.fixture(scope="session")
def tiny_llama(model_folder: Path, tmp_path_factory) -> Path:
    """A random 8-head / 4-KV-head Llama (tensor parallelism splits it; SmolLM2 it cannot)."""
    return write_tiny_llama(tmp_path_factory.mktemp("tiny-llama"), model_folder)


@pytest.fixture(scope="session")
def tokenizer(model_folder: Path) -> Tokenizer:
    return Tokenizer.from_folder(model_folder, [2])


@pytest.fixture(scope="session")
def engine_f32(model_folder: Path) -> LLMEngine:
    """A float32 engine shared by the session: tests must leave it idle, its pool whole."""
    return build_engine(EngineConfig(dtype="float32", num_kv_blocks=ENGINE_KV_BLOCKS))


@pytest.fixture(scope="session")
def hf_model(model_folder: Path):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(model_folder, dtype=torch.float32).eval()


@pytest.fixture(scope="session")
def hf_reference(hf_model) -> Callable[[list[int], int], Reference]:
    """HF greedy continuation of a prompt (with its logit margins), computed once per prompt."""
    done: dict[tuple[tuple[int, ...], int], Reference] = {}

    def get(prompt: list[int], max_new_tokens: int) -> Reference:
        key = (tuple(prompt), max_new_tokens)
        if key not in done:
            done[key] = hf_greedy(hf_model, prompt, max_new_tokens)
        return done[key]

    return get

