"""Test helpers. Real processes for end-to-end tests: start a `pdserve` command on 127.0.0.1,
wait until it is healthy, read its metrics, stop it by PID. In-process: drive an engine to
completion, and compare greedy output with HF transformers' up to near-ties."""

from __future__ import annotations

import atexit
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import httpx
import torch

from pdserve.bench.launch import free_port
from pdserve.engine.engine import LLMEngine
from pdserve.engine.request import Request, RequestOutput, SamplingParams


@dataclass(eq=False)
class Server:
    proc: subprocess.Popen
    url: str
    log_path: str

    def log(self) -> str:
        with open(self.log_path, errors="replace") as f:
            return f.read()

    def stop(self) -> None:
        _LIVE.discard(self)
        if self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGTERM)
            try:
                self.proc.wait(15)
            except subprocess.TimeoutExpired:
                os.killpg(self.proc.pid, signal.SIGKILL)
                self.proc.wait()


_LIVE: set[Server] = set()  # stopped at exit, so a test that fails midway leaks no process


@atexit.register
def _stop_all() -> None:
    for server in list(_LIVE):
        server.stop()


def start_server(args: list[str], url: str | None = None, timeout: float = 180,
                 env: dict[str, str] | None = None,
                 ready: Callable[[Server], bool] | None = None,
                 health: str = "/health", wrap: list[str] | None = None) -> Server:
    """Run `pdserve ARGS` in its own process group; `url` defaults to --port's (a free port
    is added when ARGS name none); `wrap`: a command that runs it (`unshare ...`)."""
    if url is None:
        if "--port" not in args:
            args = [*args, "--port", str(free_port())]
        url = f"http://127.0.0.1:{args[args.index('--port') + 1]}"
    fd, log_path = tempfile.mkstemp(prefix="pdserve-", suffix=".log")
    with os.fdopen(fd, "w") as log:  # the child keeps its own copy of the descriptor
        proc = subprocess.Popen([*(wrap or []), sys.executable, "-m",
                                 "pdserve.entrypoints.cli", *args],
                                stdout=log, stderr=subprocess.STDOUT, start_new_session=True,
                                env={**os.environ, **(env or {})})
    server = Server(proc, url, log_path)
    _LIVE.add(server)
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"pdserve {' '.join(args)} exited with {proc.returncode}:\n"
                               f"{server.log()[-4000:]}")
        try:
            if httpx.get(url + health, timeout=2).status_code == 200 and \
                    (ready is None or ready(server)):
                return server
        except httpx.TransportError:
            pass
        time.sleep(0.3)
    server.stop()
    raise RuntimeError(f"pdserve {' '.join(args)} not healthy in {timeout}s:\n"
                       f"{server.log()[-4000:]}")


def metric(url: str, name: str, **labels: str) -> float:
    """Sum of a Prometheus metric over its label sets (those with all of `labels`)."""
    text = httpx.get(url + "/metrics", timeout=10).text
    pattern = re.compile(rf"^{re.escape(name)}(?:{{([^}}]*)}})? (\S+)$", re.M)
    want = {f'{k}="{v}"' for k, v in labels.items()}
    return sum(float(v) for found, v in pattern.findall(text)
               if want <= set(found.split(",")))


def wait_for_metric(url: str, name: str, value: float, timeout: float = 10) -> None:
    deadline = time.monotonic() + timeout
    while (got := metric(url, name)) != value:
        if time.monotonic() > deadline:
            raise AssertionError(f"{name} at {url} is {got}, expected {value}")
        time.sleep(0.1)


# -- in-process engine runs ---------------------------------------------------------------

# Varied English and code (283 tokens) to cut prompts from.
PASSAGE = (
    "The lighthouse keeper climbed the spiral stairs every evening at dusk, counting the "
    "hundred and twelve steps out loud. From the lantern room he could see the fishing "
    "boats returning to the harbour, their lights swaying on the dark water.\n\n"
    "def merge_sorted(a: list[int], b: list[int]) -> list[int]:\n"
    "    out, i, j = [], 0, 0\n"
    "    while i < len(a) and j < len(b):\n"
    "        if a[i] <= b[j]:\n"
    "            out.append(a[i]); i += 1\n"
    "        else:\n"
    "            out.append(b[j]); j += 1\n"
    "    return out + a[i:] + b[j:]\n\n"
    "Photosynthesis converts light energy into chemical energy stored in glucose. It takes "
    "place in the chloroplasts, where chlorophyll absorbs mostly red and blue light and "
    "reflects green, which is why leaves look green to us.\n\n"
    "Q: A train leaves at 9:40 and arrives at 13:15. How long is the journey?\n"
    "A: Three hours and thirty-five minutes.\n\n"
    "In 1969 the Apollo 11 mission landed on the Moon; Neil Armstrong and Buzz Aldrin "
    "spent about two and a half hours walking on the surface while Michael Collins "
    "orbited above in the command module.\n\n"
)

