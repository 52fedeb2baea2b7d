"""Typed configuration for an engine and its KV transfer, validated with clear errors."""

from __future__ import annotations

import ipaddress
import json
import uuid
from dataclasses import dataclass, field
from typing import Any

DTYPES = ("float32", "bfloat16", "float16")
KV_ROLES = ("kv_producer", "kv_consumer", "kv_both")
KV_CONNECTORS = ("NixlConnector",)
KV_LAYOUTS = ("NHD", "HND")
LOAD_FAILURE_POLICIES = ("recompute", "fail")
# Checkpoints stored quantized, computed as stored (model/checkpoint_weights.py): the method
# is the checkpoint's own quantization_config.quant_method, as vLLM names it.
CHECKPOINT_QUANTIZATIONS = ("compressed-tensors", "gptq", "awq", "fp8")
QUANTIZATIONS = ("int8", "int4", "gguf", *CHECKPOINT_QUANTIZATIONS)
LOAD_FORMATS = ("auto", "dummy")
KV_CACHE_DTYPES = ("auto", "fp8", "fp8_e4m3", "fp8_e5m2")  # vLLM's names; fp8 is e4m3


class ConfigError(ValueError):
    """A configuration a user gave that cannot work; the message says why."""


@dataclass(slots=True)
class EngineConfig:
    model: str | None = None  # None: the embedded SmolLM2 model
    dtype: str = "bfloat16"
    device: str = "auto"
    block_size: int = 16
    kv_cache_memory_gib: float = 1.0
    num_kv_blocks: int | None = None  # overrides kv_cache_memory_gib
    kv_layout: str = "HND"  # a head's rows contiguous: faster decode attention, unequal TP
    max_num_seqs: int = 64
    max_num_batched_tokens: int = 512
    max_model_len: int = 2048
    enable_prefix_caching: bool = True
    num_threads: int | None = None  # torch intra-op threads; None = torch's default
    seed: int = 0
    tensor_parallel_size: int = 1  # ranks sharding each layer, one process each
    enforce_eager: bool = False  # no CUDA graphs for decode steps (vLLM's flag)
    # int8, int4: weights quantized at load (model/quant.py); gguf: a GGUF file's weights
    # computed as stored (model/gguf_weights.py), a quantized checkpoint's likewise (its
    # method, set from its config.json where not given)
    quantization: str | None = None
    load_format: str = "auto"  # dummy: random weights of the config's shape (benchmarks)
    kv_cache_dtype: str = "auto"  # auto: --dtype; fp8*: the cache stored in 8-bit floats

    def validate(self) -> None:
        if self.dtype not in DTYPES:
            raise ConfigError(f"--dtype must be one of {', '.join(DTYPES)}, got {self.dtype!r}")
        if self.kv_layout not in KV_LAYOUTS:
            raise ConfigError(f"--kv-layout must be NHD or HND, got {self.kv_layout!r}")
        for name in ("block_size", "max_num_seqs", "max_num_batched_tokens", "max_model_len",
                     "tensor_parallel_size"):
            if getattr(self, name) < 1:
                raise ConfigError(f"--{name.replace('_', '-')} must be at least 1")
        if self.num_kv_blocks is not None and self.num_kv_blocks < 1:
            raise ConfigError("--num-kv-blocks must be at least 1")
        if self.kv_cache_memory_gib <= 0:
            raise ConfigError("--kv-cache-memory must be positive (GiB)")
        if self.load_format not in LOAD_FORMATS:
            raise ConfigError(f"--load-format must be one of {', '.join(LOAD_FORMATS)}, "
                              f"got {self.load_format!r}")
        if self.kv_cache_dtype not in KV_CACHE_DTYPES:
            raise ConfigError(f"--kv-cache-dtype must be one of {', '.join(KV_CACHE_DTYPES)}, "
                              f"got {self.kv_cache_dtype!r}")
        if self.kv_cache_dtype != "auto" and self.device not in ("auto", "cpu"):
            raise ConfigError(f"--kv-cache-dtype {self.kv_cache_dtype} runs on CPU, not "
                              f"--device {self.device}")
        if self.quantization is not None:
            if self.quantization not in QUANTIZATIONS:
                raise ConfigError(f"--quantization must be one of {', '.join(QUANTIZATIONS)}, "
                                  f"got {self.quantization!r}")
            if self.quantization not in ("int8", "int4") and self.load_format == "dummy":
                raise ConfigError(f"--quantization {self.quantization} computes a file's "
                                  "weights as stored; --load-format dummy makes random ones "
                                  "(quantize those with --quantization int8 or int4)")
            if self.device not in ("auto", "cpu") or self.dtype == "float16":
                raise ConfigError(f"--quantization {self.quantization} runs on CPU with "
                                  f"--dtype float32 or bfloat16, not --device {self.device} "
                                  f"--dtype {self.dtype}")


