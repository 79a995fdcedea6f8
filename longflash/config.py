"""Engine configuration: one dataclass with vLLM's argument names, validated on creation."""

from __future__ import annotations

import json
import logging
import numbers
import re
from dataclasses import dataclass

import torch

_DTYPES = {
    "auto": None,
    "float32": torch.float32,
    "fp32": torch.float32,
    "float": torch.float32,
    "bfloat16": torch.bfloat16,
    "bf16": torch.bfloat16,
    "float16": torch.float16,
    "half": torch.float16,
    "fp16": torch.float16,
}

_SIZE_UNITS = {"": 1, "B": 1, "KB": 10**3, "MB": 10**6, "GB": 10**9, "TB": 10**12,
               "KIB": 2**10, "MIB": 2**20, "GIB": 2**30, "TIB": 2**40,
               "K": 2**10, "M": 2**20, "G": 2**30, "T": 2**40}

logger = logging.getLogger(__name__)


def parse_bytes(value: str | int | float) -> int:
    """Parse a memory size: an integer number of bytes or e.g. ``2GiB``, ``512MB``, ``1.5G``.

    Binary units (KiB, MiB, GiB, and the bare K/M/G/T) are powers of 1024; KB/MB/GB powers of 1000.
    Raises ValueError on anything else.
    """
    if isinstance(value, (int, float)):
        if value <= 0:
            raise ValueError(f"memory size must be positive, got {value}")
        return int(value)
    m = re.fullmatch(r"\s*([0-9]*\.?[0-9]+)\s*([A-Za-z]*)\s*", str(value))
    if not m or m.group(2).upper() not in _SIZE_UNITS:
        raise ValueError(f"cannot parse memory size {value!r}; use bytes or e.g. 2GiB, 512MB")
    n = int(float(m.group(1)) * _SIZE_UNITS[m.group(2).upper()])
    if n <= 0:
        raise ValueError(f"memory size must be positive, got {value!r}")
    return n


def resolve_dtype(dtype: str | torch.dtype, config_dtype: str | None, device: torch.device) -> torch.dtype:
    """Model dtype: an explicit choice, else ``auto``: fp32 on the CPU, the checkpoint's dtype on a GPU."""
    if isinstance(dtype, torch.dtype):
        return dtype
    if dtype not in _DTYPES:
        raise ValueError(f"unsupported dtype {dtype!r}; choose one of {sorted(_DTYPES)}")
    if _DTYPES[dtype] is not None:
        return _DTYPES[dtype]
    if device.type == "cpu":
        return torch.float32
    return _DTYPES.get(str(config_dtype or "bfloat16"), torch.bfloat16) or torch.bfloat16


def parse_speculative_config(value: dict | str | None) -> dict | str | None:
    """Normalise ``--speculative-config``: None, "off", or a dict with ``method`` "dflash",
    ``model`` (drafter directory) and optional ``num_speculative_tokens`` (>= 1).

    Raises ValueError naming the problem (bad JSON, unknown method, missing model).
    """
    if value is None:
        return None
    if isinstance(value, str):
        if value.strip().lower() in ("off", "none", "disabled"):
            return "off"
        try:
            value = json.loads(value)
        except json.JSONDecodeError as e:
            raise ValueError(f"speculative_config (--speculative-config) is not valid JSON or 'off': {e}") from e
    if not isinstance(value, dict):
        raise ValueError("speculative_config must be a JSON object or 'off'")
    k = value.get("num_speculative_tokens")
    if k is not None and (not isinstance(k, int) or isinstance(k, bool) or k < 1):
        raise ValueError(f"num_speculative_tokens must be an integer >= 1, got {k!r}")
    method = value.get("method", "dflash")
    if method != "dflash":
        raise ValueError(f"unsupported speculative method {method!r}; supported: dflash")
    if not value.get("model"):
        raise ValueError("speculative_config needs 'model': the DFlash drafter directory")
    return dict(value, method=method)


