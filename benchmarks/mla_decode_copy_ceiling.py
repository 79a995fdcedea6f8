"""The memory-pipeline ceiling of the Gluon fp8 decode kernel: its cache-tile copies alone.

    python3 benchmarks/mla_decode_copy_ceiling.py --out DIR        # GPU (sm_89+)

A Gluon kernel with the decode stage 1's grid, split rule, block-table walk, ``cp.async`` layouts, swizzled
``[STAGES, BLOCK_N, 512 | 64]`` buffers and per-tile wait + barrier (``attention/gluon_mla_decode.py``), but no
arithmetic: each tile is copied into shared memory and dropped. A padding buffer gives it the real kernel's
occupancy (two programs per SM; the decode kernel has 92 KB), so both spread over the SMs alike. If this runs at
the copy bandwidth, the real kernel's gap to it is its arithmetic; if it runs at the real kernel's speed,
the copy pipeline itself (tiles in flight per SM) is the limit. Reports both, at batch 16 and 64 x 32K and
128K (fp8 cache, 16 heads, block size 16), with the copy bandwidth measured in the same run.
Writes ``mla_decode_copy_ceiling.json`` / ``.md``.
"""
from __future__ import annotations

import argparse
import json
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import provenance  # noqa: E402

from triton.experimental import gluon  # noqa: E402
from triton.experimental.gluon import language as gl  # noqa: E402
from triton.experimental.gluon.language.nvidia.ampere import async_copy  # noqa: E402

from longflash.attention import gluon_mla_decode as g  # noqa: E402


