"""DCP formulas (hand-computed tables from the spec) and the LSE combine, in one process."""

from __future__ import annotations

import math

import pytest
import torch

from longflash.attention import ops
from longflash.distributed.dcp import (dcp_combine, dcp_gathered_rows, dcp_local_seq_lens, dcp_local_to_global, dcp_owner, dcp_padded_local_len,
                                       dcp_slot_mapping, mla_decode_attention_local)

NEG = -1  # readability of the tables

# block_size 4, dcp 2, block_table [7, 3] (a virtual block covers 8 positions), positions 0..15.
# Computed by hand from: owner (p // I) % 2; vo = p % 8; local = (vo // (2I))*I + vo % I; slot = blk*4 + local.
SLOTS_I1 = {
    0: [28, NEG, 29, NEG, 30, NEG, 31, NEG, 12, NEG, 13, NEG, 14, NEG, 15, NEG],
    1: [NEG, 28, NEG, 29, NEG, 30, NEG, 31, NEG, 12, NEG, 13, NEG, 14, NEG, 15],
}
SLOTS_I2 = {
    0: [28, 29, NEG, NEG, 30, 31, NEG, NEG, 12, 13, NEG, NEG, 14, 15, NEG, NEG],
    1: [NEG, NEG, 28, 29, NEG, NEG, 30, 31, NEG, NEG, 12, 13, NEG, NEG, 14, 15],
}
# Local lengths for L = 0, 1, 2, 3, 5, 9 (dcp 2): counted by hand from the owner sequence.
LENS_I1 = [[0, 0], [1, 0], [1, 1], [2, 1], [3, 2], [5, 4]]
LENS_I2 = [[0, 0], [1, 0], [2, 0], [2, 1], [3, 2], [5, 4]]


@pytest.mark.parametrize("interleave,table", [(1, SLOTS_I1), (2, SLOTS_I2)])
def test_slot_mapping_hand_table(interleave, table):
    for rank in (0, 1):
        got = dcp_slot_mapping(torch.arange(16), torch.tensor([7, 3]), 4, 2, rank, interleave)
        assert got.tolist() == table[rank]


@pytest.mark.parametrize("interleave,table", [(1, LENS_I1), (2, LENS_I2)])
def test_local_lengths_hand_table(interleave, table):
    assert dcp_local_seq_lens([0, 1, 2, 3, 5, 9], 2, interleave).tolist() == table


def test_owner_and_batched_slot_mapping():
    assert dcp_owner(torch.arange(8), 2, 2).tolist() == [0, 0, 1, 1, 0, 0, 1, 1]
    # two requests in one call: request 1 uses row 1 of the block table
    bt = torch.tensor([[7, 3], [5, -1]])
    pos = torch.tensor([9, 0, 1])
    req = torch.tensor([0, 1, 1])
    assert dcp_slot_mapping(pos, bt, 4, 2, 1, 1, token_to_req=req).tolist() == [12, -1, 20]
    with pytest.raises(ValueError):
        dcp_slot_mapping(torch.tensor([8]), bt[1], 4, 2, 0, 1)  # owned here, block -1
    with pytest.raises(ValueError):
        dcp_slot_mapping(torch.tensor([16]), bt[0], 4, 2, 0, 1)  # beyond the table
    with pytest.raises(ValueError):
        dcp_slot_mapping(torch.arange(4), bt[0], 4, 2, 0, 3)  # interleave must divide block_size