# Greedy runs may part from the reference only where its top-1/top-2 logit margin is below
# this: there float32 rounding (another kernel, batch shape or chunking) may flip the argmax.
NEAR_TIE = 0.02


@dataclass
class Generation:
    token_ids: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    text: str = ""
    finish_reason: str | None = None

    def add(self, out: RequestOutput) -> None:
        self.token_ids += out.new_token_ids
        self.logprobs += out.new_logprobs
        self.text += out.text
        self.finish_reason = out.finish_reason


def greedy(max_tokens: int, **kw) -> SamplingParams:
    return SamplingParams(max_tokens=max_tokens, temperature=0.0, **kw)


def run_engine(engine: LLMEngine, requests: list[Request]) -> dict[str, Generation]:
    """Add all requests at once, step until done; the engine must end idle with its pool
    whole."""
    gens = {r.request_id: Generation() for r in requests}
    for r in requests:
        collect(gens, engine.add_request(r))
    while engine.has_work():
        collect(gens, engine.step())
    assert_idle(engine)
    return gens


def collect(gens: dict[str, Generation], outputs: list[RequestOutput]) -> None:
    for out in outputs:
        gens[out.request_id].add(out)


def assert_idle(engine: LLMEngine) -> None:
    assert not engine.has_work() and not engine.requests
    assert engine.allocator.num_free == engine.allocator.num_blocks, "KV blocks leaked"


# -- a small random Llama that tensor parallelism can split --------------------------------

TINY_LLAMA = {"model_type": "llama", "architectures": ["LlamaForCausalLM"],
              "hidden_size": 128, "intermediate_size": 256, "num_hidden_layers": 2,
              "num_attention_heads": 8, "num_key_value_heads": 4, "rms_norm_eps": 1e-5,
              "rope_theta": 10000.0, "max_position_embeddings": 2048,
              "tie_word_embeddings": False, "bos_token_id": 1, "eos_token_id": 2}


def write_tiny_llama(out: Path, tokenizer_folder: Path, seed: int = 0,
                     config: dict = TINY_LLAMA) -> Path:
    """Random float32 weights for `config` with the embedded model's tokenizer, as an HF
    folder (config.json + model.safetensors) the server loads like real weights. Unit-scale
    embeddings and lm_head make logits peaked (at HF's 0.02 scale nearly every step would be
    a near-tie); untied, so the next token depends on more than the last one."""
    from safetensors.torch import save_file

    tok = json.loads((tokenizer_folder / "config.json").read_text())
    c = {**config, "vocab_size": tok["vocab_size"], "tie_word_embeddings": False}
    g = torch.Generator().manual_seed(seed)
    h, i = c["hidden_size"], c["intermediate_size"]
    hd = h // c["num_attention_heads"]
    shapes = {"q_proj": (c["num_attention_heads"] * hd, h), "o_proj": (h, h),
              "k_proj": (c["num_key_value_heads"] * hd, h),
              "v_proj": (c["num_key_value_heads"] * hd, h),
              "gate_proj": (i, h), "up_proj": (i, h), "down_proj": (h, i)}
    w = {"model.embed_tokens.weight": torch.randn(c["vocab_size"], h, generator=g),
         "lm_head.weight": torch.randn(c["vocab_size"], h, generator=g),
         "model.norm.weight": torch.ones(h)}
    for layer in range(c["num_hidden_layers"]):
        p = f"model.layers.{layer}."
        w[p + "input_layernorm.weight"] = torch.ones(h)
        w[p + "post_attention_layernorm.weight"] = torch.ones(h)
        for name, shape in shapes.items():
            kind = "self_attn" if name[0] in "qkvo" else "mlp"
            w[f"{p}{kind}.{name}.weight"] = torch.randn(*shape, generator=g) / shape[1] ** 0.5
    out.mkdir(parents=True, exist_ok=True)
    save_file(w, out / "model.safetensors")
    (out / "config.json").write_text(json.dumps(c, indent=2))
    _copy_tokenizer(tokenizer_folder, out)
    return out


