"""Tensor / decode-context parallelism over NCCL (issue 6), GPU-only: skipped without >= 2 CUDA devices.

``-tp 2`` and ``-tp 2 -dcp 2`` (each rank on its own GPU, NCCL collectives, the step channel over gloo)
against the single-GPU engine, tiny DeepSeek-V3 in fp32: score logits of a 57-token prompt in 12-token
chunks (a prefix hit of 48 tokens too) and 64 greedy tokens of three prompts identical. A worker
SIGKILLed between steps makes ``step()`` raise naming the rank, and shutdown returns.

Tolerance: the CPU suite holds these runs to 1e-5 (``test_tp.py``); on the GPU the single-GPU engine
takes other kernels on decode (uniform decode, CUDA graphs) than the multi-process one (eager), so the
score logits get ``1e-4 * max(1, max |logit|)``.

The one-GPU NCCL path (a world-size-1 group through ``comm``) and the default model's checks are in
``benchmarks/nccl_smoke.py``.
"""

from __future__ import annotations

import os
import signal
import time

import pytest
import torch

from longflash.config import EngineConfig
from longflash.engine.llm_engine import LLMEngine
from longflash.sampling_params import SamplingParams

from engine_helpers import greedy_tokens

pytestmark = pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs >= 2 CUDA devices")


def _engine(model, tp, dcp, **kw):
    args = dict(model=model, device="cuda", dtype="float32", block_size=4, num_gpu_blocks=128,
                max_num_batched_tokens=16, context_workspace_rows=4, skip_tokenizer_init=True,
                tensor_parallel_size=tp, decode_context_parallel_size=dcp, speculative_config="off",
                distributed_timeout_s=60)
    args.update(kw)
    return LLMEngine(EngineConfig(**args))


def _run(model, tp, dcp, prompts):
    eng = _engine(model, tp, dcp)
    try:
        logits = [eng.score(prompts[0], chunk_size=12).cpu(), eng.score(prompts[0][:49], chunk_size=12).cpu()]
        assert eng.block_manager.prefix_cache_hits >= 48
        tokens = greedy_tokens(eng, prompts, 64)
        device = str(eng.device)
    finally:
        eng.shutdown()
    return logits, tokens, device


@pytest.mark.parametrize("tp,dcp", [(2, 1), (2, 2)])
def test_nccl_engine_equals_single_gpu(tiny_model, tp, dcp):
    model = tiny_model("dsv3-qlora-interleave-yarn")
    g = torch.Generator().manual_seed(0)
    prompts = [torch.randint(2, 200, (57,), generator=g).tolist(), [5, 6, 7], [9]]
    ref_logits, ref_tokens, _ = _run(model, 1, 1, prompts)
    logits, tokens, device = _run(model, tp, dcp, prompts)
    assert device == "cuda:0"                                   # rank 0 on its local rank's GPU
    assert all(len(t) == 64 for t in tokens) and tokens == ref_tokens
    for a, b in zip(logits, ref_logits):
        bound = 1e-4 * max(1.0, float(b.abs().max()))
        print(f"tp {tp} dcp {dcp}: max |logit diff| {float((a - b).abs().max()):.3g} (bound {bound:.3g})")
        assert a.shape == b.shape and (a - b).abs().max() <= bound


def test_nccl_killed_worker_makes_step_raise(tiny_model):
    eng = _engine(tiny_model("dsv3-qlora-interleave-yarn"), 2, 2)
    try:
        eng.add_request(None, list(range(2, 40)), SamplingParams(temperature=0.0, max_tokens=400, ignore_eos=True))
        for _ in range(3):
            eng.step()
        os.kill(eng.runner.procs[0].pid, signal.SIGKILL)
        eng.runner.procs[0].join(10)
        t0 = time.monotonic()
        with pytest.raises(RuntimeError, match="rank 1"):
            while time.monotonic() - t0 < 60:
                eng.step()
    finally:
        t1 = time.monotonic()
        eng.shutdown()
    assert time.monotonic() - t1 < 30