@dataclass
class EngineConfig:
    """Everything the engine needs besides the model weights.

    Units: ``max_model_len``, ``max_num_batched_tokens``, ``block_size`` in tokens;
    ``kv_cache_memory`` in bytes (None = ``num_gpu_blocks`` or a default budget).
    ``kv_cache_dtype`` fp8 (= fp8_e4m3) stores one byte per element with a per-layer ``k_scale``
    (1.0, a checkpoint's ``*.k_scale``, or with ``calculate_kv_scales`` amax / 200 of the first batch).
    ``context_workspace_rows``: rows of cached context a prefill gathers at once (chunked context).
    """

    model: str
    dtype: str = "auto"
    device: str | None = None
    max_model_len: int | None = None
    max_num_batched_tokens: int = 2048
    max_num_seqs: int = 64
    block_size: int = 16
    kv_cache_memory: int | str | None = None
    num_gpu_blocks: int | None = None
    kv_cache_dtype: str = "auto"
    calculate_kv_scales: bool = False
    context_workspace_rows: int = 64 * 1024
    enable_prefix_caching: bool = True
    enable_chunked_prefill: bool = True
    seed: int = 0
    skip_tokenizer_init: bool = False
    tokenizer: str | None = None
    tensor_parallel_size: int = 1
    decode_context_parallel_size: int = 1
    # DCP: positions per round-robin group (owner of p is (p // I) % dcp); must divide block_size.
    cp_kv_cache_interleave_size: int = 1
    # Rendezvous port of a single-host multi-process run (None: a free one; torchrun's env wins).
    master_port: int | None = None
    # Seconds a collective may wait for a peer before the engine fails (a dead worker never hangs it).
    distributed_timeout_s: float = 60.0
    enforce_eager: bool = False
    # Launch a plain greedy decode step before the previous one's tokens are read (vLLM's
    # --async-scheduling; engine/async_scheduling.py). None: on for CUDA, off on the CPU.
    async_scheduling: bool | None = None
    # {"method": "dflash", "model": PATH, "num_speculative_tokens": K}, a JSON string of it, "off",
    # or None (the default model uses its shipped drafter; other models run without).
    speculative_config: dict | str | None = None
    # DFlash drafter input in MXFP8 (taps quantized, fc on the dequantized buffer); forwards of at
    # least dflash_staged_threshold tokens quantize each tap as it is produced (staged).
    dflash_mxfp8_input: bool = False
    dflash_staged_threshold: int = 512
    # Largest ``SamplingParams.logprobs`` accepted (vLLM's default 20; ``longflash serve --max-logprobs``).
    max_logprobs: int = 20

    def __post_init__(self) -> None:
        if self.device is None:
            self.device = "cuda" if torch.cuda.is_available() else "cpu"
        try:
            dev = torch.device(self.device)
        except (RuntimeError, TypeError):
            raise ValueError(f"device must be 'cpu', 'cuda' or 'cuda:N', got {self.device!r}") from None
        if dev.type not in ("cpu", "cuda"):
            raise ValueError(f"device must be 'cpu', 'cuda' or 'cuda:N', got {self.device!r}")
        self.speculative_config = parse_speculative_config(self.speculative_config)
        if self.kv_cache_memory is not None:
            self.kv_cache_memory = parse_bytes(self.kv_cache_memory)
        for name in ("max_num_batched_tokens", "max_num_seqs", "block_size", "tensor_parallel_size",
                     "decode_context_parallel_size", "cp_kv_cache_interleave_size"):
            v = getattr(self, name)
            if not isinstance(v, numbers.Integral) or isinstance(v, bool):
                raise ValueError(f"{name} must be an int, got {v!r}")
            v = int(v)
            setattr(self, name, v)
            if v < 1:
                raise ValueError(f"{name} must be >= 1, got {v}")
        if not isinstance(self.max_logprobs, numbers.Integral) or isinstance(self.max_logprobs, bool) \
                or self.max_logprobs < 0:
            raise ValueError(f"max_logprobs must be an int >= 0, got {self.max_logprobs!r}")
        if self.max_model_len is not None and self.max_model_len < 1:
            raise ValueError(f"max_model_len must be >= 1, got {self.max_model_len}")
        if self.kv_cache_dtype not in ("auto", "bfloat16", "fp8", "fp8_e4m3"):
            raise ValueError(f"kv_cache_dtype must be one of auto, bfloat16, fp8 (= fp8_e4m3); "
                             f"got {self.kv_cache_dtype!r}")
        if self.async_scheduling is not None and not isinstance(self.async_scheduling, bool):
            raise ValueError(f"async_scheduling must be True, False or None, got {self.async_scheduling!r}")
        if not isinstance(self.calculate_kv_scales, bool):
            raise ValueError(f"calculate_kv_scales must be True or False, got {self.calculate_kv_scales!r}")
        if self.calculate_kv_scales and self.kv_cache_dtype not in ("fp8", "fp8_e4m3"):
            logger.warning("calculate_kv_scales has no effect: the KV cache is not fp8 (kv_cache_dtype %s)",
                           self.kv_cache_dtype)
        if self.context_workspace_rows < self.block_size:
            raise ValueError(f"context_workspace_rows ({self.context_workspace_rows}) must be >= block_size "
                             f"({self.block_size})")
        tp, dcp = self.tensor_parallel_size, self.decode_context_parallel_size
        if tp % dcp != 0:
            raise ValueError(f"decode_context_parallel_size ({dcp}) must divide tensor_parallel_size ({tp})")
        if self.cp_kv_cache_interleave_size < 1 or self.block_size % self.cp_kv_cache_interleave_size:
            raise ValueError(f"cp_kv_cache_interleave_size ({self.cp_kv_cache_interleave_size}) must be >= 1 and "
                             f"divide block_size ({self.block_size})")
        if tp != 1:
            # Tensor parallelism (weights sharded over tp ranks) with DCP groups of dcp consecutive
            # ranks: gloo on the CPU, NCCL on GPUs with rank r on cuda:<local rank> (one GPU per rank).
            from longflash.distributed.placement import check_parallel_device
            cuda = torch.device(self.device).type == "cuda"
            check_parallel_device(self.device, tp, torch.cuda.device_count() if cuda else 0)
        elif torch.device(self.device).type == "cuda" and not torch.cuda.is_available():
            raise ValueError(f"device {self.device!r} asked for, but this torch build sees no CUDA GPU "
                             f"(torch {torch.__version__}); use --device cpu")
        if not self.enable_chunked_prefill and self.max_model_len is not None \
                and self.max_num_batched_tokens < self.max_model_len:
            raise ValueError("without chunked prefill, max_num_batched_tokens must be >= max_model_len")
