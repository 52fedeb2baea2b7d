"""Model families beside Llama (Qwen3: q/k head norms; Phi-3: fused qkv and gate/up
weights; Gemma 2/3; Phi-4-mini's partial LongRoPE; MoE), each a small random model made and
saved by transformers, several with sliding windows shorter than the prompts: pdserve's
float32 log-probabilities equal transformers' within 1e-4, greedy output is transformers'
(the near-tie rule), and a chunked prefill gives what one chunk gives. P/D and TP for them:
tests/e2e/test_family_serving.py."""

from __future__ import annotations

import json

import pytest
import torch

from pdserve.config import ConfigError, EngineConfig
from pdserve.engine.build import build_engine
from pdserve.engine.request import Request, SamplingParams
from pdserve.model.llama import ModelConfig
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


def test_chunked_prefill_equals_one_shot(family):
    """A prompt prefilled in chunks of 7 (across blocks, kernel tiles and the window's edge)
    gives what one chunk gives: the same tokens, log-probabilities within float32 rounding
    (the attention kernels give the same bits for any chunking, test_paged_attention.py;
    GEMMs of 7 rows and of 40 may round differently). One request at a time: decodes
    batched with other requests' chunks would also run GEMMs of other shapes."""
    name, folder, engine, _ = family
    chunked = build_engine(EngineConfig(model=str(folder), dtype="float32", num_kv_blocks=64,
                                        max_num_batched_tokens=7))
    for i, prompt in enumerate(PROMPTS):
        want, got = (run_engine(e, [Request(f"{name}-c{i}", prompt, greedy(
            4, ignore_eos=True, logprobs=True))])[f"{name}-c{i}"] for e in (engine, chunked))
        assert got.token_ids == want.token_ids, (name, i)
        assert max(abs(a - b) for a, b in zip(got.logprobs, want.logprobs, strict=True)) \
            < 1e-5, (name, i)


def test_longrope_is_refused_past_its_original_length(tmp_path, model_folder):
    folder = write_family_model("phi4_mini", tmp_path, model_folder)
    with pytest.raises(ConfigError, match="--max-model-len 4096 or less"):
        build_engine(EngineConfig(model=str(folder), dtype="float32", num_kv_blocks=8,
                                  max_model_len=8192))


def test_gemma3_config_forms_agree():
    """Gemma 3's configs as transformers 5 writes them (RoPE nested by layer type, layer
    types listed), as earlier versions wrote them, and inside a multimodal config."""
    base = {"model_type": "gemma3_text", "vocab_size": 64, "hidden_size": 32,
            "intermediate_size": 64, "num_hidden_layers": 12, "num_attention_heads": 2,
            "num_key_value_heads": 1, "head_dim": 16, "sliding_window": 512}
    new = ModelConfig.from_hf({**base, "layer_types": [
        "full_attention" if i % 6 == 5 else "sliding_attention" for i in range(12)],
        "rope_parameters": {
            "full_attention": {"rope_type": "linear", "factor": 8.0, "rope_theta": 1e6},
            "sliding_attention": {"rope_type": "default", "rope_theta": 1e4}}})
    old = ModelConfig.from_hf({**base, "rope_theta": 1e6, "rope_local_base_freq": 1e4,
                               "rope_scaling": {"rope_type": "linear", "factor": 8.0},
                               "sliding_window_pattern": 6})
    multimodal = ModelConfig.from_hf({"model_type": "gemma3", "text_config": {
        **base, "rope_theta": 1e6, "rope_local_base_freq": 1e4,
        "rope_scaling": {"rope_type": "linear", "factor": 8.0}}})
    assert new == old == multimodal
    assert new.layer_windows == (512,) * 5 + (None,) + (512,) * 5 + (None,)
    assert (new.local_rope_theta, new.rope_theta) == (1e4, 1e6)
    assert new.tie_word_embeddings and new.qk_norm and new.norm_offset == 1.0


def test_a_multimodal_gemma3_serves_its_language_model(tmp_path, model_folder):
    """A `gemma3` folder (text_config, weights under model.language_model.) answers as the
    same weights saved as gemma3_text."""
    from safetensors.torch import load_file, save_file

    text = write_family_model("gemma3_text", tmp_path / "text", model_folder)
    both = tmp_path / "multimodal"
    both.mkdir()
    weights = load_file(text / "model.safetensors")
    save_file({k.replace("model.", "model.language_model.", 1): v for k, v in weights.items()},
              both / "model.safetensors")
    config = json.loads((text / "config.json").read_text())
    (both / "config.json").write_text(json.dumps({"model_type": "gemma3", "text_config": config,
                                                  "eos_token_id": 2}))
    for f in text.iterdir():
        if f.suffix != ".safetensors" and f.name != "config.json":
            (both / f.name).symlink_to(f)
    outs = []
    for folder in (text, both):
        engine = build_engine(EngineConfig(model=str(folder), dtype="float32", num_kv_blocks=8))
        outs.append(run_engine(engine, [Request("m", PROMPTS[1], greedy(
            4, ignore_eos=True, logprobs=True))])["m"])
    assert outs[0].token_ids == outs[1].token_ids and outs[0].logprobs == outs[1].logprobs
