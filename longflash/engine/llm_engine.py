"""The engine: requests in, one scheduled step at a time, outputs out (vLLM's ``LLMEngine``)."""

from __future__ import annotations

import json
import logging
import numbers
import os
import time
from dataclasses import dataclass, field, replace

import torch

from longflash.config import EngineConfig, resolve_dtype
from longflash.distributed import comm, placement
from longflash.engine.async_scheduling import AheadStep, AsyncDecode
from longflash.engine.block_manager import BlockManager
from longflash.engine.scheduler import Scheduler
from longflash.engine.sequence import Sequence
from longflash.engine.stop_checker import StopChecker
from longflash.models.loader import load_model
from longflash.outputs import CompletionOutput, RequestOutput
from longflash.runner.cuda_graph import prepare_uniform_model
from longflash.runner.model_runner import ModelRunner
from longflash.runner.sampler import (compute_logprobs, needs_logits_processing, process_logits, row_argmax,
                                      sample_token)
from longflash.sampling_params import RequestOutputKind, SamplingParams
from longflash.spec_decode.draft_mask import draft_mask

logger = logging.getLogger("longflash")

DEFAULT_CPU_KV_CACHE_BYTES = 1 << 30


@dataclass
class EngineStats:
    """Counters since start-up and latency observations not yet drained (seconds)."""

    prompt_tokens: int = 0
    generation_tokens: int = 0
    num_preemptions: int = 0
    request_success: dict[str, int] = field(default_factory=dict)
    spec_num_drafts: int = 0
    spec_num_draft_tokens: int = 0
    spec_num_accepted_tokens: int = 0
    spec_accepted_per_pos: dict[int, int] = field(default_factory=dict)
    ttft: list[float] = field(default_factory=list)
    itl: list[float] = field(default_factory=list)
    e2e: list[float] = field(default_factory=list)

    def drain(self) -> tuple[list[float], list[float], list[float]]:
        out = (self.ttft, self.itl, self.e2e)
        self.ttft, self.itl, self.e2e = [], [], []
        return out


def load_tokenizer(path: str):
    """HF tokenizer from ``tokenizer.json``/``tokenizer_config.json`` (never runs checkpoint code)."""
    from transformers import AutoTokenizer
    from transformers.utils import logging as hf_logging
    # AutoTokenizer peeks at config.json; for model types transformers does not know (kimi_k3) it
    # warns although the tokenizer files are complete. Silence that one call.
    verbosity = hf_logging.get_verbosity()
    hf_logging.set_verbosity_error()
    try:
        tok = AutoTokenizer.from_pretrained(path, trust_remote_code=False)
    finally:
        hf_logging.set_verbosity(verbosity)
    tok.model_max_length = int(1e9)  # the engine enforces max_model_len itself
    return tok


def load_generation_config(model_dir: str) -> dict:
    path = os.path.join(model_dir, "generation_config.json")
    if os.path.isfile(path):
        with open(path) as f:
            return json.load(f)
    return {}


def _as_set(x) -> set[int]:
    if x is None:
        return set()
    return {int(i) for i in x} if isinstance(x, (list, tuple)) else {int(x)}


_MULTIMODAL_PROMPT_KEYS = ("multi_modal_data", "mm_processor_kwargs", "multi_modal_uuids")


def _check_prompt_keys(prompt: dict) -> None:
    """A prompt dict is vLLM's TextPrompt ``{"prompt": text}`` or TokensPrompt ``{"prompt_token_ids":
    [...]}``. Raises ValueError naming an unknown key, a multimodal key (the models take text only), or
    both ``prompt`` and ``prompt_token_ids`` (which one would be used is ambiguous; a key set to None counts as
    left out)."""
    extra = [k for k in prompt if k not in ("prompt", "prompt_token_ids")]
    if extra:
        media = [k for k in extra if k in _MULTIMODAL_PROMPT_KEYS]
        if media:
            raise ValueError(f"prompt key {media[0]!r} is not supported: the models take text only")
        raise ValueError(f"unknown prompt key(s) {', '.join(map(repr, extra))}: a prompt dict takes 'prompt' (text) "
                         "or 'prompt_token_ids' (a list of token ids), as vLLM's TextPrompt / TokensPrompt")
    if prompt.get("prompt") is not None and prompt.get("prompt_token_ids") is not None:
        raise ValueError("a prompt dict takes 'prompt' (text) or 'prompt_token_ids', not both")


def tokenize_text(tokenizer, prompt: str, add_special_tokens: bool = True) -> list[int]:
    """:meth:`LLMEngine.tokenize` with a given tokenizer (the server tokenizes long prompts with its own copy
    on a worker thread). Raises ValueError without a tokenizer, for a non-string, and for text that is not
    valid Unicode (e.g. lone surrogates from undecodable bytes)."""
    if tokenizer is None:
        raise ValueError("a text prompt needs a tokenizer; this engine was built with skip_tokenizer_init=True")
    if not isinstance(prompt, str):
        raise ValueError(f"a text prompt must be a string, got {type(prompt).__name__}")
    try:
        prompt.encode("utf-8")
    except UnicodeEncodeError as e:
        raise ValueError(f"the prompt is not valid Unicode text ({e.reason} at position {e.start})") from None
    return tokenizer.encode(prompt, add_special_tokens=add_special_tokens)


def _is_token_id(t) -> bool:
    """An integer token id (a Python or NumPy integer; not a bool, a float such as 2.0, or a string)."""
    return isinstance(t, numbers.Integral) and not isinstance(t, bool)


def _token_ids(ids) -> tuple[list[int] | None, object]:
    """(``ids`` as a list of ints, None) for an iterable of integer token ids, else (None, the first element
    that is not a token id, or ``ids`` itself when it is not such an iterable: text, bytes, a number)."""
    if isinstance(ids, (str, bytes, bytearray)) or not hasattr(ids, "__iter__"):
        return None, ids
    ids = list(ids)
    bad = [t for t in ids if not _is_token_id(t)][:1]
    return (None, bad[0]) if bad else ([int(t) for t in ids], None)


