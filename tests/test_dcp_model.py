"""DCP through the process model on the CPU (gloo, fp32): rank 0 schedules (block manager with
``tokens_per_block = block_size * dcp``) and broadcasts each step; every rank runs the model over its
KV shard. Logits of every token and greedy tokens equal the single-process run (DCP 1), with chunked
prefill, a workspace forcing >= 3 context chunks, prefix-cache hits, fp8 caches, interleave 1 and
block_size, and requests shorter than dcp."""

from __future__ import annotations

import json
import os

import pytest
import torch

from longflash.attention.ops import FP8_DTYPE
from longflash.distributed import comm
from longflash.distributed.launch import run_ranks
from longflash.distributed.runner import DCPModelRunner
from longflash.engine.block_manager import BlockManager
from longflash.engine.scheduler import Scheduler
from longflash.engine.sequence import Sequence
from longflash.models.loader import load_model
from longflash.sampling_params import SamplingParams

BS = 4
MAX_TOKENS = 6
PROMPT0 = [(7 * i + 3) % 250 + 2 for i in range(45)]
PROMPTS = [PROMPT0, [11, 12, 13], [5]]
LATE = PROMPT0[:33] + [17, 19]           # added after PROMPT0 finished: prefix-cache hit


def _drive(runner: DCPModelRunner, dcp: int) -> dict:
    """Greedy generation on rank 0; returns {"logits": {rid/pos: row}, "tokens": {rid: [...]}}."""
    bm = BlockManager(64, BS * dcp, enable_prefix_caching=True)
    sch = Scheduler(bm, max_num_batched_tokens=16, max_num_seqs=8, enable_chunked_prefill=True)
    params = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS)
    seqs = [Sequence(f"r{i}", p, params) for i, p in enumerate(PROMPTS)]
    for s in seqs:
        sch.add(s)
    logits, late_added, steps = {}, False, 0
    while sch.has_unfinished():
        so = sch.schedule()
        res = runner.execute(so, all_logits=True)
        steps += 1
        for i, s in enumerate(so.scheduled):
            seq = s.seq
            q0, q1 = res.ctx.query_start_loc_cpu[i], res.ctx.query_start_loc_cpu[i + 1]
            for j, p in enumerate(range(seq.num_computed_tokens, seq.num_computed_tokens + q1 - q0)):
                logits[f"{seq.request_id}/{p}"] = res.logits[q0 + j].tolist()
            seq.num_computed_tokens += s.num_new_tokens
            bm.cache_full_blocks(seq)
            if seq.num_computed_tokens == len(seq.token_ids):
                seq.append_token(int(res.logits[q1 - 1].argmax()))
                if seq.num_output_tokens >= MAX_TOKENS:
                    sch.finish(seq)
        if not late_added and seqs[0].is_finished:
            seqs.append(Sequence("late", LATE, params))
            sch.add(seqs[-1])
            late_added = True
    return {"logits": logits, "tokens": {s.request_id: s.output_token_ids for s in seqs},
            "cached": seqs[-1].num_cached_tokens}


def _rank_main(rank, world, port, model_dir, interleave, fp8, out_dir):
    if world > 1:
        comm.init_distributed(rank, world, port, timeout_s=20)
    ps = comm.initialize_model_parallel(world, world, interleave)
    model, _ = load_model(model_dir, torch.float32, torch.device("cpu"), progress=False)
    runner = DCPModelRunner(model, 64, BS, FP8_DTYPE if fp8 else torch.float32, torch.device("cpu"),
                            context_workspace_rows=BS, parallel=ps, channel=comm.StepChannel(ps.tp))
    if fp8:
        for layer in model.attention_layers():
            layer.k_scale = 0.02
    if rank != 0:
        runner.serve_forever()
        return
    res = _drive(runner, world)
    runner.shutdown()
    with open(os.path.join(out_dir, "rank0.json"), "w") as f:
        json.dump(res, f)


def _run(model_dir, world, interleave, fp8, out_dir):
    os.makedirs(out_dir, exist_ok=True)
    codes = run_ranks(_rank_main, world, (model_dir, interleave, fp8, out_dir), timeout_s=80)
    assert codes == [0] * world
    with open(os.path.join(out_dir, "rank0.json")) as f:
        return json.load(f)


_REFS: dict = {}


def _reference(model_dir, fp8, out_dir):
    """The DCP 1 run (one process), computed once per cache dtype."""
    if fp8 not in _REFS:
        _REFS[fp8] = _run(model_dir, 1, 1, fp8, out_dir)
    return _REFS[fp8]


# (test_dcp_engine covers dcp 2 with I = 1 / fp32 and I = block_size / fp8 through LLMEngine)
@pytest.mark.parametrize("world,interleave,fp8", [(4, 2, False), (4, 1, True)])
def test_dcp_logits_and_greedy_equal_single_process(tiny_model, tmp_path, world, interleave, fp8):
    model_dir = tiny_model("dsv3-qlora-interleave-yarn")
    ref = _reference(model_dir, fp8, str(tmp_path / "ref"))
    got = _run(model_dir, world, interleave, fp8, str(tmp_path / "dcp"))
    assert got["tokens"] == ref["tokens"]
    assert set(got["logits"]) == set(ref["logits"])
    diff = max(float((torch.tensor(got["logits"][k]) - torch.tensor(ref["logits"][k])).abs().max())
               for k in ref["logits"])
    assert diff <= 1e-5, diff
    assert ref["cached"] == got["cached"] == 32   # two whole logical blocks of the shared 33-token prefix
