"""A DeepSeek-V3-style MoE sub-layer for one token in three Triton launches (router, noaux_tc top-k routing,
the chosen routed experts and the shared experts, SiLU gating, weighted combine); reference
:func:`moe_decode_ref` (same arguments; the tests compare them).

Why: at batch 1 a decode step is bound by dependent launches, ~0.7-1.5 µs each (``benchmarks/NOTES.md``,
sessions 22-26), and the engine's MoE sub-layer is 12 of them (fp32 router GEMM, routing, alignment, two
grouped GEMMs, two activations, the shared experts' gate/up and down GEMVs, combine); at the benchmark
model's shapes (hidden 2048, 64 experts top-6, I 256, two shared experts) one token reads ~25.7 MB of
weights, ~6 µs at the H200's copy rate. The work (``PHASE`` of the one kernel):

0. router partial logits (each program a 64-wide slice of the hidden dim for all experts: fp32 partials,
   summed in a fixed order, so the logits do not depend on the grid) and the shared experts' gate/up rows;
4. the routing: one program of one warp sums the partials and routes (``moe_router_triton.route_scores``:
   the routing kernel's code, same keys and tie rule), and stores each slot's expert and weight;
5. persistent (one program per SM): the chosen experts' weights are prefetched into L2
   (``ops/l2_prefetch.py``); phase 1, their gate/up rows in 8-row blocks spread over the programs; a grid
   barrier (``longflash/ops/grid_sync.py``, ~1 µs); phase 2, every program owns ``down_rows``-row blocks
   of the output: ``y = Σ_s w_s · W2[e_s] · act(g_s) + W2_sh · act(g_sh)``, ``act(g) = silu(gate) · up``,
   each down product in fp32, one rounding at the end.
PHASE 3 is all of it in one persistent launch (every program routes, three barriers); PHASEs 1 and 2 alone
are the barrier-free launches of ``phased``.
Rounding points: the gate/up products and the gated activations are rounded to the weights' dtype, the rest
is fp32 with one final rounding (the engine's grouped path also rounds each expert's down product and the
shared output, so in 16-bit dtypes the two differ by a few ulps). The router logits are summed in another
order than the engine's GEMM, so a near-tie of two experts' choice scores can route differently.
Grid: at most one program per SM, and all of them must be resident at once for the barriers (the launch is
not cooperative: a concurrent kernel holding SMs, e.g. NCCL on another stream or an MPS SM limit, could
keep one waiting and hang the launch). ``phased`` runs each phase as its own launch instead (no barriers),
which is how Triton's CPU interpreter (one program at a time) checks the work split with several programs.
The kernel uses 8 warps (sm_90, with the JIT's divisibility of the sizes: no spills in any PHASE; the routing
launch 1 warp).
Used by ``MoE.forward`` for one bf16/fp16 token on CUDA (``MoE.one_token_weights`` says where), as three
launches (see :func:`moe_decode_triton`). Measured on an H200 (``benchmarks/results/moe_decode.h200.md``,
session 27; CUDA-graph µs per call, one process): 30.0 against 37.9 for the engine's 12 launches (0.20 of the
copy bandwidth); phase 0 4.4, the routing launch 5.3, phases 1-2 18.0 µs of device time; with 16-row down
blocks (the default since session 28) 27.8 µs, phases 1-2 16.0. The single
persistent launch takes 29-31 µs (every program routes there; in phase launches that each routed, the routing
cost ~4-6 µs per phase), and the four phase launches show phase 1 (gate/up, 12.6 MB) at 11.0 µs and phase 2
(down, 6.3 MB + 2 MB shared) at 8.7: neither is near the copy rate, the next thing to fix.
The L2 prefetch saves 5 µs in phases 1-2 of the three launches (23.2 -> 18.0). In the batch-1 decode graph
of ``e2e_decode.py`` the kernel takes 1.965 -> 1.75 ms per step. Session 26's first form (a serial 128-step
sum of the router partials in every program, 8 KB loads) took 38.9 µs.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from longflash.layers.moe import check_routing_args, topk_routing
from longflash.layers.moe_router_triton import _IDX_BITS, route_scores
from longflash.ops.grid_sync import barrier_counter, grid_arrive, grid_reset_if_last, grid_wait
from longflash.ops.l2_prefetch import prefetch_l2
from longflash.ops.triton_env import interpreting, sm_count

ROUTER_SLICE = 64  # hidden dims per router partial: 32 partials at D 2048, summed in one load
BLOCK_K = 2048  # hidden dims per step of the gate/up products: a block's 8 rows x 2048 (32 KB bf16) in one load
NUM_WARPS = 8
ROUTE_CHUNK = 2048  # router partials (fp32) summed per load: 8 per thread at 8 warps (sm_90: 8192 spill)


@triton.jit
def _silu_mul(gate, up, OUT_DT: tl.constexpr):
    """act = silu(gate) * up (fp32 tensors of one shape), rounded to OUT_DT and returned as fp32."""
    return (gate / (1.0 + tl.exp(-gate)) * up).to(OUT_DT).to(tl.float32)


@triton.jit
def _slot_expert(eid, k, slot):
    """The expert id (int64 scalar) in ``slot`` of ``eid`` [TK_P] (``k`` = arange(0, TK_P))."""
    return tl.sum(tl.where(k == slot, eid, 0), axis=0)


@triton.jit
def _rows_step(acc, w_ptr, r, n_rows, x_ptr, D, k0, K_STEP: tl.constexpr):
    k = k0 + tl.arange(0, K_STEP)
    w = tl.load(w_ptr + r[:, None].to(tl.int64) * D + k[None, :], mask=(r < n_rows)[:, None] & (k < D)[None, :],
                other=0.0)
    x = tl.load(x_ptr + k, mask=k < D, other=0.0)
    return acc + w.to(tl.float32) * x.to(tl.float32)[None, :]


@triton.jit
def _rows_times_x(w_ptr, row0, n_rows, x_ptr, D, K_STEP: tl.constexpr, INTERPRET: tl.constexpr):
    """[8] fp32: rows row0 .. row0 + 7 (< n_rows) of a row-major [n_rows, D] weight times x [D]."""
    r = row0 + tl.arange(0, 8)
    acc = tl.zeros([8, K_STEP], tl.float32)
    if INTERPRET:  # a loop bounded by a run-time argument fails in the interpreter; the same loop as a while
        k0 = 0
        while k0 < D:
            acc = _rows_step(acc, w_ptr, r, n_rows, x_ptr, D, k0, K_STEP)
            k0 += K_STEP
    else:
        for k0 in range(0, D, K_STEP):
            acc = _rows_step(acc, w_ptr, r, n_rows, x_ptr, D, k0, K_STEP)
    return tl.sum(acc, axis=1)


@triton.jit
def _route(part_ptr, n_slices, bias_ptr, scale, NS_C: tl.constexpr, E_P: tl.constexpr, N_GROUP: tl.constexpr,
           GROUP_SIZE: tl.constexpr, NG_P: tl.constexpr, GS_P: tl.constexpr, TOP_K: tl.constexpr,
           TOPK_GROUP: tl.constexpr, HAS_BIAS: tl.constexpr, RENORM: tl.constexpr, INTERPRET: tl.constexpr,
           IDX_BITS: tl.constexpr):
    """The token's routing from the router partials ``part`` [n_slices, E_P], loaded NS_C slices at a time
    (one load at the benchmark model's shapes) and summed by ``tl.sum`` within a chunk, chunks in order: a
    fixed order, the same in every program and for every grid. Returns (sel, w, ids) of ``route_scores``
    and the slot of each chosen expert (ascending id), each [NG_P * GS_P]."""
    sl = tl.arange(0, NS_C)[:, None, None]
    g = tl.arange(0, NG_P)[None, :, None]
    j = tl.arange(0, GS_P)[None, None, :]
    valid = (g < N_GROUP) & (j < GROUP_SIZE)
    logits = tl.zeros([NG_P, GS_P], tl.float32)
    c = 0
    while c < n_slices:  # (a while loop: the interpreter cannot run a for loop over run-time bounds)
        part = tl.load(part_ptr + (c + sl) * E_P + g * GROUP_SIZE + j, mask=valid & (c + sl < n_slices), other=0.0)
        logits += tl.sum(part, axis=0)
        c += NS_C
    valid2 = (tl.arange(0, NG_P)[:, None] < N_GROUP) & (tl.arange(0, GS_P)[None, :] < GROUP_SIZE)
    logits = tl.where(valid2, logits, float("-inf"))
    sel, w, ids = route_scores(logits, bias_ptr, scale, N_GROUP, GROUP_SIZE, NG_P, GS_P, TOP_K, TOPK_GROUP, HAS_BIAS,
                               False, RENORM, INTERPRET, IDX_BITS)
    a = sel.to(tl.int32)
    return sel, w, ids, tl.cumsum(a, 0) - a


@triton.jit
def _moe_decode_kernel(x_ptr, rw_ptr, bias_ptr, w13_ptr, w2_ptr, sw13_ptr, sw2_ptr, part_ptr, g_ptr, gs_ptr, y_ptr,
                       bar_ptr, rid_ptr, rwt_ptr, D, I, IS, n_slices, scale,
                       E_P: tl.constexpr, N_GROUP: tl.constexpr, GROUP_SIZE: tl.constexpr, NG_P: tl.constexpr,
                       GS_P: tl.constexpr, TOP_K: tl.constexpr, TOPK_GROUP: tl.constexpr, HAS_BIAS: tl.constexpr,
                       RENORM: tl.constexpr, HAS_SHARED: tl.constexpr, I_P: tl.constexpr, IS_P: tl.constexpr,
                       RK: tl.constexpr, K_STEP: tl.constexpr, NS_C: tl.constexpr, TK_P: tl.constexpr, DOWN_ROWS: tl.constexpr,
                       PREFETCH: tl.constexpr, ELT: tl.constexpr, NUM_WARPS: tl.constexpr,
                       PHASE: tl.constexpr, INTERPRET: tl.constexpr, IDX_BITS: tl.constexpr):
    pid = tl.program_id(0)
    P = tl.num_programs(0)
    DT: tl.constexpr = y_ptr.dtype.element_ty
    before = 0
    if PREFETCH & ((PHASE == 0) | (PHASE == 3)) & HAS_SHARED:  # the shared experts' down rows (phase 2) into L2
        prefetch_l2(sw2_ptr, D * IS * ELT, pid, P, 32 * NUM_WARPS, INTERPRET)
    if (PHASE == 0) | (PHASE == 3):
        # router partial logits: slice s of the hidden dim, all experts (fp32 router weights)
        # (grid-stride while loops: the interpreter cannot run a for loop over run-time bounds)
        ex = tl.arange(0, E_P)
        s = pid
        while s < n_slices:
            k = s * RK + tl.arange(0, RK)
            w = tl.load(rw_ptr + ex[:, None] * D + k[None, :], mask=(ex < N_GROUP * GROUP_SIZE)[:, None] & (k < D)[None, :],
                        other=0.0)
            xv = tl.load(x_ptr + k, mask=k < D, other=0.0).to(tl.float32)
            tl.store(part_ptr + s * E_P + ex, tl.sum(w.to(tl.float32) * xv[None, :], axis=1))
            s += P
        if HAS_SHARED:  # the shared experts' gate/up rows
            b = pid
            while b < tl.cdiv(2 * IS, 8):
                r = b * 8 + tl.arange(0, 8)
                tl.store(gs_ptr + r, _rows_times_x(sw13_ptr, b * 8, 2 * IS, x_ptr, D, K_STEP, INTERPRET).to(DT),
                         mask=r < 2 * IS)
                b += P
        if PHASE == 3:
            before = grid_arrive(bar_ptr)
            grid_wait(bar_ptr, P)
    k = tl.arange(0, TK_P)
    if (PHASE == 3) | (PHASE == 4):  # the routing, from the summed router partials
        sel, wsel, ids, slot = _route(part_ptr, n_slices, bias_ptr, scale, NS_C, E_P, N_GROUP, GROUP_SIZE, NG_P, GS_P, TOP_K,
                                      TOPK_GROUP, HAS_BIAS, RENORM, INTERPRET, IDX_BITS)
        in_slot = sel[None, :] & (slot[None, :] == k[:, None])  # [TK_P, experts]
        eid = tl.sum(tl.where(in_slot, ids[None, :], 0), axis=1).to(tl.int64)  # [TK_P] expert of each slot
        wk = tl.sum(tl.where(in_slot, wsel[None, :], 0.0), axis=1)  # [TK_P] its routing weight (0 past TOP_K)
        if PHASE == 4:  # one program publishes it for the next launch
            tl.store(rid_ptr + k, eid)
            tl.store(rwt_ptr + k, wk)
    if (PHASE == 1) | (PHASE == 2) | (PHASE == 5):  # the routing a PHASE 4 launch stored
        eid = tl.load(rid_ptr + k)
        wk = tl.load(rwt_ptr + k)
    if PREFETCH & ((PHASE == 1) | (PHASE == 3) | (PHASE == 5)):
        # every byte the next phases read, into L2 while this phase computes: the chosen experts' gate/up
        # rows (phase 1), then their down rows (phase 2); the grid splits each range
        for t in tl.static_range(TOP_K):
            prefetch_l2(w13_ptr + _slot_expert(eid, k, t) * (2 * I) * D, 2 * I * D * ELT, pid, P,
                        32 * NUM_WARPS, INTERPRET)
        for t in tl.static_range(TOP_K):
            prefetch_l2(w2_ptr + _slot_expert(eid, k, t) * D * I, D * I * ELT, pid, P,
                        32 * NUM_WARPS, INTERPRET)
    if (PHASE == 1) | (PHASE == 3) | (PHASE == 5):
        # the chosen experts' gate/up rows: TOP_K x 2I rows in blocks of 8, spread over the programs
        blocks = tl.cdiv(2 * I, 8)
        b = pid
        while b < TOP_K * blocks:
            sl = b // blocks
            e = _slot_expert(eid, k, sl)
            r = (b % blocks) * 8 + tl.arange(0, 8)
            v = _rows_times_x(w13_ptr + e * (2 * I) * D, (b % blocks) * 8, 2 * I, x_ptr, D, K_STEP, INTERPRET)
            tl.store(g_ptr + sl * (2 * I) + r, v.to(DT), mask=r < 2 * I)
            b += P
        if PHASE == 3:
            before = grid_arrive(bar_ptr)
            grid_wait(bar_ptr, 2 * P)
        if PHASE == 5:
            before = grid_arrive(bar_ptr)
            grid_wait(bar_ptr, P)
    if (PHASE == 2) | (PHASE == 3) | (PHASE == 5):
        # output rows: the weighted down products of the chosen experts plus the shared experts'; per block of
        # DOWN_ROWS rows one gathered load of the TOP_K experts' rows [TK_P, DOWN_ROWS, I_P] (all in flight)
        i = tl.arange(0, I_P)
        hm = (k < TOP_K)[:, None] & (i < I)[None, :]
        gp = g_ptr + k[:, None] * (2 * I) + i[None, :]
        gate = tl.load(gp, mask=hm, other=0.0).to(tl.float32)
        up = tl.load(gp + I, mask=hm, other=0.0).to(tl.float32)
        h = _silu_mul(gate, up, DT)  # [TK_P, I_P] act(g) of each slot
        w2_base = w2_ptr + eid[:, None, None] * D * I + i[None, None, :]
        w2_mask = ((k < TOP_K)[:, None] & (i < I)[None, :])[:, None, :]
        if HAS_SHARED:
            js = tl.arange(0, IS_P)
            hs = _silu_mul(tl.load(gs_ptr + js, mask=js < IS, other=0.0).to(tl.float32),
                           tl.load(gs_ptr + IS + js, mask=js < IS, other=0.0).to(tl.float32), DT)
        b = pid
        while b < tl.cdiv(D, DOWN_ROWS):
            r = b * DOWN_ROWS + tl.arange(0, DOWN_ROWS)
            r3 = r[None, :, None]
            w2 = tl.load(w2_base + r3.to(tl.int64) * I, mask=w2_mask & (r3 < D), other=0.0)
            y = tl.sum(tl.sum(w2.to(tl.float32) * h[:, None, :], axis=2) * wk[:, None], axis=0)
            if HAS_SHARED:
                sw2 = tl.load(sw2_ptr + r[:, None].to(tl.int64) * IS + js[None, :],
                              mask=(r < D)[:, None] & (js < IS)[None, :], other=0.0)
                y += tl.sum(sw2.to(tl.float32) * hs[None, :], axis=1)
            tl.store(y_ptr + r, y.to(DT), mask=r < D)
            b += P
    if PHASE == 3:
        before = grid_arrive(bar_ptr)
        grid_reset_if_last(bar_ptr, before, 3 * P)
    if PHASE == 5:
        before = grid_arrive(bar_ptr)
        grid_reset_if_last(bar_ptr, before, 2 * P)


def _check(x, router_w, bias, w13, w2, shared_w13, shared_w2, top_k, n_group, topk_group):
    if router_w.dim() != 2:
        raise ValueError(f"router weight must be fp32 [E, D], got shape {list(router_w.shape)}")
    if x.dim() != 2 or x.shape[0] != 1:
        raise ValueError(f"x must be one token [1, D], got {list(x.shape)}")
    D = x.shape[1]
    E = router_w.shape[0]
    if tuple(router_w.shape) != (E, D) or router_w.dtype != torch.float32:
        raise ValueError(f"router weight must be fp32 [E, D={D}], got {router_w.dtype} {list(router_w.shape)}")
    if w13.dim() != 3 or w13.shape[0] != E or w13.shape[2] != D or w13.shape[1] % 2:
        raise ValueError(f"w13 must be [E={E}, 2I, D={D}], got {list(w13.shape)}")
    I = w13.shape[1] // 2
    if tuple(w2.shape) != (E, D, I):
        raise ValueError(f"w2 must be [E={E}, D={D}, I={I}], got {list(w2.shape)}")
    if (shared_w13 is None) != (shared_w2 is None):
        raise ValueError("shared_w13 and shared_w2 go together")
    if shared_w13 is not None and (shared_w13.dim() != 2 or shared_w13.shape[1] != D or shared_w13.shape[0] % 2
                                   or tuple(shared_w2.shape) != (D, shared_w13.shape[0] // 2)):
        raise ValueError(f"shared weights must be [2Is, D={D}] and [D, Is], got {list(shared_w13.shape)} and "
                         f"{list(shared_w2.shape)}")
    dts = {x.dtype, w13.dtype, w2.dtype} | ({shared_w13.dtype, shared_w2.dtype} if shared_w13 is not None else set())
    if len(dts) != 1 or x.dtype not in (torch.bfloat16, torch.float16, torch.float32):
        raise ValueError(f"x and the expert weights must share one of bf16/fp16/fp32, got {sorted(map(str, dts))}")
    if bias is not None and not bias.is_floating_point():
        raise ValueError(f"e_score_correction_bias must be floating point, got {bias.dtype}")
    check_routing_args(torch.empty(1, E), bias, top_k, n_group, topk_group, "sigmoid")
    if top_k > topk_group * (E // n_group):  # the reference would choose among masked (-inf) experts
        raise ValueError(f"top_k ({top_k}) exceeds the experts of the kept groups (topk_group {topk_group} x "
                         f"{E // n_group} experts per group)")


def moe_decode_ref(x: torch.Tensor, router_w: torch.Tensor, bias: torch.Tensor | None, w13: torch.Tensor,
                   w2: torch.Tensor, shared_w13: torch.Tensor | None, shared_w2: torch.Tensor | None, top_k: int,
                   n_group: int = 1, topk_group: int = 1, norm_topk_prob: bool = True,
                   routed_scaling_factor: float = 1.0) -> torch.Tensor:
    """The MoE sub-layer for one token in PyTorch, with :func:`moe_decode_triton`'s rounding points.

    Args:
        x: [1, D] (bf16/fp16/fp32). router_w: [E, D] fp32. bias: [E] fp32 (``e_score_correction_bias``)
            or None. w13: [E, 2I, D] (gate rows then up rows, ``moe_grouped.stack_expert_weights``), w2:
            [E, D, I], x's dtype. shared_w13 / shared_w2: the shared experts' [2Is, D] / [D, Is] or None.
        top_k, n_group, topk_group, norm_topk_prob, routed_scaling_factor: sigmoid noaux_tc routing
            (:func:`longflash.layers.moe.topk_routing`).
    Returns:
        [1, D] in x's dtype: Σ_s w_s · W2[e_s] · act(W13[e_s] · x) + shared, act(g) = silu(g[:I]) · g[I:],
        the gate/up products and activations rounded to x's dtype, the sums fp32, one final rounding.
    Raises:
        ValueError for shapes or dtypes that do not fit together (and as ``topk_routing``)."""
    _check(x, router_w, bias, w13, w2, shared_w13, shared_w2, top_k, n_group, topk_group)
    dt = x.dtype
    logits = x.float() @ router_w.t()
    wts, ids = topk_routing(logits, bias, top_k, n_group, topk_group, norm_topk_prob, routed_scaling_factor)

    def expert(g13, g2):
        g = (x.float() @ g13.float().t()).to(dt).float()
        i = g.shape[1] // 2
        h = (torch.nn.functional.silu(g[:, :i]) * g[:, i:]).to(dt).float()
        return h @ g2.float().t()
    y = torch.zeros(1, x.shape[1], dtype=torch.float32, device=x.device)
    for s in range(top_k):
        y += wts[0, s] * expert(w13[ids[0, s]], w2[ids[0, s]])
    if shared_w13 is not None:
        y += expert(shared_w13, shared_w2)
    return y.to(dt)


def moe_decode_triton(x: torch.Tensor, router_w: torch.Tensor, bias: torch.Tensor | None, w13: torch.Tensor,
                      w2: torch.Tensor, shared_w13: torch.Tensor | None, shared_w2: torch.Tensor | None, top_k: int,
                      n_group: int = 1, topk_group: int = 1, norm_topk_prob: bool = True,
                      routed_scaling_factor: float = 1.0, *, programs: int | None = None,
                      phased: bool | None = None, route_launch: bool = True, prefetch: bool = True,
                      down_rows: int = 16) -> torch.Tensor:
    """Triton version of :func:`moe_decode_ref`: same arguments (any strides; x and the bias are made
    contiguous, the bias fp32) and result within the sums' order (fp32; in 16-bit dtypes an intermediate
    rounding may differ by an ulp).

    Launches (``programs``: the grid of the persistent ones; default the SM count on CUDA, 1 in the
    interpreter):
    - default (``route_launch``): three: phase 0 (router partials, shared gate/up; ``programs``), the routing
      (one program of one warp, which stores the chosen experts and weights), then phases 1 and 2 as one
      persistent launch with one grid barrier: the routing runs once (measured 5.3 µs) instead of in both
      phases (~4-6 µs each, session 27);
    - ``route_launch=False``: one persistent launch, every program routing after the first barrier;
    - ``phased``: phase 0, the routing, phase 1, phase 2, four launches without grid barriers (default only
      in the interpreter with more than one program, where a barrier would never open).
    ``prefetch``: the routed experts' weights (and the shared down rows) are prefetched into L2 as soon as
    the routing is known (``ops/l2_prefetch.py``); it changes no value. (A ``gate_pair`` option, two gate/up
    blocks per step of phase 1, measured slower, 18.7 against 18.0 µs for phases 1-2, and was removed in
    session 28.) ``down_rows``: output rows per block of phase 2 (a power of two, 1..64; default 16,
    one block per program at hidden 2048: phases 1-2 16.0 µs against 18.0 with 4 rows, session 28; sm_90
    compile 157 registers, no spills).
    The barrier counter is kept per device and left at 0. Raises ValueError as the reference, for
    ``programs`` not an int >= 1, ``down_rows`` not a power of two in 1..64, and for a persistent launch with more programs
    than SMs (the barriers need all of them resident) or more than one in the interpreter."""
    _check(x, router_w, bias, w13, w2, shared_w13, shared_w2, top_k, n_group, topk_group)
    E, D = router_w.shape
    I = w13.shape[1] // 2
    interp = interpreting() or not x.is_cuda
    limit = 1 if interp else sm_count(x.device)
    P = programs if programs is not None else limit
    if not isinstance(P, int) or isinstance(P, bool) or P < 1:
        raise ValueError(f"programs must be an int >= 1, got {P!r}")
    if not isinstance(down_rows, int) or isinstance(down_rows, bool) or down_rows < 1 or down_rows > 64 \
            or down_rows & (down_rows - 1):
        raise ValueError(f"down_rows must be a power of two in 1..64, got {down_rows!r}")
    phased = (P > 1 and interp) if phased is None else phased
    if not phased and P > limit:
        raise ValueError(f"a persistent launch takes 1..{limit} programs here (all resident for the grid "
                         f"barriers), got {P}; pass phased=True for one launch per phase")
    dev = x.device
    x = x.contiguous()
    if bias is not None:
        bias = bias.to(device=dev, dtype=torch.float32).contiguous()
    n_slices = triton.cdiv(D, ROUTER_SLICE)
    E_P = triton.next_power_of_2(E)
    IS = shared_w13.shape[0] // 2 if shared_w13 is not None else 1
    part = torch.empty(n_slices, E_P, dtype=torch.float32, device=dev)
    g = torch.empty(top_k, 2 * I, dtype=x.dtype, device=dev)
    gs = torch.empty(2 * IS, dtype=x.dtype, device=dev)
    y = torch.empty(1, D, dtype=x.dtype, device=dev)
    bar = barrier_counter(dev)
    TK_P = triton.next_power_of_2(top_k)
    rid = torch.empty(TK_P, dtype=torch.int64, device=dev)  # the routing launch's experts and weights per slot
    rwt = torch.empty(TK_P, dtype=torch.float32, device=dev)
    gsz = E // n_group
    NG_P, GS_P = triton.next_power_of_2(n_group), triton.next_power_of_2(gsz)
    args = (x, router_w.contiguous(), bias if bias is not None else router_w, w13.contiguous(), w2.contiguous(),
            shared_w13.contiguous() if shared_w13 is not None else w13, shared_w2.contiguous() if shared_w2 is not None
            else w2, part, g, gs, y, bar, rid, rwt, D, I, IS, n_slices, float(routed_scaling_factor))
    meta = dict(E_P=E_P, N_GROUP=n_group, GROUP_SIZE=gsz, NG_P=NG_P, GS_P=GS_P, TOP_K=top_k, TOPK_GROUP=topk_group, HAS_BIAS=bias is not None,
                RENORM=bool(norm_topk_prob), HAS_SHARED=shared_w13 is not None, I_P=triton.next_power_of_2(I),
                IS_P=triton.next_power_of_2(IS), RK=ROUTER_SLICE, K_STEP=min(BLOCK_K, triton.next_power_of_2(D)),
                NS_C=min(triton.next_power_of_2(n_slices), max(1, ROUTE_CHUNK // (NG_P * GS_P))), TK_P=TK_P, DOWN_ROWS=down_rows, PREFETCH=bool(prefetch),
                ELT=x.element_size(), NUM_WARPS=NUM_WARPS, INTERPRET=interp,
                IDX_BITS=_IDX_BITS, num_warps=NUM_WARPS)
    phases = (0, 4, 1, 2) if phased else (0, 4, 5) if route_launch else (3,)
    for phase in phases:
        if phase == 4:  # the routing: one program of one warp
            _moe_decode_kernel[(1,)](*args, PHASE=4, **dict(meta, num_warps=1))
        else:
            _moe_decode_kernel[(P,)](*args, PHASE=phase, **meta)
    return y