class LLMEngine:
    """Owns the model runner, scheduler, block manager and tokenizer.

    Use: ``add_request(...)`` any time, then call ``step()`` until ``has_unfinished_requests()`` is
    False; each step returns the outputs of requests that advanced.
    Raises ModelLoadError / ValueError at construction for a bad checkpoint or configuration.
    """

    def __init__(self, config: EngineConfig):
        self.config = config
        # TP/DCP on GPUs: this rank's cuda:<local rank>, made current before anything is allocated there.
        self.device = placement.bind_rank_device(config.device, config.tensor_parallel_size)
        t0 = time.perf_counter()
        from longflash.models.loader import load_config
        model_cfg = load_config(config.model)
        self.dtype = resolve_dtype(config.dtype, model_cfg.get("torch_dtype") or model_cfg.get("dtype"), self.device)
        torch.manual_seed(config.seed)
        # Tensor parallelism: this rank (0, or torchrun's RANK) builds and reads only its weight shards.
        tp = comm.planned_tp_group(config.tensor_parallel_size) if config.tensor_parallel_size > 1 else None
        self.model, self.model_config = load_model(config.model, self.dtype, self.device, tp=tp)
        self.load_time = time.perf_counter() - t0
        self.tokenizer = None
        if not config.skip_tokenizer_init:
            self.tokenizer = load_tokenizer(config.tokenizer or config.model)
        self.generation_config = load_generation_config(config.model)
        self.vocab_size = self.model_config["vocab_size"]
        self.eos_token_ids = _as_set(self.generation_config.get("eos_token_id", self.model_config.get("eos_token_id")))
        if not self.eos_token_ids and self.tokenizer is not None and self.tokenizer.eos_token_id is not None:
            self.eos_token_ids = {self.tokenizer.eos_token_id}

        self.kv_cache_dtype = self._kv_cache_dtype()
        spec = self.model.kv_cache_spec()
        self.num_speculative_tokens = 0
        self.proposer = self._make_proposer()
        bs = config.block_size
        dcp = config.decode_context_parallel_size  # a logical block covers bs * dcp tokens (one bs-block per rank)
        if dcp > 1 and self.proposer is not None and self.model.recurrent_state_layers():
            raise NotImplementedError("speculative decoding under decode-context parallelism for a model with "
                                      "linear-attention (KDA) layers: the verify rollback of the recurrent state "
                                      "is not mirrored on the worker ranks yet")
        self.target_kv_bytes_per_token = spec.bytes_per_token(self.kv_cache_dtype)
        self.draft_kv_bytes_per_token = self.proposer.kv_bytes_per_token() if self.proposer else 0
        # Capacity accounting includes the draft pool: both are addressed by the same block ids. Per
        # rank, a block holds bs rows of the target cache (this rank's shard under DCP) and bs * dcp
        # rows of the replicated draft pool; kv_bytes_per_token is that per-rank cost per cache row.
        self.kv_bytes_per_token = self.target_kv_bytes_per_token + dcp * self.draft_kv_bytes_per_token
        if config.num_gpu_blocks is not None:
            num_blocks = config.num_gpu_blocks
        else:
            budget = config.kv_cache_memory or self._default_kv_budget()
            self._check_budget_fits(budget)
            if not config.kv_cache_memory and self.model.recurrent_state_layers():  # the KDA state pool comes first
                from longflash.runner.state_pool import state_bytes_per_request
                budget -= state_bytes_per_request(self.model.recurrent_state_layers(), self.dtype) * (config.max_num_seqs + 1)
            num_blocks = budget // (self.kv_bytes_per_token * bs)
        if num_blocks < 1:
            raise ValueError(f"num_gpu_blocks must be >= 1, got {num_blocks}" if config.num_gpu_blocks is not None
                             else "the KV cache memory budget holds no block; raise --kv-cache-memory")
        self.num_blocks = int(num_blocks)
        capacity = self.num_blocks * bs * dcp
        model_max = int(self.model_config.get("max_position_embeddings") or capacity)
        if config.max_model_len is None:
            self.max_model_len = min(model_max, capacity)
            if capacity < model_max:
                # NOTE: vLLM refuses to start here; we keep a tiny KV budget usable (laptops, tests)
                # but say so, since requests longer than the cache will be rejected.
                logger.warning("max_model_len lowered from %d (max_position_embeddings) to %d tokens, the KV "
                               "cache's capacity; raise --kv-cache-memory or pass --max-model-len to choose",
                               model_max, capacity)
            if not config.enable_chunked_prefill and config.max_num_batched_tokens < self.max_model_len:
                # a prompt must fit one step without chunked prefill: a longer one would wait forever (an
                # explicit max_model_len above the budget is refused by EngineConfig)
                logger.warning("max_model_len lowered from %d to %d tokens, max_num_batched_tokens: without chunked "
                               "prefill a prompt is computed in one step; raise --max-num-batched-tokens, pass "
                               "--max-model-len, or enable chunked prefill", self.max_model_len,
                               config.max_num_batched_tokens)
                self.max_model_len = config.max_num_batched_tokens
        else:
            if config.max_model_len > model_max:
                raise ValueError(f"max_model_len {config.max_model_len} exceeds the model's max_position_embeddings "
                                 f"({model_max})")
            if config.max_model_len > capacity:
                raise ValueError(f"max_model_len {config.max_model_len} exceeds the KV cache capacity of {capacity} "
                                 f"tokens; lower --max-model-len or raise --kv-cache-memory")
            self.max_model_len = config.max_model_len
        prefix_caching = config.enable_prefix_caching
        if prefix_caching and self.model.recurrent_state_layers():
            logger.info("prefix caching disabled: the model has linear-attention (KDA) layers whose recurrent state "
                        "is not checkpointed at block boundaries")
            prefix_caching = False
        self.block_manager = BlockManager(self.num_blocks, bs * dcp, prefix_caching)
        self.scheduler = Scheduler(self.block_manager, config.max_num_batched_tokens, config.max_num_seqs,
                                   config.enable_chunked_prefill)
        if self.proposer is not None:  # before start_dcp: a torchrun worker rank serves from inside it
            self.proposer.allocate(self.num_blocks, bs * dcp)
        if config.tensor_parallel_size > 1:  # rank 0 of the TP/DCP process model; starts (or becomes) the workers
            from longflash.distributed.engine import start_dcp
            self.runner = start_dcp(self)
        else:
            self.runner = ModelRunner(self.model, self.num_blocks, bs, self.kv_cache_dtype, self.device,
                                      config.calculate_kv_scales, config.context_workspace_rows, config.max_num_seqs)
        self._graphs_pending = self._setup_uniform_decode()
        self._scales_unlogged = self._kv_scales_pending()  # logged once the first batch has set them
        self.stop_checker = StopChecker(self.tokenizer, self.eos_token_ids, self.max_model_len)
        self.sampling_generator = torch.Generator(device="cpu").manual_seed(config.seed)
        self.stats = EngineStats()
        self.requests: dict[str, Sequence] = {}
        # (request_id, exception) of requests that step() failed and aborted; drained by the caller.
        self.failed_requests: list[tuple[str, Exception]] = []
        self._counter = 0
        self.async_decode = self._make_async_decode()
        self._ahead: AheadStep | None = None  # a launched decode step whose tokens are not read yet
        self.log_startup()

    # ---- set-up ---------------------------------------------------------------------------
    def _make_proposer(self):
        """The DFlash proposer named by ``speculative_config``; the embedded default model uses
        its shipped drafter unless speculative decoding is turned off."""
        sc = self.config.speculative_config
        if sc == "off":
            return None
        if sc is None:
            shipped = os.path.join(self.config.model, "drafter")
            from longflash.default_model_path import is_default_model
            if not (is_default_model(self.config.model) and os.path.isfile(os.path.join(shipped, "config.json"))):
                return None
            sc = {"method": "dflash", "model": shipped}
        from longflash.spec_decode.proposer import DFlashProposer
        proposer = DFlashProposer.from_engine_config(sc["model"], self.model, self.dtype, self.device, self.config)
        k = sc.get("num_speculative_tokens") or proposer.block_size - 1
        self.num_speculative_tokens = min(int(k), proposer.block_size - 1)
        logger.info("speculative decoding: DFlash drafter %s, block size %d, %d draft tokens per step, taps %s (%s)",
                    sc["model"], proposer.block_size, self.num_speculative_tokens,
                    proposer.drafter.cfg.target_layer_ids, proposer.tapper.mode)
        return proposer

    def _make_async_decode(self) -> AsyncDecode | None:
        """The async-scheduling launcher (``engine/async_scheduling.py``), or None. ``async_scheduling``
        None (the default) turns it on on CUDA, as vLLM; it applies to one process without a DFlash
        drafter (the drafter's verify steps read their results on the host first), and only to steps on
        the uniform decode path (the GPU's; on the CPU tests turn it on with :meth:`enable_uniform_decode`)."""
        on = self.config.async_scheduling
        if on is None:
            on = self.device.type == "cuda"
        if not on:
            return None
        why = ("a DFlash drafter" if self.proposer is not None else
               None if self.runner.supports_async_scheduling else "tensor / decode-context parallelism")
        if why is not None:
            (logger.warning if self.config.async_scheduling else logger.info)(
                "async scheduling is off: not supported with %s (each step ends by reading its tokens)", why)
            return None
        if self.runner.decode_runner is None:
            logger.warning("async scheduling has no effect here: it applies to decode steps on the uniform "
                           "(persistent-input) path, which runs on CUDA only")
        return AsyncDecode(self.runner, self.block_manager, self.max_model_len, self.config.max_num_seqs,
                           self.device)

    def _setup_uniform_decode(self) -> bool:
        """On a GPU (no KDA layers): :meth:`enable_uniform_decode`, with CUDA graphs unless
        ``enforce_eager``. Returns True while graph capture is pending (fp8 KV scales are calculated
        from the first forward and baked into the graphs)."""
        if self.device.type != "cuda" or self.runner.state_pool is not None:
            return False
        return self.enable_uniform_decode(cuda_graphs=not self.config.enforce_eager)

    def enable_uniform_decode(self, cuda_graphs: bool) -> bool:
        """Run decode and verify steps in which every request has the same query length on persistent
        inputs without host syncs (``runner/cuda_graph.py``), and the DFlash drafter's uniform block
        forwards likewise (``spec_decode/draft_graph.py``); replay them from CUDA graphs when
        ``cuda_graphs``. The GPU engine turns this on by itself; on the CPU (eager only) it is for
        tests. Bf16 routed experts are stacked for the grouped MoE kernel. Under tensor / decode-context
        parallelism every rank does the same (``DCPModelRunner``: rank 0 posts each uniform step's
        inputs, all ranks replay the same graph, the collectives captured in it). Returns True when graph
        capture waits for the first forward (fp8 KV scales to calculate).

        Raises ValueError for a model with KDA layers, and when CUDA graphs are asked for off a GPU."""
        if self.runner.state_pool is not None:
            raise ValueError("uniform decode steps need a model without linear-attention (KDA) layers")
        if cuda_graphs and self.device.type != "cuda":
            raise ValueError("CUDA graphs need a CUDA device")
        if self.device.type == "cuda":
            prepare_uniform_model(self.model)
            if self.proposer is not None:
                self.proposer.drafter.fuse_projections()
        capturer = None
        if cuda_graphs:
            from longflash.runner.cuda_graph import GraphCapturer
            capturer = GraphCapturer(self.device)
        query_lens = [1] + ([1 + self.num_speculative_tokens] if self.proposer is not None else [])
        self.runner.enable_uniform_decode(self.max_model_len, self.config.max_num_seqs, query_lens, capturer)
        if self.proposer is not None:
            self.proposer.enable_uniform(self.config.block_size, self.max_model_len, self.config.max_num_seqs,
                                         capturer)
        if capturer is None:
            return False
        if self._kv_scales_pending():
            logger.info("CUDA graphs: captured after the first forward (fp8 KV scales are calculated from it)")
            return True
        self._capture_graphs()
        return False

    def _kv_scales_pending(self) -> bool:
        return any(getattr(m, "calculate_kv_scales", False) for m in self.model.attention_layers())

    @torch.inference_mode()
    def _capture_graphs(self) -> None:
        """Capture the decode/verify and drafter graphs; if capture fails (an op that synchronizes or
        changes shape with the data), log it and keep running the same steps eagerly."""
        try:
            self.runner.capture_graphs(self.proposer)
        except Exception:  # noqa: BLE001 — graphs are an optimization; the eager uniform path is equivalent
            logger.exception("CUDA graph capture failed; decode steps run eagerly (as with --enforce-eager)")
            self.runner.drop_graphs(self.proposer)
            torch.cuda.synchronize(self.device)

    def _kv_cache_dtype(self) -> torch.dtype:
        kvd = self.config.kv_cache_dtype
        if kvd == "auto":
            return self.dtype
        if kvd == "bfloat16":
            return torch.bfloat16
        return torch.float8_e4m3fn

    def _check_budget_fits(self, budget: int) -> None:
        """Raises ValueError when the KV budget (bytes) exceeds the memory the device has free, so a
        typo fails at start-up instead of exhausting the machine."""
        if self.device.type == "cuda":
            free, _ = torch.cuda.mem_get_info(self.device)
        else:
            try:
                free = os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
            except (ValueError, OSError, AttributeError):
                return
        if budget > free:
            raise ValueError(f"--kv-cache-memory of {budget / 2**30:.2f} GiB exceeds the {free / 2**30:.2f} GiB of "
                             f"{self.device.type} memory available")

    def _default_kv_budget(self) -> int:
        if self.device.type == "cuda":
            free, _ = torch.cuda.mem_get_info(self.device)
            return int(free * 0.9) - (1 << 30)
        return DEFAULT_CPU_KV_CACHE_BYTES

    def startup_report(self) -> dict:
        """Load time (s), KV cache size in tokens/blocks/bytes, max concurrency at max_model_len.

        Bytes are per rank: ``kv_cache_bytes`` = ``target_kv_cache_bytes`` (the target's cache, this
        rank's shard under DCP) + ``draft_kv_cache_bytes`` (the DFlash draft pool, replicated: every
        rank holds all ``block_size * dcp`` tokens of each block). ``kv_bytes_per_token`` is the
        per-rank cost of one cache row (target row + dcp draft rows).
        """
        bs = self.config.block_size
        dcp = self.config.decode_context_parallel_size
        tokens = self.num_blocks * bs * dcp  # DCP: each rank stores 1/dcp of every logical block
        per_req_blocks = self.block_manager.blocks_needed(self.max_model_len)
        return {
            "model_load_time_s": round(self.load_time, 3),
            "dtype": str(self.dtype).replace("torch.", ""),
            "kv_cache_dtype": str(self.kv_cache_dtype).replace("torch.", ""),
            "kv_cache_tokens": tokens,
            "kv_cache_blocks": self.num_blocks,
            "kv_cache_bytes": self.num_blocks * bs * self.kv_bytes_per_token,  # per rank
            "target_kv_cache_bytes": self.num_blocks * bs * self.target_kv_bytes_per_token,  # per rank (shard)
            "draft_kv_cache_bytes": self.num_blocks * bs * dcp * self.draft_kv_bytes_per_token,  # per rank (replica)
            "draft_kv_cache_dtype": str(self.proposer.pool_dtype).replace("torch.", "") if self.proposer else None,
            "target_kv_bytes_per_token": self.target_kv_bytes_per_token,
            "draft_kv_bytes_per_token": self.draft_kv_bytes_per_token,
            "decode_context_parallel_size": dcp,
            "kv_bytes_per_token": self.kv_bytes_per_token,
            "max_model_len": self.max_model_len,
            "max_concurrency": round(self.num_blocks / per_req_blocks, 2),
            # in effect: launched ahead where a step allows it (CUDA, one process, no drafter)
            "async_scheduling": getattr(self, "async_decode", None) is not None and
            self.runner.decode_runner is not None,
            **self._kv_scale_report(),
            "recurrent_state_bytes_per_request": pool.bytes_per_request if (pool := self.runner.state_pool) else 0,
            "recurrent_state_bytes": pool.total_bytes if pool else 0,
        }

    def _kv_scale_report(self) -> dict:
        """fp8 scales per layer (and where they came from) and the token capacity of this KV budget
        in each cache dtype (fp8 holds twice the tokens of bf16)."""
        spec = self.model.kv_cache_spec()
        bs = self.config.block_size
        dcp = self.config.decode_context_parallel_size
        # The draft pool (DFlash) is addressed by the same blocks, so it costs the same in every dtype
        # (dcp draft rows per target row under DCP: the pool is replicated).
        draft = dcp * self.draft_kv_bytes_per_token
        budget = self.num_blocks * bs * self.kv_bytes_per_token
        capacity = {str(d).replace("torch.", ""): budget // ((spec.bytes_per_token(d) + draft) * bs) * bs * dcp
                    for d in (torch.float32, torch.bfloat16, torch.float8_e4m3fn)}
        layers = self.model.attention_layers()
        fp8 = self.kv_cache_dtype == torch.float8_e4m3fn
        sources = sorted({getattr(m, "k_scale_source", "default") for m in layers})
        if fp8 and self.config.calculate_kv_scales and any(getattr(m, "calculate_kv_scales", False) for m in layers):
            sources = ["pending: amax/200 of the first batch"]
        return {
            "kv_capacity_tokens_by_dtype": capacity,
            "context_workspace_rows": self.config.context_workspace_rows,
            "k_scales": [float(getattr(m, "k_scale", 1.0)) for m in layers] if fp8 else None,
            "k_scale_source": ",".join(sources) if fp8 else "unused (cache is not fp8)",
        }

    def log_startup(self) -> None:
        r = self.startup_report()
        logger.info("model loaded in %.2f s (dtype %s, device %s)", r["model_load_time_s"], r["dtype"], self.device)
        from longflash.models.weight_report import format_weight_report, weight_memory_report
        logger.info("%s", format_weight_report(weight_memory_report(self.model)))
        dcp = r["decode_context_parallel_size"]
        if dcp > 1:  # blocks and bytes are one rank's; a block holds block_size tokens of each rank's shard
            logger.info("KV cache: %d tokens = %d DCP ranks x %d blocks of %d per rank (%s, %d bytes per cached "
                        "row on a rank, %.1f MiB per rank)", r["kv_cache_tokens"], dcp, r["kv_cache_blocks"],
                        self.config.block_size, r["kv_cache_dtype"], r["kv_bytes_per_token"],
                        r["kv_cache_bytes"] / 2**20)
        else:
            logger.info("KV cache: %d tokens in %d blocks of %d (%s, %d bytes/token, %.1f MiB)", r["kv_cache_tokens"],
                        r["kv_cache_blocks"], self.config.block_size, r["kv_cache_dtype"], r["kv_bytes_per_token"],
                        r["kv_cache_bytes"] / 2**20)
        if r["decode_context_parallel_size"] > 1:
            logger.info("decode-context parallelism %d: each rank holds %.1f MiB of KV (target shard %.1f MiB + "
                        "replicated draft pool %.1f MiB); capacity x%d = %d tokens",
                        r["decode_context_parallel_size"], r["kv_cache_bytes"] / 2**20,
                        r["target_kv_cache_bytes"] / 2**20, r["draft_kv_cache_bytes"] / 2**20,
                        r["decode_context_parallel_size"], r["kv_cache_tokens"])
        logger.info("maximum concurrency for %d tokens per request: %.2fx", r["max_model_len"], r["max_concurrency"])
        if r["async_scheduling"]:
            logger.info("async scheduling: plain greedy decode steps are launched before the previous step's "
                        "tokens are read")
        if r["recurrent_state_bytes"]:
            logger.info("KDA recurrent state: %d bytes per request, %.1f MiB for %d slots",
                        r["recurrent_state_bytes_per_request"], r["recurrent_state_bytes"] / 2**20,
                        self.runner.state_pool.num_slots)
        logger.info("KV capacity of this budget by cache dtype: %s tokens; context workspace %d rows",
                    r["kv_capacity_tokens_by_dtype"], r["context_workspace_rows"])
        if self.draft_kv_bytes_per_token:
            logger.info("target KV cache: %d bytes/token (%s), %.1f MiB; DFlash draft KV pool: %d bytes/token (%s), "
                        "%.1f MiB, same blocks as the target cache%s", r["target_kv_bytes_per_token"],
                        r["kv_cache_dtype"], r["target_kv_cache_bytes"] / 2**20, r["draft_kv_bytes_per_token"],
                        r["draft_kv_cache_dtype"], r["draft_kv_cache_bytes"] / 2**20,
                        " (replicated on every DCP rank)" if r["decode_context_parallel_size"] > 1 else "")
        if self.model_config.get("attn_res_block_size"):
            from longflash.models.attn_res_plan import attn_res_bytes_per_token
            b = attn_res_bytes_per_token(self.model_config, self.dtype)
            logger.info("AttnRes per-forward state: bank %d + prefix %d bytes/token (planned pool %d, separate "
                        "allocation peak %d), at most %d tokens per step", b.bank, b.prefix, b.pool, b.separate_peak,
                        self.config.max_num_batched_tokens)
        if r["k_scales"] is not None:
            ks = r["k_scales"]
            logger.info("fp8 KV k_scale (%s): min %.4g max %.4g over %d layers", r["k_scale_source"],
                        min(ks), max(ks), len(ks))

    def check_health(self) -> None:
        """Raises RuntimeError when a worker process of a multi-process engine has died (no-op for
        one process). An idle server calls it so a dead rank is noticed without a request."""
        if hasattr(self.runner, "check_workers"):
            self.runner.check_workers()

    def shutdown(self) -> None:
        """Stop the worker processes of a multi-process engine. Idempotent; the engine then refuses new
        requests (RuntimeError), with one process or several."""
        if hasattr(self.runner, "shutdown"):
            self.runner.shutdown()
        self._shut_down = True

    # ---- requests -------------------------------------------------------------------------
    def tokenize(self, prompt: str, add_special_tokens: bool = True) -> list[int]:
        """Token ids of a text prompt, with the tokenizer's special tokens (e.g. DeepSeek's and Llama's BOS)
        unless ``add_special_tokens`` is False: vLLM's default for text prompts (offline and
        ``/v1/completions``); a chat prompt is rendered by its template instead (``chat_request.py``).
        Raises ValueError without a tokenizer, for a non-string, and for text that is not valid Unicode
        (e.g. lone surrogates from undecodable bytes)."""
        return tokenize_text(self.tokenizer, prompt, add_special_tokens)

    def new_request_id(self) -> str:
        self._counter += 1
        return str(self._counter)

    def validate_prompt(self, prompt_token_ids: list[int], params: SamplingParams) -> int:
        """The request's output-length limit (:meth:`max_output_tokens`). Raises ValueError naming the
        problem: empty prompt, token out of vocabulary, too long."""
        if not prompt_token_ids:
            raise ValueError("the prompt is empty: at least one token is required")
        bad = [t for t in prompt_token_ids if not (0 <= int(t) < self.vocab_size)]
        if bad:
            raise ValueError(f"token id {bad[0]} is outside the vocabulary [0, {self.vocab_size})")
        return self.max_output_tokens(len(prompt_token_ids), params)

    def max_output_tokens(self, prompt_len: int, params: SamplingParams) -> int:
        """The output-length limit of a request: the one place that decides it (``LLM`` and the server).

        ``params.max_tokens`` None: the room left in the context, ``max_model_len - prompt_len`` (vLLM's
        rule for an unset limit; the server's default); left out (``SamplingParams``' default 16):
        ``min(16, room)``; an explicit value: itself.
        Raises ValueError when the prompt alone fills the context (naming the prompt length and
        max_model_len, whatever max_tokens is), when an explicit max_tokens does not fit beside the prompt
        (naming max_tokens), or when min_tokens exceeds a limit the caller did not set.
        """
        room = self.max_model_len - prompt_len
        if room < 1:
            raise ValueError(f"this model's maximum context length is {self.max_model_len} tokens, but the "
                             f"prompt alone has {prompt_len} tokens (room for at least one generated token is "
                             "needed)")
        if params.max_tokens is None or params.max_tokens_is_default:
            limit = room if params.max_tokens is None else min(int(params.max_tokens), room)
            if params.min_tokens > limit:
                raise ValueError(f"min_tokens ({params.min_tokens}) exceeds the {limit} output tokens that fit: "
                                 f"max_model_len {self.max_model_len} - {prompt_len} prompt tokens")
            return limit
        if params.max_tokens > room:
            raise ValueError(f"this model's maximum context length is {self.max_model_len} tokens, but "
                             f"{prompt_len} prompt tokens + max_tokens {params.max_tokens} exceed it")
        return params.max_tokens

    def add_request(self, request_id: str | None, prompt: str | list[int] | dict, params: SamplingParams,
                    arrival_time: float | None = None) -> str:
        """Queue a request. ``prompt`` is text, token ids, or ``{"prompt_token_ids": [...]}``. A left-out or
        None ``params.max_tokens`` is resolved by :meth:`max_output_tokens` on a copy of ``params``.

        ``params.truncate_prompt_tokens`` keeps the prompt's last k tokens (:meth:`_truncated`): the output's
        ``prompt_token_ids`` are the kept tokens while its ``prompt`` stays the text as given (None for token
        ids), as vLLM's ``RequestOutput.prompt`` (v1 ``LLMEngine.add_request`` passes the input's text, and
        its server renderer the request's, untruncated).

        Returns the request id. Raises ValueError (nothing is queued) for invalid input (also logprobs
        above ``max_logprobs``, token ids of ``allowed_token_ids`` / ``logit_bias`` / ``stop_token_ids``
        outside the vocabulary, an ``allowed_token_ids`` made only of EOS / stop ids with ``min_tokens`` > 0),
        RuntimeError after :meth:`shutdown`.
        """
        if getattr(self, "_shut_down", False):
            raise RuntimeError("this engine was shut down; create a new one")
        if params.logprobs is not None and params.logprobs > self.config.max_logprobs:
            raise ValueError(f"logprobs {params.logprobs} exceeds max_logprobs {self.config.max_logprobs} (an engine "
                             f"argument; `longflash serve --max-logprobs`)")
        text = None
        if isinstance(prompt, dict):
            _check_prompt_keys(prompt)
            raw = prompt.get("prompt_token_ids")
            ids, bad = _token_ids([] if raw is None else raw)
            if ids is None:
                raise ValueError(f"prompt_token_ids must be a list of integer token ids, got {bad!r}")
            text = prompt.get("prompt")
            if not ids and text is not None:
                ids = self.tokenize(text)
        elif isinstance(prompt, str):
            text, ids = prompt, self.tokenize(prompt) if prompt else []
        else:
            ids, _ = _token_ids(prompt)
            if ids is None:
                raise ValueError("a prompt must be text, a list of integer token ids, or {'prompt_token_ids': [...]}, "
                                 f"got {type(prompt).__name__}")
        params.validate()
        for name, token_ids in (("logit_bias", params.logit_bias or {}), ("stop_token_ids", params.stop_token_ids),
                                ("allowed_token_ids", params.allowed_token_ids or [])):
            bad = [t for t in token_ids if t >= self.vocab_size]
            if bad:
                raise ValueError(f"{name} contains {bad[0]}, outside the vocabulary [0, {self.vocab_size})")
        if params.allowed_token_ids is not None and params.min_tokens > 0 and \
                set(params.allowed_token_ids) <= self.eos_token_ids | set(params.stop_token_ids):
            # every allowed id is masked until min_tokens (sampler.process_logits): nothing could be sampled
            raise ValueError(f"allowed_token_ids {sorted(set(params.allowed_token_ids))} are all EOS / stop_token_ids, "
                             f"which min_tokens={params.min_tokens} forbids before that many tokens: no token can be "
                             "sampled")
        ids = self._truncated(ids, params.truncate_prompt_tokens)
        if params.n != 1:
            raise ValueError(f"n must be 1 for LLMEngine.add_request, got {params.n}; LLM.generate and the "
                             "server fan n > 1 out into n requests")
        limit = self.validate_prompt(ids, params)
        if limit != params.max_tokens or params.max_tokens_is_default:  # a copy: the caller may reuse params
            params = replace(params, max_tokens=limit, stop=list(params.stop),
                             stop_token_ids=list(params.stop_token_ids))
        request_id = request_id or self.new_request_id()
        if request_id in self.requests:
            raise ValueError(f"request id {request_id!r} is already in use")
        seq = Sequence(request_id, ids, params, text, arrival_time)
        if params.seed is None:
            seq.generator = None
        self.requests[request_id] = seq
        self.scheduler.add(seq)
        return request_id

    def _truncated(self, ids: list[int], truncate_prompt_tokens: int | None) -> list[int]:
        """The last ``truncate_prompt_tokens`` of ``ids`` (vLLM's left truncation; -1: the last
        ``max_model_len``; None: all). Raises ValueError for a value above ``max_model_len`` (vLLM)."""
        k = truncate_prompt_tokens
        if k is None:
            return ids
        if k == -1:
            k = self.max_model_len
        elif k > self.max_model_len:
            raise ValueError(f"truncate_prompt_tokens ({k}) must be <= max_model_len ({self.max_model_len})")
        return ids[-k:]

    def abort_request(self, request_id: str) -> bool:
        """Drop a request and free its KV blocks at once. Returns False if it was unknown."""
        seq = self.requests.pop(request_id, None)
        if seq is None:
            return False
        self.scheduler.abort(request_id)
        self.runner.free_state(request_id)
        seq.finish_reason = seq.finish_reason or "abort"
        return True

    def has_unfinished_requests(self) -> bool:
        return self.scheduler.has_unfinished()

    @property
    def num_running(self) -> int:
        return len(self.scheduler.running)

    @property
    def num_waiting(self) -> int:
        return len(self.scheduler.waiting)

    @torch.inference_mode()
    def score(self, prompt_token_ids: list[int], chunk_size: int | None = None) -> torch.Tensor:
        """Logits of every position of ``prompt_token_ids`` (teacher forcing), computed through the
        paged cache in prefill chunks of ``chunk_size`` tokens (default: one chunk), reusing the
        prefix cache like a request would.

        Returns [T, vocab] fp32. Raises ValueError for an invalid prompt or when the KV pool cannot
        hold the sequence while other requests run.
        """
        from longflash.engine.scheduler import ScheduledSeq, SchedulerOutput
        self.validate_prompt(prompt_token_ids, SamplingParams(max_tokens=1))
        seq = Sequence(f"score-{self.new_request_id()}", prompt_token_ids, SamplingParams(max_tokens=1))
        chunk = chunk_size or len(prompt_token_ids)
        if not self.block_manager.allocate_for_new(seq, min(chunk, len(prompt_token_ids))):
            raise ValueError("the KV cache cannot hold this sequence now")
        cached = seq.num_computed_tokens
        pieces = []
        try:
            if cached:
                # Positions served from the prefix cache still need logits: recompute them
                # without writing (their slots are owned by the cache).
                pieces.append(self._score_cached_prefix(seq, cached))
            while seq.num_computed_tokens < len(seq.token_ids):
                n = min(chunk, len(seq.token_ids) - seq.num_computed_tokens)
                self.block_manager.append_slots(seq, n)
                logits = self.runner.execute(SchedulerOutput([ScheduledSeq(seq, n)], []), all_logits=True).logits
                pieces.append(logits)
                seq.num_computed_tokens += n
                self.block_manager.cache_full_blocks(seq)
        finally:
            self.block_manager.free(seq)
            self.runner.free_state(seq.request_id)
        return torch.cat(pieces)

    def _score_cached_prefix(self, seq: Sequence, cached: int) -> torch.Tensor:
        from longflash.engine.scheduler import ScheduledSeq, SchedulerOutput
        tmp = Sequence(f"{seq.request_id}-prefix", seq.token_ids[:cached], SamplingParams(max_tokens=1))
        tmp.block_table = []
        self.block_manager.append_slots(tmp, cached)
        try:
            logits = self.runner.execute(SchedulerOutput([ScheduledSeq(tmp, cached)], []), all_logits=True).logits
        finally:
            self.block_manager.free(tmp)
        return logits

    # ---- stepping -------------------------------------------------------------------------
    def _lookahead(self, seq: Sequence) -> int:
        """Draft tokens to verify after the pending token: B − 1 (or num_speculative_tokens), never past
        max_model_len (the cache slots). Not cut at max_tokens: the commit stops there anyway, and a
        constant count keeps a batch's verify steps uniform (one CUDA graph) while its requests
        finish at different steps (cutting it made every step with a finishing request take the
        eager general path)."""
        return max(0, min(self.num_speculative_tokens, self.max_model_len - len(seq.token_ids)))

    def step(self) -> list[RequestOutput]:
        """Schedule, (draft,) run the target once, sample or verify, update requests. Returns the
        requests that produced tokens or finished (cumulative text and token ids); a request whose
        ``output_kind`` is FINAL_ONLY only when it finishes.

        Under async scheduling a plain greedy decode step launches its successor before its own tokens
        are read (``engine/async_scheduling.py``); the next call then returns that launched step's tokens
        without scheduling, or discards it when every request in it has finished or been aborted."""
        ahead, self._ahead = self._ahead, None
        if ahead is not None and any(self._is_live(s.seq) for s in ahead.sched.scheduled):
            return self._finish_step(ahead.sched, ahead.result)
        sched = self.scheduler.schedule(self._lookahead if self.proposer is not None else None)
        self.stats.num_preemptions = self.scheduler.num_preemptions
        for seq in sched.preempted:
            self.runner.free_state(seq.request_id)
        if not sched.scheduled:
            return []
        t_sched = time.time()
        for s in sched.scheduled:  # before the forward: queue time and prefill time stay apart
            if s.seq.metrics.first_scheduled_time is None:
                s.seq.metrics.first_scheduled_time = t_sched
        if self._scales_unlogged and not self._kv_scales_pending():
            self._scales_unlogged = False
            ks = self.startup_report()["k_scales"]
            logger.info("fp8 KV k_scale calculated from the first batch (amax / 200, now frozen): min %.4g max %.4g "
                        "over %d layers", min(ks), max(ks), len(ks))
        if self._graphs_pending and not self._kv_scales_pending():
            self._graphs_pending = False
            self._capture_graphs()
        drafting = [s for s in sched.scheduled if s.num_lookahead_tokens]
        if drafting:
            # The sampler's vocabulary masks (allowed_token_ids, min_tokens) also apply to the drafts
            # (spec_decode/draft_mask.py); a masked request never takes the (unmasked) chained drafts.
            masks = [draft_mask(s.seq.sampling_params, s.seq.num_output_tokens, self.eos_token_ids) for s in drafting]
            keep = [not self._use_chained_drafts(s.seq, s.num_lookahead_tokens, m is None)
                    for s, m in zip(drafting, masks)]
            drafting = [s for s, k in zip(drafting, keep) if k]
            masks = [m for m, k in zip(masks, keep) if k]
        if drafting:
            drafts = self.runner.propose(self.proposer, [(s.seq.token_ids[-1], s.seq.num_computed_tokens,
                                                          s.num_lookahead_tokens, s.seq.block_table) for s in drafting],
                                         masks if any(m is not None for m in masks) else None)
            for s, d in zip(drafting, drafts):
                s.seq.spec_token_ids = d
        return self._finish_step(sched, self.runner.execute(sched, proposer=self.proposer))

    def _is_live(self, seq: Sequence) -> bool:
        """False for a request finished or aborted after its step was launched (async scheduling: its
        row of the step launched ahead is discarded)."""
        return not seq.is_finished and self.requests.get(seq.request_id) is seq

    def _finish_step(self, sched, res) -> list[RequestOutput]:
        """Read step ``sched``'s tokens from its result ``res`` and update its requests (under async
        scheduling, after launching the next step: ``AsyncDecode.launch``). Returns the outputs of
        ``sched``'s requests (as :meth:`step`)."""
        if res.chain is not None:
            for s, nxt in zip(sched.scheduled, res.chain.next_drafts):
                s.seq.chained_drafts = nxt
        # NOTE: the step's only device -> host sync on the decode path: every row's argmax at once
        # (greedy requests), instead of one read per sampled token.
        if res.chain is not None:
            greedy = res.chain.greedy_ids
        else:  # (the live rows are listed only under async scheduling: no per-step work otherwise)
            ahead_rows = self.async_decode.next_rows(
                sched, res, len(self.scheduler.waiting),
                [i for i, s in enumerate(sched.scheduled) if self._is_live(s.seq)],
                len(self.scheduler.running)) if self.async_decode else []
            if ahead_rows:
                greedy, self._ahead = self.async_decode.launch(sched, res, ahead_rows)
            else:
                greedy = row_argmax(res.logits).tolist() \
                    if any(self._plain_greedy(s.seq) for s in sched.scheduled) and res.logits.shape[0] else None
        try:
            return self._read_step(sched, res, greedy)
        except BaseException:
            # NOTE: some requests' tokens of this step were not read (e.g. Ctrl-C), but the step launched ahead
            # assumes they were: drop it; those requests recompute this step's position at the next step.
            self._ahead = None
            raise

    def _read_step(self, sched, res, greedy: list[int] | None) -> list[RequestOutput]:
        """Append step ``sched``'s tokens (``greedy``: every row's argmax, or None) to its requests, check stops,
        commit KV and prefix-cache blocks. Returns the outputs of ``sched``'s requests (as :meth:`step`)."""
        outputs = []
        now = time.time()
        for i, s in enumerate(sched.scheduled):
            seq = s.seq
            if not self._is_live(seq):
                continue
            first_row, n_rows = res.spans[i]
            try:
                tokens = self._sample_and_verify(seq, res.logits[first_row:first_row + n_rows],
                                                 s.num_lookahead_tokens,
                                                 greedy[first_row:first_row + n_rows] if greedy else None) if n_rows else []
                # Rows whose KV is now valid: the scheduled tokens plus the accepted drafts.
                committed = s.num_new_tokens + (len(tokens) - 1 if s.num_lookahead_tokens else 0)
                if self.proposer is not None:
                    self.runner.write_draft_context(self.proposer, res, res.ctx.query_start_loc_cpu[i], committed)
                decoding = seq.num_computed_tokens >= seq.num_prompt_tokens
                seq.num_computed_tokens += committed
                seq.spec_token_ids = []
                if s.num_lookahead_tokens:
                    self.block_manager.truncate(seq, seq.num_computed_tokens)
                    if self.runner.state_pool is not None:  # KDA state after the last accepted token
                        self.runner.state_pool.commit(seq.request_id, committed)
                if not tokens:
                    self.block_manager.cache_full_blocks(seq)
                    continue
                if decoding or seq.num_output_tokens > 0:  # a token after the first (a decode step, or the
                    seq.metrics.num_decode_steps += 1   # recompute prefill of a preempted request)
                for t in tokens:
                    self._append(seq, t, now)
                    if seq.is_finished:
                        break
                # NOTE: after the append: accepted drafts' KV is committed but their token ids (the
                # block hash input) are only known now. A finishing request was hashed in _finish.
                if not seq.is_finished:
                    self.block_manager.cache_full_blocks(seq)
            except Exception as e:
                # NOTE: one request's sampling/detokenization failure fails that request only; the
                # others in the batch keep their tokens. The caller drains ``failed_requests``.
                logger.exception("request %s failed in the engine", seq.request_id)
                self.abort_request(seq.request_id)
                self.failed_requests.append((seq.request_id, e))
                continue
            if seq.is_finished or seq.sampling_params.output_kind != RequestOutputKind.FINAL_ONLY:
                outputs.append(self._output(seq))
        if self.proposer is not None:
            self.runner.flush_draft_context(self.proposer, res)
        return outputs

    @staticmethod
    def _use_chained_drafts(seq: Sequence, num_drafts: int, unmasked: bool = True) -> bool:
        """Take the drafts the previous (chained) step computed on the device for ``seq`` when it
        committed what that step assumed (the same next position and pending token: the drafter's
        context and block input are then exactly those of a fresh proposal) and its drafts need no
        vocabulary mask (``unmasked``: the chained drafts are the plain argmax). Returns True if taken;
        the chained drafts are dropped either way."""
        c, seq.chained_drafts = seq.chained_drafts, None
        if c is None or not unmasked or c[0] != seq.num_computed_tokens or c[1] != seq.token_ids[-1] \
                or len(c[2]) < num_drafts:
            return False
        seq.spec_token_ids = c[2][:num_drafts]
        return True

    def _sample_and_verify(self, seq: Sequence, logits: torch.Tensor, num_drafts: int,
                           greedy_ids: list[int] | None = None) -> list[int]:
        """Tokens to commit from logits [num_drafts + 1, vocab].

        Without drafts: one sampled token. With drafts d_1..d_L: the target's token at slot k is
        sampled (argmax when greedy) and compared with d_{k+1}; matching drafts are accepted and the
        first mismatch (or the bonus token after L acceptances) is committed too. Drafts are
        deterministic (argmax), so sample-and-compare is lossless (``shared/specs/dflash.md`` §4).
        ``greedy_ids``: the rows' argmax, already read (used for greedy requests without logits
        processing). With min_tokens or penalties, row k is processed as if drafts 1..k were accepted
        (``sampler.process_logits``); greedy then takes the processed rows' argmax.
        """
        drafts = seq.spec_token_ids[:num_drafts]
        raw = logits
        params = seq.sampling_params
        if needs_logits_processing(params, seq.num_output_tokens):
            logits = process_logits(raw, params, seq.prompt_token_ids, seq.output_token_ids, drafts,
                                    self.eos_token_ids)
            greedy_ids = logits.argmax(dim=-1).tolist() if params.greedy else None
        out = []
        for k in range(num_drafts + 1):
            t = self._sample(seq, logits[k], greedy_ids[k] if greedy_ids is not None else None,
                             raw[k] if logits is not raw else None)
            out.append(t)
            if k == num_drafts or t != drafts[k]:
                break
        if num_drafts:
            a = len(out) - 1
            st = self.stats
            st.spec_num_drafts += 1
            st.spec_num_draft_tokens += num_drafts
            st.spec_num_accepted_tokens += a
            for k in range(a):
                st.spec_accepted_per_pos[k] = st.spec_accepted_per_pos.get(k, 0) + 1
        return out

    def _plain_greedy(self, seq: Sequence) -> bool:
        """Greedy and no logits processing: the step's plain argmax is this request's token."""
        return seq.sampling_params.greedy and not needs_logits_processing(seq.sampling_params, seq.num_output_tokens)

    def _sample(self, seq: Sequence, logits: torch.Tensor, greedy_id: int | None = None,
                raw_logits: torch.Tensor | None = None) -> int:
        """One token from logits [V] (processed, if the request has penalties/min_tokens); logprobs
        come from ``raw_logits`` (the model's, default: ``logits``)."""
        gen = seq.generator if seq.generator is not None else self.sampling_generator
        if greedy_id is not None and seq.sampling_params.greedy:
            token = greedy_id  # = sample_token's argmax (first maximum), read for the whole step at once
        else:
            token = sample_token(logits, seq.sampling_params, gen)
        if seq.output_logprobs is not None:
            decode = (lambda t: self.tokenizer.decode([t])) if self.tokenizer is not None else None
            seq.output_logprobs.append(compute_logprobs(logits if raw_logits is None else raw_logits, token,
                                                        seq.sampling_params.logprobs, decode))
        return token

    def _append(self, seq: Sequence, token: int, now: float) -> None:
        m = seq.metrics
        if m.first_token_time is None:
            m.first_token_time = now
            self.stats.ttft.append(now - m.arrival_time)
            # counted once its prefill is done (as vLLM): a request aborted while waiting adds nothing
            self.stats.prompt_tokens += seq.num_prompt_tokens
        elif now != m.last_token_time:
            self.stats.itl.append(now - m.last_token_time)
        m.last_token_time = now
        seq.append_token(token)
        m.num_generation_tokens += 1
        m.num_cached_tokens = seq.num_cached_tokens
        self.stats.generation_tokens += 1
        if self.stop_checker.check(seq):
            self._finish(seq, now)

    def _finish(self, seq: Sequence, now: float) -> None:
        self.block_manager.cache_full_blocks(seq)  # before its blocks are freed
        self.scheduler.finish(seq)
        self.runner.free_state(seq.request_id)
        seq.metrics.finished_time = now
        self.stats.e2e.append(now - seq.metrics.arrival_time)
        self.stats.request_success[seq.finish_reason] = self.stats.request_success.get(seq.finish_reason, 0) + 1
        self.requests.pop(seq.request_id, None)

    def _output(self, seq: Sequence) -> RequestOutput:
        lps = seq.output_logprobs
        cum = None if lps is None else sum(lp[t].logprob for lp, t in zip(lps, seq.output_token_ids))
        comp = CompletionOutput(0, seq.output_text, list(seq.output_token_ids), list(lps) if lps is not None else None,
                                seq.finish_reason, seq.stop_reason, cum)
        # NOTE: the prompt's ids are shared, not copied (as vLLM): a copy per request per step was
        # O(prompt) host work, 1.5 ms per step for 16 streamed requests of 16K tokens on this CPU.
        return RequestOutput(seq.request_id, seq.prompt, seq.prompt_token_ids, [comp], seq.is_finished,
                             seq.metrics, seq.num_cached_tokens)
