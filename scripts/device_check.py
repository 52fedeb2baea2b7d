"""Device check for a lent GPU machine (torch only; no NIXL, no model wheel there).

Checks the platform's block-copy primitives against CPU results, and greedy output of
the engine's model path (scheduler + model runner + paged KV cache) on the device, eagerly
and with decode steps replayed from CUDA graphs, against the same random-initialised small
Llama on CPU, in float32. One line per case.

    python scripts/device_check.py --device cuda
"""

from __future__ import annotations

import argparse
import sys
import time

import torch

from pdserve.config import EngineConfig
from pdserve.engine.block_allocator import BlockAllocator
from pdserve.engine.decode_graphs import DecodeGraphs
from pdserve.engine.model_runner import ModelRunner
from pdserve.engine.request import Request, SamplingParams
from pdserve.engine.sampler import Sampler
from pdserve.engine.scheduler import Scheduler
from pdserve.model.kv_cache import KVCache
from pdserve.model.llama import LlamaModel, ModelConfig
from pdserve.platforms import get_platform

CONFIG = {"model_type": "llama", "vocab_size": 512, "hidden_size": 256,
          "intermediate_size": 512, "num_hidden_layers": 4, "num_attention_heads": 8,
          "num_key_value_heads": 4, "rms_norm_eps": 1e-5, "rope_theta": 10000.0,
          "tie_word_embeddings": True, "max_position_embeddings": 2048, "eos_token_id": 0}


def random_weights(c: ModelConfig, seed: int = 0) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)

    def t(*shape: int) -> torch.Tensor:
        return torch.randn(*shape, generator=g) * 0.05

    w = {"model.embed_tokens.weight": t(c.vocab_size, c.hidden_size),
         "model.norm.weight": torch.ones(c.hidden_size)}
    q, kv = c.num_heads * c.head_dim, c.num_kv_heads * c.head_dim
    for i in range(c.num_layers):
        p = f"model.layers.{i}."
        w |= {p + "input_layernorm.weight": torch.ones(c.hidden_size),
              p + "post_attention_layernorm.weight": torch.ones(c.hidden_size),
              p + "self_attn.q_proj.weight": t(q, c.hidden_size),
              p + "self_attn.k_proj.weight": t(kv, c.hidden_size),
              p + "self_attn.v_proj.weight": t(kv, c.hidden_size),
              p + "self_attn.o_proj.weight": t(c.hidden_size, q),
              p + "mlp.gate_proj.weight": t(c.intermediate_size, c.hidden_size),
              p + "mlp.up_proj.weight": t(c.intermediate_size, c.hidden_size),
              p + "mlp.down_proj.weight": t(c.hidden_size, c.intermediate_size)}
    return w


def generate(device: str, prompts: list[list[int]], layout: str, graphs: bool = False
             ) -> list[list[int]]:
    c = ModelConfig.from_hf(CONFIG)
    model = LlamaModel(c, random_weights(c), torch.float32, device, max_len=1024)
    cfg = EngineConfig(block_size=16, max_num_batched_tokens=64, max_num_seqs=8)
    cache = KVCache(c.kv_shape(16, layout), 128, torch.float32, device)
    runner = ModelRunner(model, cache, Sampler(), DecodeGraphs(
        model, cache, 8, 64, scratch=127, capture=True) if graphs else None)
    scheduler = Scheduler(cfg, BlockAllocator(runner.num_blocks))
    reqs = [Request(str(i), p, SamplingParams(max_tokens=16, temperature=0, ignore_eos=True))
            for i, p in enumerate(prompts)]
    for r in reqs:
        scheduler.add(r)
    while scheduler.num_unfinished:
        items = scheduler.schedule().items
        sampled, tokens, *_ = runner.run(items)
        for r, n in items:
            r.num_computed_tokens += n
        for r, tok in zip(sampled, tokens, strict=True):
            r.token_ids.append(tok)
            if r.num_output_tokens >= r.params.max_tokens:
                scheduler.remove(r)
    return [r.output_token_ids for r in reqs]


def check_copies(name: str) -> bool:
    p = get_platform(name)
    cache = torch.randn(32, 4, 2, 16, 4, 8).to(p.device())
    host = p.alloc_host(tuple(cache.shape), cache.dtype)
    ids = [3, 4, 5, 17, 30]
    p.copy_to_host(cache, host, ids)
    back = torch.zeros_like(cache)
    p.copy_to_device(host, back, ids)
    others = [i for i in range(32) if i not in ids]
    return (torch.equal(host[ids], cache.cpu()[ids]) and not host[others].any()
            and torch.equal(back.cpu()[ids], cache.cpu()[ids]) and not back.cpu()[others].any())


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--device", default="cuda")
    args = ap.parse_args()
    ok = True

    def case(name: str, passed: bool, t0: float) -> None:
        nonlocal ok
        ok &= passed
        print(f"{'PASS' if passed else 'FAIL'} {name} ({time.monotonic() - t0:.1f}s)", flush=True)

    t0 = time.monotonic()
    case(f"{args.device} copy primitives match CPU", check_copies(args.device), t0)
    g = torch.Generator().manual_seed(1)
    prompts = [torch.randint(1, 512, (n,), generator=g).tolist() for n in (5, 16, 40, 150)]
    for layout in ("NHD", "HND"):
        t0 = time.monotonic()
        want = generate("cpu", prompts, layout)
        got = generate(args.device, prompts, layout)
        case(f"{args.device} greedy = cpu greedy, {layout}, batch of {len(prompts)}",
             got == want, t0)
        if args.device == "cuda":
            t0 = time.monotonic()
            case(f"cuda graphs greedy = cpu greedy, {layout}",
                 generate("cuda", prompts, layout, graphs=True) == want, t0)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
