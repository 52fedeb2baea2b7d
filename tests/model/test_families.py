"""Model families beside Llama (Qwen3: q/k head norms; Phi-3: fused qkv and gate/up
weights), each a small random model made and saved by transformers: pdserve's float32
log-probabilities equal transformers' within 1e-4, and greedy output is transformers' (the
near-tie rule). P/D and TP for them: tests/e2e/test_family_serving.py."""

from __future__ import annotations

import json

import pytest
import torch

from pdserve.config import ConfigError, EngineConfig
from pdserve.engine.build import build_engine
from pdserve.engine.request import Request, SamplingParams
from tests.utils import (
    FAMILIES,
    assert_matches_reference,
    greedy,
    hf_greedy,
    run_engine,
    write_family_model,
)

PROMPTS = [[1, 504, 3458, 282, 4649], list(range(100, 140)), list(range(2000, 2100, 3))]
TOL = 1e-4  # float32 log-probabilities: other kernels and summation orders than torch's


@pytest.fixture(scope="module", params=sorted(FAMILIES))
def family(request, model_folder, tmp_path_factory):
    from transformers import AutoModelForCausalLM

    folder = write_family_model(request.param, tmp_path_factory.mktemp(request.param),
                                model_folder)
    engine = build_engine(EngineConfig(model=str(folder), dtype="float32", num_kv_blocks=64))
    hf = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    return request.param, folder, engine, hf


def test_logprobs_match_transformers(family):
    name, _, engine, hf = family
    for i, prompt in enumerate(PROMPTS):
        params = SamplingParams(max_tokens=1, temperature=0.0, logprobs=True, top_logprobs=5)
        outs = engine.add_request(Request(f"{name}-lp{i}", prompt, params))
        while engine.has_work():
            outs += engine.step()
        top = outs[-1].new_top_logprobs[0]
        with torch.inference_mode():
            logits = hf(torch.tensor([prompt])).logits[0, -1].float()
        want = torch.log_softmax(logits, -1).topk(5)
        assert [t for t, _ in top] == want.indices.tolist(), (name, i)
        assert max(abs(lp - w) for (_, lp), w in zip(top, want.values.tolist(), strict=True)) \
            < TOL, (name, i, top, want)


def test_greedy_matches_transformers(family):
    name, _, engine, hf = family
    reqs = [Request(f"{name}-g{i}", p, greedy(16, ignore_eos=True))
            for i, p in enumerate(PROMPTS)]
    got = run_engine(engine, reqs)
    for r, p in zip(reqs, PROMPTS, strict=True):
        assert_matches_reference(got[r.request_id].token_ids, hf_greedy(hf, p, 16),
                                 f"{name} {p[:3]}")


def test_sliding_window_models_are_refused_beyond_their_window(family, tmp_path):
    _, folder, _, _ = family
    cfg = json.loads((folder / "config.json").read_text())
    (tmp_path / "config.json").write_text(json.dumps({**cfg, "sliding_window": 1024,
                                                      "use_sliding_window": True}))
    for f in folder.iterdir():
        if f.name != "config.json":
            (tmp_path / f.name).symlink_to(f)
    with pytest.raises(ConfigError, match="--max-model-len 1024 or less"):
        build_engine(EngineConfig(model=str(tmp_path), dtype="float32", num_kv_blocks=8))
    build_engine(EngineConfig(model=str(tmp_path), dtype="float32", num_kv_blocks=8,
                              max_model_len=1024))