@dataclass(slots=True)
class KVExtraConfig:
    kv_lease_duration: float = 30.0
    handshake_timeout: float = 5.0
    transfer_timeout: float = 30.0
    use_host_buffer: bool = False
    min_transfer_tokens: int = 0
    allowed_remote_hosts: list[str] = field(default_factory=list)
    side_channel_secret: str | None = None


@dataclass(slots=True)
class KVTransferConfig:
    kv_connector: str = "NixlConnector"
    kv_role: str = "kv_both"
    kv_buffer_device: str | None = None  # None: the compute device
    engine_id: str = ""
    kv_load_failure_policy: str = "recompute"
    kv_connector_extra_config: KVExtraConfig = field(default_factory=KVExtraConfig)

    @property
    def is_producer(self) -> bool:
        return self.kv_role in ("kv_producer", "kv_both")

    @property
    def is_consumer(self) -> bool:
        return self.kv_role in ("kv_consumer", "kv_both")

    @classmethod
    def from_json(cls, text: str) -> KVTransferConfig:
        try:
            raw = json.loads(text)
        except json.JSONDecodeError as e:
            raise ConfigError(f"--kv-transfer-config is not valid JSON: {e}") from None
        if not isinstance(raw, dict):
            raise ConfigError("--kv-transfer-config must be a JSON object")
        return cls.from_dict(raw)

    @classmethod
    def from_dict(cls, raw: dict[str, Any]) -> KVTransferConfig:
        extra = raw.get("kv_connector_extra_config") or {}
        if not isinstance(extra, dict):
            raise ConfigError("kv_connector_extra_config must be a JSON object")
        fields = {k: v for k, v in raw.items() if k != "kv_connector_extra_config"}
        cfg = cls(**_known(cls, fields, "--kv-transfer-config"),
                  kv_connector_extra_config=KVExtraConfig(
                      **_known(KVExtraConfig, extra, "kv_connector_extra_config")))
        cfg.engine_id = cfg.engine_id or str(uuid.uuid4())
        cfg.validate()
        return cfg

    def validate(self) -> None:
        if self.kv_connector not in KV_CONNECTORS:
            raise ConfigError(f"unknown kv_connector {self.kv_connector!r}; "
                              f"supported: {', '.join(KV_CONNECTORS)}")
        if self.kv_role not in KV_ROLES:
            raise ConfigError(f"kv_role must be one of {', '.join(KV_ROLES)}, "
                              f"got {self.kv_role!r}")
        if self.kv_load_failure_policy not in LOAD_FAILURE_POLICIES:
            raise ConfigError("kv_load_failure_policy must be recompute or fail, "
                              f"got {self.kv_load_failure_policy!r}")
        x = self.kv_connector_extra_config
        for name in ("kv_lease_duration", "handshake_timeout", "transfer_timeout"):
            value = getattr(x, name)
            if not isinstance(value, int | float) or value <= 0:
                raise ConfigError(f"kv_connector_extra_config.{name} must be a positive "
                                  f"number of seconds, got {value!r}")
        if not isinstance(x.min_transfer_tokens, int) or x.min_transfer_tokens < 0:
            raise ConfigError("kv_connector_extra_config.min_transfer_tokens must be an "
                              "integer >= 0")
        if not isinstance(x.allowed_remote_hosts, list) or \
                not all(isinstance(h, str) for h in x.allowed_remote_hosts):
            raise ConfigError("kv_connector_extra_config.allowed_remote_hosts must be a list "
                              "of host names, addresses and networks (10.244.0.0/16)")
        for entry in x.allowed_remote_hosts:
            if "/" in entry:
                try:
                    ipaddress.ip_network(entry, strict=False)
                except ValueError as e:
                    raise ConfigError(f"kv_connector_extra_config.allowed_remote_hosts: {e}"
                                      ) from None


def _known(cls: type, values: dict[str, Any], where: str) -> dict[str, Any]:
    """Refuse keys the dataclass does not have, naming the valid ones."""
    valid = set(cls.__dataclass_fields__)
    unknown = sorted(set(values) - valid)
    if unknown:
        raise ConfigError(f"unknown key(s) in {where}: {', '.join(unknown)}; "
                          f"valid keys: {', '.join(sorted(valid))}")
    return values