@pytest.mark.parametrize("dcp,interleave,bs", [(2, 1, 4), (2, 2, 4), (4, 1, 4), (4, 4, 4), (3, 2, 8)])
def test_layout_is_a_dense_bijection(dcp, interleave, bs):
    """For every L: rank r's slots are exactly local rows [0, local_len) of its pages, the local
    lengths count the owned positions, and dcp_local_to_global inverts the slot formula."""
    nblk = 6
    bt = torch.tensor([2, 5, 0, 4, 1, 3])
    L = nblk * bs * dcp
    pos = torch.arange(L)
    owner = dcp_owner(pos, dcp, interleave)
    lens = dcp_local_seq_lens(torch.arange(L + 1), dcp, interleave)
    for r in range(dcp):
        slots = dcp_slot_mapping(pos, bt, bs, dcp, r, interleave)
        assert ((slots >= 0) == (owner == r)).all()
        mine = slots[slots >= 0]
        local_idx = bt.argsort()[mine // bs] * bs + mine % bs   # physical block -> logical index
        assert local_idx.tolist() == list(range(mine.numel()))
        assert dcp_local_to_global(local_idx, dcp, r, interleave).tolist() == pos[owner == r].tolist()
        assert lens[:, r].tolist() == [int((owner[:n] == r).sum()) for n in range(L + 1)]


def test_padded_local_len_and_gathered_rows():
    """Prefill context under DCP: every rank gathers cdiv(L, dcp*I)*I rows (at least the largest local
    length, less than I more), and the rows past a rank's true length are left out."""
    for L in range(0, 40):
        for dcp, interleave in ((2, 1), (4, 1), (4, 2), (2, 4)):
            p = dcp_padded_local_len(L, dcp, interleave)
            true = dcp_local_seq_lens([L], dcp, interleave)[0]
            assert int(true.max()) <= p < int(true.max()) + interleave and p % interleave == 0
    # L = 5, dcp 2, I 1: ranks hold 3 and 2 rows. One segment [0, 3) at offset 0 of a 3-row workspace:
    assert dcp_gathered_rows(0, 3, 0, [3, 2], 3).tolist() == [0, 1, 2, 3, 4]
    # a segment of local rows [2, 3) at offset 1 of a 2-row workspace: only rank 0 has a row 2
    assert dcp_gathered_rows(2, 1, 1, [3, 2], 2).tolist() == [1]
    assert dcp_gathered_rows(0, 2, 0, [1, 0, 0, 0], 2).tolist() == [0]     # context shorter than dcp


def test_combine_hand_values():
    outs = torch.tensor([[[[1.0, 0.0]]], [[[0.0, 2.0]]]])          # [R=2, T=1, H=1, D=2]
    lses = torch.tensor([[[0.0]], [[math.log(3.0)]]])                # weights 1/4, 3/4
    out, lse = dcp_combine(outs, lses)
    assert torch.allclose(out, torch.tensor([[[0.25, 1.5]]]))
    assert torch.allclose(lse, torch.tensor([[math.log(4.0)]]))


def test_combine_empty_shards():
    outs = torch.tensor([[[[float("nan"), 5.0]]], [[[3.0, -1.0]]], [[[7.0, 7.0]]]])
    lses = torch.tensor([[[float("-inf")]], [[1.5]], [[float("inf")]]])  # +inf counts as empty
    out, lse = dcp_combine(outs, lses)
    assert out.tolist() == [[[3.0, -1.0]]]                           # exactly the one live shard
    assert lse.tolist() == [[1.5]]
    out, lse = dcp_combine(outs[:1], lses[:1])
    assert out.tolist() == [[[0.0, 0.0]]] and lse.tolist() == [[float("-inf")]]


def _sharded_caches(rows, block_table, bs, dcp, interleave, cache_dtype, k_scale, num_blocks):
    caches = []
    for r in range(dcp):
        c = torch.zeros(num_blocks, bs, rows.shape[1], dtype=cache_dtype)
        slots = dcp_slot_mapping(torch.arange(rows.shape[0]), block_table, bs, dcp, r, interleave)
        ops.concat_and_cache_mla(rows[:, :-2], rows[:, -2:], c, slots, k_scale)
        caches.append(c)
    return caches


@pytest.mark.parametrize("dcp,interleave", [(2, 1), (2, 2), (4, 1), (4, 4)])
@pytest.mark.parametrize("fp8", [False, True])
@pytest.mark.parametrize("L,q_len", [(37, 1), (37, 5), (1, 1), (3, 3), (2, 1)])
def test_simulated_ranks_equal_full_attention(dcp, interleave, fp8, L, q_len):
    """Ranks simulated in a loop: shard, attend locally (causal multi-token queries too), combine."""
    g = torch.Generator().manual_seed(L * 31 + q_len + dcp)
    bs, R, H, W = 4, 8, 3, 10
    cache_dtype = ops.FP8_DTYPE if fp8 else torch.float32
    k_scale = 0.05 if fp8 else None
    rows = torch.randn(L, W, generator=g)
    q = torch.randn(q_len, H, W, generator=g)
    nb_virtual = -(-L // (bs * dcp))
    block_table = torch.randperm(nb_virtual + 3, generator=g)[:nb_virtual].to(torch.int32)
    full_table = torch.randperm(-(-L // bs) + 2, generator=g)[:-(-L // bs)].to(torch.int32)
    full = torch.zeros(int(full_table.max()) + 1, bs, W, dtype=cache_dtype)
    ops.concat_and_cache_mla(rows[:, :R], rows[:, R:], full, dcp_slot_mapping(torch.arange(L), full_table, bs, 1, 0),
                             k_scale)
    ref_o, ref_l = ops.mla_decode_attention(q, full, full_table[None], [0, q_len], [L], 0.3, R, k_scale,
                                            max_rows_per_piece=8)
    caches = _sharded_caches(rows, block_table, bs, dcp, interleave, cache_dtype, k_scale, nb_virtual + 3)
    parts = [mla_decode_attention_local(q, caches[r], block_table[None], [0, q_len], [L], 0.3, R, dcp, r,
                                        interleave, k_scale, max_rows_per_piece=8) for r in range(dcp)]
    out, lse = dcp_combine(torch.stack([p[0] for p in parts]), torch.stack([p[1] for p in parts]))
    assert (out - ref_o).abs().max() <= 1e-5
    assert (lse - ref_l).abs().max() <= 1e-5
    if L < dcp:  # some rank holds nothing: its lse is -inf
        assert any(bool((p[1] == float("-inf")).all()) for p in parts)


@pytest.mark.parametrize("kw,msg", [({"tensor_parallel_size": 0}, "tensor_parallel_size must be >= 1, got 0"),
                                    ({"decode_context_parallel_size": -2}, "decode_context_parallel_size must be >= 1"),
                                    ({"tensor_parallel_size": "2"}, "tensor_parallel_size must be an int, got '2'"),
                                    ({"tensor_parallel_size": 2.0}, "tensor_parallel_size must be an int"),
                                    ({"cp_kv_cache_interleave_size": True}, "cp_kv_cache_interleave_size must be an int"),
                                    ({"tensor_parallel_size": 2, "decode_context_parallel_size": 3},
                                     r"decode_context_parallel_size \(3\) must divide tensor_parallel_size \(2\)")])
def test_parallel_sizes_are_validated_naming_the_field(kw, msg):
    from longflash.config import EngineConfig
    with pytest.raises(ValueError, match=msg):
        EngineConfig(model="unused", device="cpu", **kw)
    assert EngineConfig(model="unused", device="cpu", tensor_parallel_size=torch.tensor(1).numpy()[()]).tensor_parallel_size == 1
