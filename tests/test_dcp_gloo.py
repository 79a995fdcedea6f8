"""DCP decode across real processes (gloo, CPU, fp32): each rank holds its shard of a paged latent
cache written with the DCP slot mapping, attends over it, and the LSE combine over the DCP group
equals single-process attention over the full cache. Also: the comm helpers, and a dead peer."""

from __future__ import annotations

import json
import os
import time

import pytest
import torch

from longflash.attention import ops
from longflash.distributed import comm
from longflash.distributed.dcp import dcp_decode_combine_group, dcp_mla_decode, dcp_slot_mapping, \
    mla_decode_attention_local
from longflash.distributed.launch import run_ranks

BS, R_LAT, ROPE, H = 4, 8, 2, 4
# (seq_lens, q_lens): many blocks, multi-token causal queries, contexts shorter than dcp (empty shards),
# long enough that the local attention walks several pieces.
BATCHES = [([37, 1, 3], [1, 1, 1]), ([20, 9], [4, 2]), ([2], [2]), ([130, 5], [1, 3])]


def _case(seed, seq_lens, q_lens, dcp, dcp_rank, interleave, fp8):
    """Same random data on every rank; returns (q, reference out/lse, this rank's cache, table)."""
    g = torch.Generator().manual_seed(seed)
    W = R_LAT + ROPE
    cache_dtype = ops.FP8_DTYPE if fp8 else torch.float32
    k_scale = 0.05 if fp8 else None
    qsl = [0]
    for n in q_lens:
        qsl.append(qsl[-1] + n)
    q = torch.randn(qsl[-1], H, W, generator=g)
    rows = [torch.randn(L, W, generator=g) for L in seq_lens]
    # single-process reference cache (dcp 1)
    nfull = [-(-L // BS) for L in seq_lens]
    full_table = torch.full((len(seq_lens), max(nfull)), -1, dtype=torch.int32)
    perm = torch.randperm(sum(nfull), generator=g).to(torch.int32)
    full = torch.zeros(sum(nfull), BS, W, dtype=cache_dtype)
    # sharded cache: logical blocks of BS * dcp tokens, same ids on every rank
    nvirt = [-(-L // (BS * dcp)) for L in seq_lens]
    table = torch.full((len(seq_lens), max(nvirt)), -1, dtype=torch.int32)
    vperm = torch.randperm(sum(nvirt) + 2, generator=g).to(torch.int32)
    local = torch.zeros(sum(nvirt) + 2, BS, W, dtype=cache_dtype)
    o0 = v0 = 0
    for b, L in enumerate(seq_lens):
        full_table[b, :nfull[b]] = perm[o0:o0 + nfull[b]]
        table[b, :nvirt[b]] = vperm[v0:v0 + nvirt[b]]
        o0, v0 = o0 + nfull[b], v0 + nvirt[b]
        pos = torch.arange(L)
        ops.concat_and_cache_mla(rows[b][:, :R_LAT], rows[b][:, R_LAT:], full,
                                 dcp_slot_mapping(pos, full_table[b], BS, 1, 0), k_scale)
        ops.concat_and_cache_mla(rows[b][:, :R_LAT], rows[b][:, R_LAT:], local,
                                 dcp_slot_mapping(pos, table[b], BS, dcp, dcp_rank, interleave), k_scale)
    ref = ops.mla_decode_attention(q, full, full_table, qsl, seq_lens, 0.3, R_LAT, k_scale, max_rows_per_piece=16)
    return q, ref, local, table, qsl, k_scale


def _dcp_worker(rank, world, port, tp, dcp, out_dir):
    comm.init_distributed(rank, world, port, timeout_s=30)
    ps = comm.initialize_model_parallel(tp, dcp)
    res = {"dcp_ranks": ps.dcp.ranks, "diffs": [], "empty_shard_seen": False}
    # collectives
    x = torch.tensor([float(rank)])
    res["all_gather"] = ps.tp.all_gather(x).tolist()
    res["all_reduce"] = ps.tp.all_reduce(torch.ones(2)).tolist()
    res["reduce_scatter"] = ps.tp.reduce_scatter(torch.arange(2.0 * world)).tolist()
    res["bcast"] = ps.tp.broadcast_object({"step": 7, "rank": rank} if rank == 0 else None)
    for bi, (seq_lens, q_lens) in enumerate(BATCHES):
        for interleave in (1, 2, BS):
            for fp8 in (False, True):
                seed = 1000 * bi + 10 * interleave + fp8
                q, (ref_o, ref_l), cache, table, qsl, k_scale = _case(seed, seq_lens, q_lens, ps.dcp_size,
                                                                     ps.dcp_rank, interleave, fp8)
                out, lse = dcp_mla_decode(q, cache, table, qsl, seq_lens, 0.3, R_LAT, ps.dcp, interleave, k_scale)
                d = max(float((out - ref_o).abs().max()), float((lse - ref_l).abs().max()))
                # the spec's layout: heads reduce-scattered over the DCP group
                o_loc, l_loc = mla_decode_attention_local(q, cache, table, qsl, seq_lens, 0.3, R_LAT,
                                                          ps.dcp_size, ps.dcp_rank, interleave, k_scale)
                res["empty_shard_seen"] |= bool((l_loc == float("-inf")).all(dim=1).any())
                so, sl = dcp_decode_combine_group(o_loc, l_loc, ps.dcp, scatter_heads=True)
                hs = H // ps.dcp_size
                sel = slice(ps.dcp_rank * hs, (ps.dcp_rank + 1) * hs)
                d = max(d, float((so - ref_o[:, sel]).abs().max()), float((sl - ref_l[:, sel]).abs().max()))
                # under TP (the engine's decode): each rank brings its heads, the group's are all-gathered
                go, gl = dcp_mla_decode(q[:, sel].contiguous(), cache, table, qsl, seq_lens, 0.3, R_LAT, ps.dcp,
                                        interleave, k_scale, gather_heads=True)
                d = max(d, float((go - ref_o[:, sel]).abs().max()), float((gl - ref_l[:, sel]).abs().max()))
                res["diffs"].append(d)
    with open(os.path.join(out_dir, f"rank{rank}.json"), "w") as f:
        json.dump(res, f)
    comm.destroy_distributed()


@pytest.mark.parametrize("tp,dcp", [(2, 2), (4, 4), (4, 2)])
def test_dcp_decode_over_gloo_equals_single_process(tmp_path, tp, dcp):
    codes = run_ranks(_dcp_worker, tp, (tp, dcp, str(tmp_path)), timeout_s=80)
    assert codes == [0] * tp
    res = [json.load(open(tmp_path / f"rank{r}.json")) for r in range(tp)]
    for r, x in enumerate(res):
        assert x["dcp_ranks"] == list(range(r // dcp * dcp, r // dcp * dcp + dcp))
        assert x["all_gather"] == [float(i) for i in range(tp)]
        assert x["all_reduce"] == [float(tp)] * 2
        assert x["reduce_scatter"] == [tp * (2.0 * r + i) for i in range(2)]
        assert x["bcast"] == {"step": 7, "rank": 0}
        assert len(x["diffs"]) == len(BATCHES) * 6
        assert max(x["diffs"]) <= 1e-5, x["diffs"]
    assert any(x["empty_shard_seen"] for x in res)


def _dead_peer_worker(rank, world, port, out_dir):
    comm.init_distributed(rank, world, port, timeout_s=15)
    ps = comm.initialize_model_parallel(world, world)
    ps.tp.barrier()
    if rank == 1:
        os._exit(3)  # dies without a word
    t0 = time.monotonic()
    try:
        ps.tp.all_reduce(torch.ones(4))
        outcome = "returned"
    except Exception as e:  # noqa: BLE001 — any error is the point
        outcome = f"raised {type(e).__name__}"
    with open(os.path.join(out_dir, "rank0.json"), "w") as f:
        json.dump({"outcome": outcome, "seconds": time.monotonic() - t0}, f)


def test_dead_peer_raises_instead_of_hanging(tmp_path):
    codes = run_ranks(_dead_peer_worker, 2, (str(tmp_path),), timeout_s=60, grace_s=30)
    assert codes[1] == 3
    res = json.load(open(tmp_path / "rank0.json"))
    assert res["outcome"].startswith("raised"), res
    assert res["seconds"] < 30


def test_torchrun_env_and_groups():
    env = {"RANK": "1", "WORLD_SIZE": "4", "MASTER_ADDR": "10.0.0.1", "MASTER_PORT": "29500"}
    assert comm.DistEnv.from_torchrun_env(env) == comm.DistEnv(1, 4, "10.0.0.1", 29500)
    assert comm.DistEnv.from_torchrun_env({}) is None
    with pytest.raises(ValueError):
        comm.DistEnv.from_torchrun_env({"RANK": "0", "WORLD_SIZE": "2"})
    with pytest.raises(ValueError):
        comm.DistEnv.from_torchrun_env(dict(env, RANK="4"))
    assert comm.dcp_group_ranks(4, 2) == [[0, 1], [2, 3]]
    assert comm.dcp_group_ranks(4, 4) == [[0, 1, 2, 3]]
    with pytest.raises(ValueError):
        comm.dcp_group_ranks(4, 3)
    ps = comm.single_process_state()
    x = torch.randn(3, 4)
    assert ps.tp.all_reduce(x) is x and ps.dcp.all_gather(x) is x and ps.dcp.reduce_scatter(x, 1) is x
    assert ps.tp.broadcast_object({"a": 1}) == {"a": 1}
    with pytest.raises(ValueError):
        comm.init_distributed(rank=0)
