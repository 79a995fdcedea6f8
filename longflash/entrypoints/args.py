"""Engine flags shared by ``longflash generate``, ``serve`` and ``bench`` (vLLM's names and aliases)."""

from __future__ import annotations

import argparse

from longflash.config import EngineConfig, parse_bytes, parse_speculative_config


def _memory_size(value: str) -> int:
    """argparse type of a byte count: ``parse_bytes`` with its own message (argparse would say
    "invalid parse_bytes value")."""
    try:
        return parse_bytes(value)
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e)) from None


def add_engine_args(p: argparse.ArgumentParser, model_positional: bool = False) -> None:
    if model_positional:
        p.add_argument("model_tag", nargs="?", default=None, help="model directory (default: the embedded model)")
    p.add_argument("--model", default=None, help="HF model directory (default: the embedded model)")
    p.add_argument("--tokenizer", default=None, help="tokenizer directory (default: the model's)")
    p.add_argument("--skip-tokenizer-init", action="store_true")
    p.add_argument("--dtype", default="auto", help="auto (fp32 on CPU, checkpoint dtype on GPU), float32, bfloat16, float16")
    p.add_argument("--device", default=None, help="cpu or cuda (default: cuda when present)")
    p.add_argument("--max-model-len", type=int, default=None, help="maximum prompt + output tokens per request")
    p.add_argument("--max-num-batched-tokens", type=int, default=2048, help="token budget of one engine step")
    p.add_argument("--max-num-seqs", type=int, default=64, help="maximum running requests")
    p.add_argument("--block-size", type=int, default=16, help="tokens per KV cache block")
    p.add_argument("--kv-cache-memory", type=_memory_size, default=None,
                   help="KV cache budget: bytes or e.g. 2GiB (default: 1GiB on CPU, 90%% of free GPU memory)")
    p.add_argument("--num-gpu-blocks-override", dest="num_gpu_blocks", type=int, default=None)
    p.add_argument("--kv-cache-dtype", default="auto", choices=["auto", "bfloat16", "fp8", "fp8_e4m3"])
    p.add_argument("--calculate-kv-scales", action="store_true",
                   help="fp8 KV cache: set each layer's k_scale to amax/200 of the first batch, then freeze it")
    p.add_argument("--max-context-workspace-rows", dest="context_workspace_rows", type=int, default=64 * 1024,
                   help="rows of cached context a prefill gathers at once (bounds its peak memory)")
    p.add_argument("--enable-prefix-caching", action=argparse.BooleanOptionalAction, default=True)
    p.add_argument("--enable-chunked-prefill", action=argparse.BooleanOptionalAction, default=True)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("-tp", "--tensor-parallel-size", type=int, default=1,
                   help="ranks the weights are sharded over (one process per rank; one GPU each on CUDA)")
    p.add_argument("-dcp", "--decode-context-parallel-size", type=int, default=1,
                   help="ranks of each group that shard the KV cache by position (divides -tp; MLA models; "
                        "KV capacity x dcp)")
    p.add_argument("--enforce-eager", action="store_true",
                   help="no CUDA graphs (decode steps launch their kernels one by one)")
    p.add_argument("--async-scheduling", action=argparse.BooleanOptionalAction, default=None,
                   help="launch each plain greedy decode step before the previous step's tokens are read, "
                        "hiding the host's work per step (default: on for CUDA, off on the CPU)")
    p.add_argument("--cp-kv-cache-interleave-size", type=int, default=1,
                   help="DCP: consecutive positions stored on one rank before moving to the next (divides block size)")
    p.add_argument("--master-port", type=int, default=None,
                   help="rendezvous port of a multi-process run (default: a free port; torchrun's MASTER_PORT wins)")
    p.add_argument("--distributed-timeout-s", type=float, default=60.0,
                   help="seconds a collective waits for a peer before the engine fails")
    p.add_argument("--max-logprobs", type=int, default=20,
                   help="largest logprobs / top_logprobs a request may ask for (vLLM's default 20)")
    p.add_argument("--dflash-mxfp8-input", action="store_true",
                   help="feed the DFlash drafter an MXFP8-quantized tap input (staged for large forwards)")
    p.add_argument("--dflash-staged-threshold", type=int, default=512,
                   help="tokens per forward from which the MXFP8 drafter input is quantized tap by tap")
    p.add_argument("--speculative-config", type=_speculative_config, default=None,
                   help="DFlash drafter as JSON, e.g. '{\"method\": \"dflash\", \"model\": PATH, "
                        "\"num_speculative_tokens\": 7}', or 'off' (default: the embedded model's own drafter)")


def _speculative_config(value: str):
    try:
        return parse_speculative_config(value)
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e)) from None


def engine_config_from_args(args: argparse.Namespace) -> EngineConfig:
    """Build the EngineConfig; raises ValueError for an invalid combination."""
    from longflash.default_model_path import default_model_path
    model = getattr(args, "model_tag", None) or args.model or default_model_path()
    return EngineConfig(
        model=model, dtype=args.dtype, device=args.device, max_model_len=args.max_model_len,
        max_num_batched_tokens=args.max_num_batched_tokens, max_num_seqs=args.max_num_seqs,
        block_size=args.block_size, kv_cache_memory=args.kv_cache_memory, num_gpu_blocks=args.num_gpu_blocks,
        kv_cache_dtype=args.kv_cache_dtype, calculate_kv_scales=args.calculate_kv_scales,
        context_workspace_rows=args.context_workspace_rows, enable_prefix_caching=args.enable_prefix_caching,
        enable_chunked_prefill=args.enable_chunked_prefill, seed=args.seed,
        skip_tokenizer_init=args.skip_tokenizer_init, tokenizer=args.tokenizer,
        tensor_parallel_size=args.tensor_parallel_size,
        decode_context_parallel_size=args.decode_context_parallel_size, enforce_eager=args.enforce_eager,
        async_scheduling=getattr(args, "async_scheduling", None),
        cp_kv_cache_interleave_size=getattr(args, "cp_kv_cache_interleave_size", 1),
        master_port=getattr(args, "master_port", None),
        distributed_timeout_s=getattr(args, "distributed_timeout_s", 60.0),
        speculative_config=getattr(args, "speculative_config", None),
        dflash_mxfp8_input=getattr(args, "dflash_mxfp8_input", False),
        dflash_staged_threshold=getattr(args, "dflash_staged_threshold", 512),
        max_logprobs=args.max_logprobs)