@gluon.jit
def _copy_only_kernel(cache_ptr, bt_ptr, kvlen_ptr, out_ptr, stride_bt, num_splits, BLOCK_N: gl.constexpr,
                      BLOCK_SIZE: gl.constexpr, STAGES: gl.constexpr, PAD_WORDS: gl.constexpr):
    """Grid (kv-split, request): the decode stage 1's tile copies of rows [lo, hi) of request b, 4 warps."""
    CPN: gl.constexpr = gl.BlockedLayout([1, 16], [2, 16], [4, 1], [1, 0])
    CPP: gl.constexpr = gl.BlockedLayout([1, 16], [8, 4], [4, 1], [1, 0])
    KN_SH: gl.constexpr = g._swizzled_tile_layout(BLOCK_N, 512)
    KP_SH: gl.constexpr = g._swizzled_tile_layout(BLOCK_N, 64)
    PAD_L: gl.constexpr = gl.BlockedLayout([1], [32], [4], [0])
    pid_s = gl.program_id(0)
    b = gl.program_id(1)
    kv_len = gl.load(kvlen_ptr + b)
    chunk = gl.cdiv(gl.cdiv(kv_len, num_splits), BLOCK_N) * BLOCK_N
    lo = pid_s * chunk
    hi = gl.minimum(lo + chunk, kv_len)
    num_tiles = gl.cdiv(hi - lo, BLOCK_N)
    bt_row = bt_ptr + b.to(gl.int64) * stride_bt
    kn_smem = gl.allocate_shared_memory(gl.uint8, [STAGES, BLOCK_N, 512], KN_SH)
    kp_smem = gl.allocate_shared_memory(gl.uint8, [STAGES, BLOCK_N, 64], KP_SH)
    pad = gl.allocate_shared_memory(gl.float32, [PAD_WORDS], gl.SwizzledSharedLayout(1, 1, 1, [0]))
    pad.store(gl.zeros([PAD_WORDS], gl.float32, layout=PAD_L))  # keeps the padding (occupancy) allocated
    BTN: gl.constexpr = gl.SliceLayout(1, CPN)
    BTP: gl.constexpr = gl.SliceLayout(1, CPP)
    for st in gl.static_range(STAGES - 1):
        s0 = lo + st * BLOCK_N
        g._copy_rows(kn_smem.index(st), cache_ptr, g._block_ids(bt_row, s0, hi, BLOCK_N, BLOCK_SIZE, BTN), s0, hi,
                     0, 512, BLOCK_N, BLOCK_SIZE, CPN)
        g._copy_rows(kp_smem.index(st), cache_ptr, g._block_ids(bt_row, s0, hi, BLOCK_N, BLOCK_SIZE, BTP), s0, hi,
                     512, 64, BLOCK_N, BLOCK_SIZE, CPP)
        async_copy.commit_group()
    start_next = lo + (STAGES - 1) * BLOCK_N
    blk_n = g._block_ids(bt_row, start_next, hi, BLOCK_N, BLOCK_SIZE, BTN)
    blk_p = g._block_ids(bt_row, start_next, hi, BLOCK_N, BLOCK_SIZE, BTP)
    for i in range(0, num_tiles):
        async_copy.wait_group(STAGES - 2)
        gl.thread_barrier()
        nxt = (i + STAGES - 1) % STAGES
        g._copy_rows(kn_smem.index(nxt), cache_ptr, blk_n, start_next, hi, 0, 512, BLOCK_N, BLOCK_SIZE, CPN)
        g._copy_rows(kp_smem.index(nxt), cache_ptr, blk_p, start_next, hi, 512, 64, BLOCK_N, BLOCK_SIZE, CPP)
        async_copy.commit_group()
        start_next = start_next + BLOCK_N
        blk_n = g._block_ids(bt_row, start_next, hi, BLOCK_N, BLOCK_SIZE, BTN)
        blk_p = g._block_ids(bt_row, start_next, hi, BLOCK_N, BLOCK_SIZE, BTP)
    async_copy.wait_group(0)
    gl.thread_barrier()
    first = kn_smem.index(0).load(CPN)  # one read of the last buffer so the copies have a consumer
    gl.store(out_ptr + b * num_splits + pid_s, gl.sum(gl.sum(first.to(gl.int32), axis=1), axis=0) + pad.load(PAD_L).sum(0).to(gl.int32))


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0], allow_abbrev=False)
    ap.add_argument("--out", required=True)
    args = ap.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("needs a CUDA GPU of compute capability >= 8.9")
    from longflash.attention import triton_mla_decode as tk
    from longflash.ops.cuda_timing import graph_seconds
    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    from gpu_timing import copy_gbps
    dev = torch.device("cuda")
    os.makedirs(args.out, exist_ok=True)
    # the eager copy ceiling (gpu_timing.copy_gbps; a copy_ captured in a CUDA graph read 2.71 TB/s here)
    copy_bw = copy_gbps(dev, 1 << 31, 20) * 1e9
    H, W, R, BS, BLOCK_N = 16, 576, 512, 16, 64
    rows_total = 64 * 131072 + 64 * BS
    cache = torch.empty(rows_total // BS, BS, W, dtype=torch.uint8, device=dev).random_(0, 120)
    perm = torch.randperm(cache.shape[0], device=dev).to(torch.int32)
    res = {"commit": provenance.commit(), "device": torch.cuda.get_device_name(dev), "copy_bw": copy_bw,
           "command": " ".join(["python3"] + sys.argv), "rows": []}
    for B, L in ((16, 32768), (16, 131072), (64, 32768), (64, 131072)):
        nblk = L // BS
        bt = perm[:B * nblk].view(B, nblk).contiguous()
        seq = torch.full((B,), L, dtype=torch.int32, device=dev)
        qsl = torch.arange(B + 1, dtype=torch.int32, device=dev)
        q = (torch.randn(B, H, W, device=dev) * 0.5).to(torch.bfloat16)
        S = tk.choose_num_splits(B, 1, L, H, R, W, W, tk.sm_count(dev) * 2)
        out = torch.empty(B * S, dtype=torch.int32, device=dev)
        nbytes = B * L * W
        row = {"B": B, "ctx": L, "splits": S, "bytes": nbytes}
        for stages in (2, 3):
            # a padding of fp32 words (a power of two) so that 3 programs do not fit an SM and 2 do, as for the
            # decode kernel (92 KB): 2 stages 74 + 4 KB, 3 stages 111 KB + 512 bytes
            pad = 1024 if stages == 2 else 128

            def copy_only(stages=stages, pad=pad):
                _copy_only_kernel[(S, B)](cache, bt, seq, out, bt.stride(0), S, BLOCK_N=BLOCK_N, BLOCK_SIZE=BS,
                                          STAGES=stages, PAD_WORDS=pad, num_warps=4)
            t = graph_seconds(copy_only, 2, 5)
            row[f"copy_only_s{stages}_us"] = t * 1e6
            row[f"copy_only_s{stages}_frac"] = nbytes / t / copy_bw
        f8 = cache.view(torch.float8_e4m3fn)
        t = graph_seconds(lambda: tk.mla_decode_attention(q, f8, bt, qsl, seq, 0.07, R, 0.05, max_query_len=1,
                                                          max_seq_len=L), 2, 5)
        row.update(kernel_us=t * 1e6, kernel_frac=nbytes / t / copy_bw)
        res["rows"].append(row)
        print(row, flush=True)
    copy_bw = res["copy_bw"] = max(copy_bw, copy_gbps(dev, 1 << 31, 20) * 1e9)  # again after the kernels: the larger
    for row in res["rows"]:
        for k in [k for k in row if k.endswith("_us")]:
            row[k.replace("_us", "_frac")] = row["bytes"] / (row[k] * 1e-6) / copy_bw
    lines = [f"# Copy ceiling of the Gluon fp8 decode tile ({res['device']})", "",
             f"commit {res['commit'][:12]}; copy bandwidth {copy_bw / 1e12:.3f} TB/s; `{res['command']}`", "",
             "| B | ctx | splits | copies only, 2 stages: us (/ copy) | 3 stages: us (/ copy) | decode kernel: us (/ copy) |",
             "|---|---|---|---|---|---|"]
    for r in res["rows"]:
        s3 = f"{r['copy_only_s3_us']:.1f} ({r['copy_only_s3_frac']:.3f})"
        lines.append(f"| {r['B']} | {r['ctx']} | {r['splits']} | {r['copy_only_s2_us']:.1f} ({r['copy_only_s2_frac']:.3f}) | "
                     f"{s3} | {r['kernel_us']:.1f} ({r['kernel_frac']:.3f}) |")
    md = "\n".join(lines) + "\n"
    with open(os.path.join(args.out, "mla_decode_copy_ceiling.json"), "w") as f:
        json.dump(res, f, indent=1)
    with open(os.path.join(args.out, "mla_decode_copy_ceiling.md"), "w") as f:
        f.write(md)
    print(md)
    return 0


if __name__ == "__main__":
    sys.exit(main())