def write_compressed(src: Path, out: Path, fmt: str, **weights) -> Path:
    """src's Linear weights (bar the lm_head) quantized and saved by compressed-tensors, the
    library llm-compressor writes vLLM's checkpoints with, in format `fmt` with the weights'
    QuantizationArgs `weights`; each scale and zero point from its group's min and max (its
    min-max observer), in bfloat16 as such checkpoints are made."""
    from compressed_tensors.compressors import ModelCompressor
    from compressed_tensors.quantization import (
        QuantizationArgs,
        QuantizationConfig,
        QuantizationScheme,
        apply_quantization_config,
    )
    from compressed_tensors.quantization.utils import calculate_qparams
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(src, dtype=torch.bfloat16)
    args = QuantizationArgs(**weights)
    apply_quantization_config(model, QuantizationConfig(
        config_groups={"group_0": QuantizationScheme(targets=["Linear"], weights=args)},
        ignore=["lm_head"], format=fmt))
    for m in model.modules():
        if getattr(m, "quantization_scheme", None) is None:
            continue
        groups = m.weight.data.unflatten(-1, (-1, args.group_size or m.weight.shape[1]))
        scale, zero = calculate_qparams(groups.amin(-1), groups.amax(-1), args)
        m.weight_scale.data = scale.to(m.weight_scale.dtype).view_as(m.weight_scale)
        if hasattr(m, "weight_zero_point"):
            m.weight_zero_point.data = zero.to(m.weight_zero_point.dtype).view_as(
                m.weight_zero_point)
    compressor = ModelCompressor.from_pretrained_model(model, quantization_format=fmt)
    compressor.compress_model(model)
    model.save_pretrained(out)
    compressor.update_config(out)
    _copy_tokenizer(src, out)
    return out


def _copy_tokenizer(tokenizer_folder: Path, out: Path) -> None:
    for f in ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja"):
        if (tokenizer_folder / f).exists():
            shutil.copy(tokenizer_folder / f, out / f)


# Small configs of each model family beside Llama, for transformers' own classes: GQA with
# 8 heads / 4 KV heads (tensor parallelism splits them), a head_dim unlike hidden / heads.
FAMILIES = {
    "qwen3": {"model_type": "qwen3", "hidden_size": 128, "intermediate_size": 256,
              "num_hidden_layers": 2, "num_attention_heads": 8, "num_key_value_heads": 4,
              "head_dim": 32, "rms_norm_eps": 1e-6, "rope_theta": 1e6,
              "max_position_embeddings": 2048},
    # Phi-3 and Mixtral with a sliding window on every layer (as Phi-3-mini's 2047, Mistral's
    # 4096), shorter than the test prompts; head_dim 16: torch's attention, not the kernels.
    "phi3": {"model_type": "phi3", "hidden_size": 128, "intermediate_size": 256,
             "num_hidden_layers": 2, "num_attention_heads": 8, "num_key_value_heads": 4,
             "rms_norm_eps": 1e-5, "rope_theta": 10000.0, "max_position_embeddings": 2048,
             "sliding_window": 16},
    # Layer 0 routed over 8 experts (2 a token), layer 1 dense.
    "qwen3_moe": {"model_type": "qwen3_moe", "hidden_size": 128, "intermediate_size": 256,
                  "moe_intermediate_size": 64, "num_experts": 8, "num_experts_per_tok": 2,
                  "norm_topk_prob": True, "mlp_only_layers": [1], "num_hidden_layers": 2,
                  "num_attention_heads": 8, "num_key_value_heads": 4, "head_dim": 32,
                  "rms_norm_eps": 1e-6, "max_position_embeddings": 2048},
    "mixtral": {"model_type": "mixtral", "hidden_size": 128, "intermediate_size": 64,
                "num_local_experts": 4, "num_experts_per_tok": 2, "num_hidden_layers": 2,
                "num_attention_heads": 8, "num_key_value_heads": 4, "rms_norm_eps": 1e-5,
                "max_position_embeddings": 2048, "sliding_window": 16},
    # Gemma: a sliding layer (window 16, shorter than the test prompts), then a global one;
    # head_dim 64 (the paged kernels' size), scores scaled by query_pre_attn_scalar.
    # Gemma 2's caps are low enough that random weights' scores and logits reach them.
    "gemma2": {"model_type": "gemma2", "hidden_size": 128, "intermediate_size": 256,
               "num_hidden_layers": 2, "num_attention_heads": 8, "num_key_value_heads": 4,
               "head_dim": 64, "query_pre_attn_scalar": 48, "sliding_window": 16,
               "attn_logit_softcapping": 2.0, "final_logit_softcapping": 15.0,
               "rms_norm_eps": 1e-6, "max_position_embeddings": 2048},
    # Gemma 3: tied embeddings, q/k norms, a local RoPE base, linear RoPE scaling on the
    # global layer.
    "gemma3_text": {"model_type": "gemma3_text", "hidden_size": 128, "intermediate_size": 256,
                    "num_hidden_layers": 2, "num_attention_heads": 8, "num_key_value_heads": 4,
                    "head_dim": 64, "query_pre_attn_scalar": 64, "sliding_window": 16,
                    "layer_types": ["sliding_attention", "full_attention"],
                    "rope_parameters": {
                        "sliding_attention": {"rope_type": "default", "rope_theta": 1e4},
                        "full_attention": {"rope_type": "linear", "factor": 4.0,
                                           "rope_theta": 1e6}},
                    "tie_word_embeddings": True, "rms_norm_eps": 1e-6,
                    "max_position_embeddings": 2048},
    # Phi-4-mini's RoPE: over 3/4 of each head, LongRoPE's factors (short ones within
    # original_max_position_embeddings) and its attention factor.
    "phi4_mini": {"model_type": "phi3", "hidden_size": 256, "intermediate_size": 256,
                  "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2,
                  "rms_norm_eps": 1e-5, "rope_theta": 10000.0, "partial_rotary_factor": 0.75,
                  "max_position_embeddings": 131072, "original_max_position_embeddings": 4096,
                  "rope_scaling": {"type": "longrope",
                                   "short_factor": [1 + i / 48 for i in range(24)],
                                   "long_factor": [2 + i for i in range(24)]}},
}


