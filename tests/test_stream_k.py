"""The stream-K split of MLA decode attention (``attention/stream_k.py``).

CPU: the schedule covers every tile of every unit exactly once, in whole-tile runs of at most ``tpp`` per
program, its slots are distinct and below P + U, and each unit's slots are the consecutive range the merge
derives (``first_u + u .. last_u + u``); partials computed per segment with PyTorch and merged by the
reference merge equal the reference attention (causal multi-token queries, DCP-style visible lengths, empty
requests and head-groups, more programs than tiles); the Triton merge under the interpreter equals the
reference merge (−inf and +inf LSEs, rows that see nothing); the choice picks stream-K only where it models
faster (B64 x 128K, not B1 x 4K). The sm_90 stage 1 itself: ``test_gluon_mla_decode_wgmma.py`` (GPU).
"""

import random

import pytest
import torch

from interpreter_run import run_interpreted


def _check_schedule(tiles, P):
    from longflash.attention.stream_k import stream_k_segments
    import triton
    segs = stream_k_segments(tiles, P)
    U, total = len(tiles), sum(tiles)
    tpp = triton.cdiv(total, P)
    seen = [[0] * n for n in tiles]
    for p, u, a, b, slot in segs:
        assert 0 <= a < b <= tiles[u] and slot == p + u < P + U
        for t in range(a, b):
            seen[u][t] += 1
    assert all(c == 1 for row in seen for c in row), (tiles, P)
    assert len({s[4] for s in segs}) == len(segs)
    for p in range(P):  # whole-tile runs of at most tpp tiles
        assert sum(b - a for q, _, a, b, _ in segs if q == p) <= tpp
    start = 0
    for u, n in enumerate(tiles):  # the merge's slot range per unit
        slots = [s[4] for s in segs if s[1] == u]
        if n:
            assert slots == list(range(start // tpp + u, (start + n - 1) // tpp + u + 1)), (tiles, P, u)
        else:
            assert slots == []
        start += n


def test_schedule_covers_every_tile_once():
    rng = random.Random(0)
    _check_schedule([2048] * 64, 264)  # B64 x 128K on an H200
    _check_schedule([5, 0, 0, 7, 1], 3)
    _check_schedule([0, 0], 4)
    _check_schedule([3, 1], 264)  # more programs than tiles
    for _ in range(200):
        tiles = [rng.choice([0, 1, 2, 5, 17, 64]) for _ in range(rng.randint(1, 12))]
        _check_schedule(tiles, rng.randint(1, 40))
    with pytest.raises(ValueError):
        _check_schedule([1], 0)


def _segment_partials(q, kv, qsl, seq, vis, H, G, P, scale):
    """Stage 1's outputs computed with PyTorch: each segment's rows [64 a, min(64 b, kv_len)) against its
    head-group's query rows -> partials [P + U, 16, R] and LSEs [P + U, 16] (+inf in unwritten slots)."""
    from longflash.attention.stream_k import stream_k_segments, unit_tiles
    q_lens = [qsl[b + 1] - qsl[b] for b in range(len(seq))]
    R = 512 if kv.shape[-1] == 576 else kv.shape[-1] - 16
    U = len(seq) * G
    part = torch.full((P + U, 16, R), float("nan"))
    plse = torch.full((P + U, 16), float("inf"))  # never read: the merge treats +inf as -inf anyway
    for p, u, a, b, slot in stream_k_segments(unit_tiles(q_lens, seq, H, G), P):
        req, g = divmod(u, G)
        lo, hi = 64 * a, min(64 * b, seq[req])
        for r in range(16):
            mq = 16 * g + r
            if mq >= q_lens[req] * H:
                continue
            t, h = qsl[req] + mq // H, mq % H
            rows = torch.arange(lo, hi)
            s = (kv[req, lo:hi] @ q[t, h]) * scale
            s = torch.where(rows < vis[t], s, float("-inf"))
            m = s.max() if len(s) else torch.tensor(float("-inf"))
            if m == float("-inf"):
                part[slot, r] = 0.0
                plse[slot, r] = float("-inf")
                continue
            w = torch.exp(s - m)
            part[slot, r] = (w[:, None] * kv[req, lo:hi, :R]).sum(0) / w.sum()
            plse[slot, r] = torch.log(w.sum()) + m
    return part, plse


@pytest.mark.parametrize("H,q_lens,seq,P,dcp", [
    (16, [1, 1, 1, 1], [700, 0, 64, 129], 5, False),
    (8, [2, 1, 3], [300, 5, 77], 7, False),     # two head-groups for 3 tokens x 8 heads, causal among them
    (4, [1, 2], [1000, 3], 264, False),          # more programs than tiles
    (16, [1, 1, 1], [400, 90, 0], 3, True),      # DCP-local visible lengths (some rows see nothing)
])
def test_segments_merged_equal_attention(H, q_lens, seq, P, dcp):
    """Partials of the stream-K segments merged by the reference merge = attention over the whole request."""
    from longflash.attention.stream_k import merge_stream_k_reference
    import triton
    torch.manual_seed(0)
    R, W = 32, 48
    B, T = len(seq), sum(q_lens)
    qsl = [0]
    for n in q_lens:
        qsl.append(qsl[-1] + n)
    G = triton.cdiv(max(q_lens) * H, 16)
    q = torch.randn(T, H, W, dtype=torch.float64)
    kv = torch.randn(B, max(seq + [1]), W, dtype=torch.float64)
    vis = []
    for b in range(B):
        for j in range(q_lens[b]):
            vis.append(torch.randint(0, seq[b] + 1, ()).item() if dcp else seq[b] - q_lens[b] + j + 1)
    scale = W ** -0.5
    part, plse = _segment_partials(q, kv, qsl, seq, vis, H, G, P, scale)
    out, lse = merge_stream_k_reference(part, plse, q_lens, seq, H, G, P)
    for b in range(B):
        for j in range(q_lens[b]):
            t = qsl[b] + j
            for h in range(H):
                n = vis[t]
                if n <= 0:
                    assert lse[t, h] == float("-inf") and bool((out[t, h] == 0).all())
                    continue
                s = (kv[b, :n] @ q[t, h]) * scale
                ref = torch.softmax(s, 0) @ kv[b, :n, :R]
                assert torch.allclose(out[t, h].double(), ref, atol=1e-5), (b, j, h)
                assert abs(lse[t, h].item() - torch.logsumexp(s, 0).item()) < 1e-4


_MERGE_SCRIPT = r"""
import json, random, torch, triton
from longflash.attention.stream_k import merge_stream_k, merge_stream_k_reference, unit_tiles, stream_k_segments
res = {}
rng = random.Random(1)
torch.manual_seed(1)
cases = [(16, [1, 1, 1, 1, 1], [4100, 0, 1, 777, 64], 7, 512), (8, [2, 1, 3], [300, 5, 77], 11, 64),
         (4, [1, 2], [1000, 3], 40, 32), (16, [1], [20000], 70, 64)]
for i, (H, q_lens, seq, P, R) in enumerate(cases):
    G = triton.cdiv(max(q_lens) * H, 16)
    U = len(seq) * G
    part = torch.randn(P + U, 16, R)
    plse = torch.randn(P + U, 16) * 4
    plse[torch.rand(P + U, 16) < 0.2] = float("-inf")  # segments some rows see nothing of
    plse[0, 3] = float("inf")
    qsl = torch.tensor([0] + [sum(q_lens[:b + 1]) for b in range(len(q_lens))], dtype=torch.int32)
    kvl = torch.tensor(seq, dtype=torch.int32)
    T = sum(q_lens)
    out = torch.full((T, H, R), 7.0)
    lse = torch.full((T, H), 7.0)
    merge_stream_k(part, plse, out, lse, qsl, kvl, H, G, P)
    ro, rl = merge_stream_k_reference(part, plse, q_lens, seq, H, G, P)
    empty = rl.isinf()
    res[f"case{i}"] = dict(inf_match=bool(torch.equal(lse.isinf(), empty)), empty_zero=bool((out[empty] == 0).all()),
                           out_err=float((out - ro).abs().max()), lse_err=float((lse[~empty] - rl[~empty]).abs().max()),
                           n_empty=int(empty.sum()), n_slots_max=max(
                               sum(1 for s in stream_k_segments(unit_tiles(q_lens, seq, H, G), P) if s[1] == u)
                               for u in range(U)))
print("RESULT" + json.dumps(res))
"""


def test_merge_kernel_equals_reference_interpreted():
    """The Triton merge (interpreter) = the PyTorch reference merge, including a unit spread over 70 slots
    (more than one 16-slot block) and rows that see nothing."""
    res = run_interpreted(_MERGE_SCRIPT)
    assert len(res) == 4
    for name, r in res.items():
        assert r["inf_match"] and r["empty_zero"], (name, r)
        assert r["out_err"] < 1e-5 and r["lse_err"] < 1e-5, (name, r)
    assert res["case0"]["n_empty"] >= 16  # the 0-length request (and rows whose only segments are -inf)
    assert res["case3"]["n_slots_max"] > 16


def test_choose_stream_k():
    """Stream-K where the per-request split leaves SMs idle for long calls (an H200's 264 slots), not for
    short ones or empty calls; its time model counts a second segment's start per program."""
    from longflash.attention import triton_mla_decode as tk
    from longflash.attention.stream_k import stream_k_time
    assert tk.choose_stream_k(64, 1, 131072, 16, 512, 576, 576, 264)
    assert not tk.choose_stream_k(1, 1, 4096, 16, 512, 576, 576, 264)
    assert not tk.choose_stream_k(0, 1, 4096, 16, 512, 576, 576, 264)
    assert not tk.choose_stream_k(64, 1, 0, 16, 512, 576, 576, 264)
    # 2048 tiles per request x 64 on 264 slots: 497 per program (+1) against 512 for 4 splits
    t_sk = stream_k_time(64, 1, 131072, 16, 512, 576, 576, 264)
    t_split = tk.split_time(64, 1, 131072, 16, 512, 576, 576, 264, 4)
    assert 0.96 < t_sk / t_split < 0.98