def write_family_model(family: str, out: Path, tokenizer_folder: Path, seed: int = 0) -> Path:
    """Random weights of FAMILIES[family] made and saved by transformers itself (its config
    and model classes), with the embedded model's tokenizer. Unit-scale embeddings, lm_head
    and norms that are not all ones, so that logits are peaked and every weight matters."""
    from transformers import AutoConfig, AutoModelForCausalLM

    vocab = json.loads((tokenizer_folder / "config.json").read_text())["vocab_size"]
    spec = {"tie_word_embeddings": False, **FAMILIES[family], "vocab_size": vocab,
            "eos_token_id": 2, "bos_token_id": 1, "pad_token_id": 0}
    config = AutoConfig.for_model(**spec)
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32).eval()
    with torch.no_grad():
        for name, t in model.named_parameters():
            if name.endswith(("embed_tokens.weight", "lm_head.weight")):
                t.normal_(0, 1)
            elif t.dim() >= 2:  # projections, routers, experts' stacked projections
                t.normal_(0, t.shape[-1] ** -0.5)
            else:  # norms
                t.uniform_(0.5, 1.5)
    model.save_pretrained(out)
    _copy_tokenizer(tokenizer_folder, out)
    return out


# -- HF transformers reference --------------------------------------------------------------

@dataclass(frozen=True)
class Reference:
    tokens: list[int]
    margins: list[float]  # top-1 minus top-2 logit at each generated position


def hf_greedy(model, prompt: list[int], max_new_tokens: int) -> Reference:
    ids = torch.tensor([prompt])
    with torch.inference_mode():
        out = model.generate(ids, attention_mask=torch.ones_like(ids), do_sample=False,
                             max_new_tokens=max_new_tokens, output_logits=True,
                             return_dict_in_generate=True, pad_token_id=0)
    top2 = torch.cat(out.logits).float().topk(2, dim=-1).values  # raw logits, [steps, 2]
    return Reference(out.sequences[0, len(prompt):].tolist(),
                     (top2[:, 0] - top2[:, 1]).tolist())


def assert_matches_reference(got: list[int], ref: Reference, what: str = "") -> int | None:
    """Token-identical to `ref`, except that the two may part at a near-tie of the reference
    (nothing after it is compared). Returns the parting position, or None."""
    for i, (a, b) in enumerate(zip(got, ref.tokens, strict=False)):
        if a != b:
            assert ref.margins[i] < NEAR_TIE, (
                f"{what}: token {i} is {a}, HF's is {b} with a top-2 margin of "
                f"{ref.margins[i]:.4f} (>= {NEAR_TIE}); got {got}, HF {ref.tokens}")
            return i
    assert got == ref.tokens, f"{what}: lengths differ: got {got}, HF {ref.tokens}"
    return None


def hf_penalised_greedy(model, prompt: list[int], max_new_tokens: int,
                        repetition: float = 1.0, presence: float = 0.0,
                        frequency: float = 0.0) -> Reference:
    """Greedy over HF logits with HF's RepetitionPenaltyLogitsProcessor (prompt + output)
    and OpenAI's presence/frequency formulas (output only); margins of the penalised
    logits."""
    from transformers import RepetitionPenaltyLogitsProcessor

    rep = RepetitionPenaltyLogitsProcessor(repetition)
    ids = torch.tensor([prompt])
    tokens, margins = [], []
    with torch.inference_mode():
        for _ in range(max_new_tokens):  # whole sequence each step: short, and no cache API
            scores = rep(ids, model(ids).logits[:, -1].float())
            counts = torch.bincount(ids[0, len(prompt):], minlength=scores.shape[-1])
            scores = scores - frequency * counts - presence * (counts > 0)
            top2 = scores[0].topk(2).values
            margins.append((top2[0] - top2[1]).item())
            tokens.append(int(scores.argmax(-1)))
            ids = torch.cat([ids, torch.tensor([[tokens[-1]]])], 1)
    return Reference(tokens, margins)
