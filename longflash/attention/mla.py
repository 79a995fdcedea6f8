"""Multi-head Latent Attention (DeepSeek-V2, arXiv 2405.04434) over a paged latent cache.

Two mathematically equal paths (``shared/specs/mla_dcp_fp8.md``):
- prefill (compute friendly): up-project the cached latents with ``kv_b_proj`` to per-head K/V and
  attend causally;
- decode (bandwidth friendly, "absorbed"): fold ``W_UK`` into the query, attend with width
  ``kv_lora_rank + qk_rope_head_dim`` against the cache rows, apply ``W_UV`` after. Multi-token
  causal queries (speculative verify) take this path too.
Options for Kimi-K3: ``use_nope`` (the rope part exists but is not rotated) and an output gate
``o * sigmoid(g_proj(x))`` before ``o_proj``.
"""

from __future__ import annotations

import torch
from torch import nn

from longflash.attention import ops
from longflash.attention.dispatch import cache_ops
from longflash.attention.chunked_context import DEFAULT_CONTEXT_WORKSPACE_ROWS, plan_context_chunks
from longflash.distributed import dcp as dcp_ops
from longflash.distributed.comm import GroupCoordinator, get_parallel_state
from longflash.layers import gemv
from longflash.layers.norm import RMSNorm
from longflash.layers.parallel import ColumnParallelLinear, RowParallelLinear, split_evenly
from longflash.layers.rotary import RotaryEmbedding
from longflash.runner.context import get_forward_context
from longflash.runner.step_inputs import to_device_async


def _parallel_of(ctx):
    """The parallel state of the runner that built ``ctx`` (``ForwardContext.parallel``: its DCP group),
    else the process-wide one (runner-less callers)."""
    return ctx.parallel if ctx.parallel is not None else get_parallel_state()


class MLAAttention(nn.Module):
    """One MLA layer: projections, RoPE, cache write, attention, output projection.

    Weight names follow the DeepSeek/Kimi checkpoints (``q_a_proj``, ``q_a_layernorm``, ``q_b_proj``
    or ``q_proj``, ``kv_a_proj_with_mqa``, ``kv_a_layernorm``, ``kv_b_proj``, ``o_proj``, optional
    ``g_proj``). ``kv_cache`` is set by the model runner: [num_blocks, block_size, kv_lora_rank +
    qk_rope_head_dim]. ``k_scale`` is the fp8 dequantization multiplier (1.0 default);
    ``calculate_kv_scales`` (set by the runner) makes the first forward set it to amax / 200 of the
    rows it writes, then it stays frozen. ``context_workspace_rows`` (W) bounds the rows of cached
    context that a prefill gathers and up-projects at once.

    forward: hidden [T, H] -> [T, H] (reads the forward context).

    Tensor parallelism (``tp`` of N > 1 ranks; the issue's split): the heads are split over the ranks
    (``num_heads`` is this rank's ``num_attention_heads / N``): ``q_proj``/``q_b_proj``, ``kv_b_proj``
    and ``g_proj`` are column-parallel by heads, ``o_proj`` row-parallel with an all-reduce;
    ``q_a_proj``, ``kv_a_proj_with_mqa`` and the norms are replicated, so every rank writes the same
    latent rows (its DCP shard of them). Raises ValueError when N does not divide the heads.
    """

    def __init__(self, hidden_size: int, num_heads: int, q_lora_rank: int | None, kv_lora_rank: int,
                 qk_nope_head_dim: int, qk_rope_head_dim: int, v_head_dim: int, rms_norm_eps: float,
                 rotary: RotaryEmbedding | None, softmax_scale: float, output_gate: bool = False,
                 q_norm_eps: float | None = None, *, tp: GroupCoordinator | None = None):
        super().__init__()
        self.total_num_heads = num_heads
        _, num_heads = split_evenly(num_heads, tp, "num_attention_heads")
        self.num_heads = num_heads
        self.q_lora_rank = q_lora_rank
        self.kv_lora_rank = kv_lora_rank
        self.qk_nope_head_dim = qk_nope_head_dim
        self.qk_rope_head_dim = qk_rope_head_dim
        self.qk_head_dim = qk_nope_head_dim + qk_rope_head_dim
        self.v_head_dim = v_head_dim
        self.scale = softmax_scale
        self.rotary = rotary
        eps = rms_norm_eps if q_norm_eps is None else q_norm_eps
        Ht, w = self.total_num_heads, "num_attention_heads"
        if q_lora_rank is None:
            self.q_proj = ColumnParallelLinear(hidden_size, Ht * self.qk_head_dim, tp=tp, what=w)
        else:
            self.q_a_proj = nn.Linear(hidden_size, q_lora_rank, bias=False)
            self.q_a_layernorm = RMSNorm(q_lora_rank, eps)
            self.q_b_proj = ColumnParallelLinear(q_lora_rank, Ht * self.qk_head_dim, tp=tp, what=w)
        self.kv_a_proj_with_mqa = nn.Linear(hidden_size, kv_lora_rank + qk_rope_head_dim, bias=False)
        self.kv_a_layernorm = RMSNorm(kv_lora_rank, eps)
        self.kv_b_proj = ColumnParallelLinear(kv_lora_rank, Ht * (qk_nope_head_dim + v_head_dim), tp=tp, what=w)
        self.o_proj = RowParallelLinear(Ht * v_head_dim, hidden_size, tp=tp, what=w)
        self.g_proj = ColumnParallelLinear(hidden_size, Ht * v_head_dim, tp=tp, what=w) if output_gate else None
        self.kv_cache: torch.Tensor | None = None
        self.k_scale: float = 1.0
        self.k_scale_source: str = "default"
        self.calculate_kv_scales: bool = False
        self.context_workspace_rows: int = DEFAULT_CONTEXT_WORKSPACE_ROWS
        self.qkv_a_weight: torch.Tensor | None = None  # [q_lora_rank + kv_lora_rank + rope, hidden] once fused
        self.w_uk_t: torch.Tensor | None = None  # [H, kv_lora_rank, qk_nope] contiguous, once made (make_w_uk_t)

    def fuse_qkv_a(self) -> None:
        """Compute ``q_a_proj`` and ``kv_a_proj_with_mqa`` (both replicated, both reading the layer's
        normed input) with one GEMM from now on (inference; the engine calls it on GPUs, where a batch-1
        decode step is a chain of small launches: vLLM's ``fused_qkv_a_proj`` does the same). The two
        weights are copied into one [q_lora_rank + kv_lora_rank + rope, hidden] tensor and the parameters
        become views of its rows (no second copy). A no-op without ``q_lora_rank``, for weights of
        different dtypes or devices, or when already fused."""
        if self.qkv_a_weight is not None or self.q_lora_rank is None:
            return
        q, kv = self.q_a_proj.weight, self.kv_a_proj_with_mqa.weight
        if q.dtype != kv.dtype or q.device != kv.device or type(q) is not type(kv):
            return
        w = torch.cat([q.detach(), kv.detach()])
        q.data, kv.data = w[:q.shape[0]], w[q.shape[0]:]
        self.qkv_a_weight = w

    def make_w_uk_t(self) -> None:
        """Keep W_UK transposed, [H, kv_lora_rank, qk_nope_head_dim] contiguous (a copy: H · R · nope
        elements, 2 MB per layer for 16 heads of DeepSeek-V3's dims in bf16), for the query absorption of
        uniform decode steps: the few-row GEMV reads its weight along the contraction dim, which in
        ``kv_b_proj``'s layout is strided (vLLM keeps the same ``W_UK_T``). Called with the other
        decode-time fusions (``cuda_graph.prepare_uniform_model``); idempotent; a no-op with the GEMV off
        (``gemv.enabled``: cuBLAS takes the strided view as it is)."""
        if self.w_uk_t is None and gemv.enabled:
            self.w_uk_t = self._w_uk_uv()[0].detach().transpose(1, 2).contiguous()

    # W_UK: [H, qk_nope, R], W_UV: [H, v, R] views of kv_b_proj.weight [H*(nope+v), R].
    def _w_uk_uv(self) -> tuple[torch.Tensor, torch.Tensor]:
        w = self.kv_b_proj.weight.view(self.num_heads, self.qk_nope_head_dim + self.v_head_dim, self.kv_lora_rank)
        return w[:, :self.qk_nope_head_dim], w[:, self.qk_nope_head_dim:]

    def _k_scale(self) -> float | None:
        return self.k_scale if self.kv_cache is not None and self.kv_cache.dtype == ops.FP8_DTYPE else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        ctx = get_forward_context()
        T = x.shape[0]
        if self.q_lora_rank is None:
            q = self.q_proj(x)
            kv_a = self.kv_a_proj_with_mqa(x)
        else:
            if self.qkv_a_weight is not None:  # one GEMM for q_a and kv_a (fuse_qkv_a)
                q_a, kv_a = gemv.linear(x, self.qkv_a_weight).split([self.q_lora_rank, self.qkv_a_weight.shape[0] -
                                                                  self.q_lora_rank], dim=-1)
            else:
                q_a, kv_a = self.q_a_proj(x), self.kv_a_proj_with_mqa(x)
            q = self.q_b_proj(self.q_a_layernorm(q_a))
        q = q.view(T, self.num_heads, self.qk_head_dim)
        q_nope, q_pe = q.split([self.qk_nope_head_dim, self.qk_rope_head_dim], dim=-1)
        kv_c, k_pe = kv_a.split([self.kv_lora_rank, self.qk_rope_head_dim], dim=-1)
        kv_c = self.kv_a_layernorm(kv_c)
        # A uniform decode step attends with the absorbed query [T, H, kv_lora_rank + rope]: the rotated
        # q_pe goes straight into its rope slice (and q_nope · W_UK into the rest, _decode_uniform).
        q_abs = x.new_empty(T, self.num_heads, self.kv_lora_rank + self.qk_rope_head_dim) if ctx.uniform_decode \
            else None
        q_pe_out = q_abs[..., self.kv_lora_rank:] if q_abs is not None else None
        if self.rotary is not None:  # one launch on CUDA (cos/sin computed in-kernel), the reference elsewhere
            q_pe, k_pe = self.rotary.rotate_qk(q_pe, k_pe, ctx.positions, q_out=q_pe_out)
        elif q_pe_out is not None:
            q_pe_out.copy_(q_pe)
        if self.calculate_kv_scales and self._k_scale() is not None:
            amax = float(torch.maximum(kv_c.abs().max(), k_pe.abs().max())) if T else 0.0
            self.k_scale = amax / 200.0 if amax > 0 else 1.0
            self.k_scale_source = "calculated"
            self.calculate_kv_scales = False  # frozen from now on
        kernels = cache_ops(self.kv_cache)
        kernels.concat_and_cache_mla(kv_c, k_pe, self.kv_cache, ctx.slot_mapping, self._k_scale())

        out = x.new_empty(T, self.num_heads, self.v_head_dim)
        w_uk, w_uv = self._w_uk_uv()
        qsl = ctx.query_start_loc_cpu
        if ctx.uniform_decode:  # one batched sync-free call (CUDA graphs)
            out = self._decode_uniform(q_nope, q_abs, ctx, w_uk, w_uv)
            decode_reqs = []
        else:
            decode_reqs = [b for b in range(ctx.num_reqs) if ctx.is_decode[b] and qsl[b + 1] > qsl[b]]
        if decode_reqs:
            self._decode(q_nope, q_pe, decode_reqs, ctx, w_uk, w_uv, out)
        prefill_reqs = [b for b in range(ctx.num_reqs) if not ctx.is_decode[b] and qsl[b + 1] > qsl[b]]
        if prefill_reqs:
            self._prefill(q_nope, q_pe, kv_c, k_pe, prefill_reqs, ctx, out, kernels)
        out = out.reshape(T, self.num_heads * self.v_head_dim)
        if self.g_proj is not None:
            out = out * torch.sigmoid(self.g_proj(x))
        return self.o_proj(out)

    def _decode(self, q_nope, q_pe, reqs: list[int], ctx, w_uk, w_uv, out: torch.Tensor) -> None:
        """Absorbed attention of the decode/verify requests ``reqs``, written into their ``out`` rows.

        Under DCP (the issue's decode): the absorbed queries of this rank's heads are all-gathered over
        the DCP group (heads of the group), attended over this rank's KV shard with their LSE, combined by
        LSE and reduce-scattered back to this rank's heads (``dcp.dcp_mla_decode``, ``gather_heads``);
        an empty shard has weight exactly 0. All requests go in one call (one set of collectives).
        """
        qsl = ctx.query_start_loc_cpu
        ps = _parallel_of(ctx)
        if ps.dcp_size > 1:
            rows = torch.cat([torch.arange(qsl[b], qsl[b + 1]) for b in reqs]).to(q_nope.device)
            q_lat = torch.einsum("thd,hdr->thr", q_nope[rows], w_uk)
            q_abs = torch.cat([q_lat, q_pe[rows]], dim=-1)
            cu = [0]
            for b in reqs:
                cu.append(cu[-1] + qsl[b + 1] - qsl[b])
            bt = ctx.block_table[torch.tensor(reqs, device=ctx.block_table.device)]
            o_lat, _ = dcp_ops.dcp_mla_decode(
                q_abs, self.kv_cache, bt, cu, [ctx.seq_lens_cpu[b] for b in reqs], self.scale, self.kv_lora_rank,
                ps.dcp, ps.cp_kv_cache_interleave_size, self._k_scale(), gather_heads=True)
            out[rows] = torch.einsum("thr,hvr->thv", o_lat, w_uv)
            return
        if reqs == list(range(len(reqs))):  # the running requests lead the batch: one call for all of them
            k = len(reqs)
            s, e = qsl[0], qsl[k]
            q_lat = torch.einsum("thd,hdr->thr", q_nope[s:e], w_uk)
            q_abs = torch.cat([q_lat, q_pe[s:e]], dim=-1)
            o_lat, _ = self._decode_requests(q_abs, ctx, k)
            out[s:e] = torch.einsum("thr,hvr->thv", o_lat, w_uv)
            return
        for b in reqs:
            s, e = qsl[b], qsl[b + 1]
            q_lat = torch.einsum("thd,hdr->thr", q_nope[s:e], w_uk)
            q_abs = torch.cat([q_lat, q_pe[s:e]], dim=-1)
            o_lat, _ = self._decode_request(q_abs, ctx, b)
            out[s:e] = torch.einsum("thr,hvr->thv", o_lat, w_uv)

    def _decode_requests(self, q_abs: torch.Tensor, ctx, k: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Absorbed attention of the first ``k`` requests of the batch (all decode / verify) in one call:
        ``q_abs`` [their tokens, H, W] (one process; a mixed step's decodes). On a GPU the lengths go to
        the op as device tensors with host bounds (no host -> device copy, no sync)."""
        op = decode_op(self.kv_cache)
        qsl = ctx.query_start_loc_cpu
        max_q = max(qsl[b + 1] - qsl[b] for b in range(k))
        max_s = max(ctx.seq_lens_cpu[:k])
        if self.kv_cache.is_cuda:
            return op(q_abs, self.kv_cache, ctx.block_table[:k], ctx.query_start_loc[:k + 1], ctx.seq_lens[:k],
                      self.scale, self.kv_lora_rank, self._k_scale(), max_query_len=max_q, max_seq_len=max_s)
        return op(q_abs, self.kv_cache, ctx.block_table[:k], qsl[:k + 1], ctx.seq_lens_cpu[:k], self.scale,
                  self.kv_lora_rank, self._k_scale())

    def _decode_request(self, q_abs: torch.Tensor, ctx, b: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Absorbed attention of request b's queries ``q_abs`` [q_len, H, W] (one process). On a GPU the
        lengths go to the op as device tensors with host bounds (no host -> device copy, no sync)."""
        op = decode_op(self.kv_cache)
        if self.kv_cache.is_cuda:
            qsl = ctx.query_start_loc[b:b + 2] - ctx.query_start_loc_cpu[b]
            return op(q_abs, self.kv_cache, ctx.block_table[b:b + 1], qsl, ctx.seq_lens[b:b + 1], self.scale,
                      self.kv_lora_rank, self._k_scale(), max_query_len=q_abs.shape[0],
                      max_seq_len=ctx.seq_lens_cpu[b])
        return op(q_abs, self.kv_cache, ctx.block_table[b:b + 1], [0, q_abs.shape[0]], [ctx.seq_lens_cpu[b]],
                  self.scale, self.kv_lora_rank, self._k_scale())

    def _decode_uniform(self, q_nope, q_abs, ctx, w_uk, w_uv) -> torch.Tensor:
        """Absorbed attention of a uniform decode/verify step ([T, H, v_head_dim]); ``q_abs`` [T, H,
        kv_lora_rank + rope] holds the rotated q_pe in its rope slice and receives q_nope · W_UK in the
        rest (per-head products, ``gemv.bmm``: one Triton launch for a few tokens). Every request has
        ``ctx.max_query_len`` queries; the decode op reads ``query_start_loc``/``seq_lens`` as device
        tensors with the host bounds ``max_query_len``/``max_seq_len`` (no device -> host sync).
        Under DCP, as :meth:`_decode` (query heads all-gathered over the DCP group, attention over this
        rank's shard, LSE combine reduce-scattered back to this rank's heads), with the shard's lengths
        computed on the device (``dcp.dcp_rank_local_lens`` of the sequence lengths, and of each query's
        position + 1 for what it sees) and the host bound ``dcp_padded_local_len(max_seq_len)``."""
        w_uk_t = self.w_uk_t if self.w_uk_t is not None else w_uk.transpose(1, 2)  # [H, R, nope]
        gemv.bmm(q_nope.transpose(0, 1), w_uk_t, out=q_abs[..., :self.kv_lora_rank].transpose(0, 1))
        ps = _parallel_of(ctx)
        op = decode_op(self.kv_cache)
        if ps.dcp_size == 1:
            o_lat, _ = op(q_abs, self.kv_cache, ctx.block_table, ctx.query_start_loc, ctx.seq_lens, self.scale,
                          self.kv_lora_rank, self._k_scale(), max_query_len=ctx.max_query_len,
                          max_seq_len=ctx.max_seq_len)
            return self._up_project_values(o_lat, w_uv)
        R, r, I = ps.dcp_size, ps.dcp_rank, ps.cp_kv_cache_interleave_size
        q_all = ps.dcp.all_gather(q_abs, dim=1)
        local = dcp_ops.dcp_rank_local_lens(ctx.seq_lens, R, r, I)
        visible = dcp_ops.dcp_rank_local_lens(ctx.positions + 1, R, r, I).to(torch.int32)
        o, lse = op(q_all, self.kv_cache, ctx.block_table, ctx.query_start_loc, local, self.scale, self.kv_lora_rank,
                    self._k_scale(), max_query_len=ctx.max_query_len,
                    max_seq_len=dcp_ops.dcp_padded_local_len(ctx.max_seq_len, R, I), visible_lens=visible)
        o_lat, _ = dcp_ops.dcp_decode_combine_group(o, lse, ps.dcp, scatter_heads=True)
        return self._up_project_values(o_lat, w_uv)

    def _up_project_values(self, o_lat: torch.Tensor, w_uv: torch.Tensor) -> torch.Tensor:
        """o_lat [T, H, kv_lora_rank] -> [T, H, v_head_dim] = o_lat · W_UV^T per head (``gemv.bmm``)."""
        out = o_lat.new_empty(o_lat.shape[0], self.num_heads, self.v_head_dim)
        gemv.bmm(o_lat.transpose(0, 1), w_uv, out=out.transpose(0, 1))
        return out

    def _prefill(self, q_nope, q_pe, kv_c, k_pe, reqs: list[int], ctx, out: torch.Tensor, kernels) -> None:
        """Chunked-context prefill of the batch's prefill requests, written into ``out`` rows.

        New tokens attend causally among themselves, up-projected from this step's latents; the
        cached context [0, context_len) attends non-causally through workspace chunks of at most
        ``context_workspace_rows`` rows (``chunked_context.plan_context_chunks``), dequantized by the
        gather; the partial results merge by LSE.
        Under DCP (the spec's wire format): the chunks are planned over the per-rank padded local
        lengths ``cdiv(ctx, dcp·I)·I`` (the same plan on every rank, ``max(block_size, W // dcp)`` local
        rows per chunk); each rank gathers (and dequantizes) its shard's rows of a chunk, the 576-wide
        latents are all-gathered over the DCP group, the rows past each rank's true local length are
        dropped, and the rest (rank-major order: fine for non-causal attention, k_pe carries RoPE) are
        up-projected with this rank's heads and attended as in one process. No head exchange is needed.
        """
        qsl = ctx.query_start_loc_cpu
        q = torch.cat([q_nope, q_pe], dim=-1)
        # the new tokens of every prefill request at once: one up-projection, one varlen causal launch
        lens = [qsl[b + 1] - qsl[b] for b in reqs]
        sel = _row_selector(qsl, reqs, q.device)
        q_new = q[sel]
        k, v = self._up_project(kv_c[sel], k_pe[sel])
        o_new, lse_new = kernels.attention_with_lse_varlen(q_new, k, v, self.scale, lens, lens, causal=True)
        first = [0]  # each prefill request's first row in q_new / o_new
        for n in lens:
            first.append(first[-1] + n)
        ctx_lens = [ctx.context_lens_cpu[b] for b in reqs]
        ps = _parallel_of(ctx)
        bs = self.kv_cache.shape[1]
        sharded = ps.dcp_size > 1 and sum(ctx_lens) > 0
        if sharded:
            R, I = ps.dcp_size, ps.cp_kv_cache_interleave_size
            true_local = dcp_ops.dcp_local_seq_lens(ctx_lens, R, I).tolist()         # [B][R]
            plan = plan_context_chunks([dcp_ops.dcp_padded_local_len(c, R, I) for c in ctx_lens],
                                       max(bs, self.context_workspace_rows // R), bs)
        else:
            plan = plan_context_chunks(ctx_lens, self.context_workspace_rows, bs)
        reqs_t = to_device_async(reqs, torch.int64, ctx.block_table.device)
        for chunk in plan:
            idx, cu, starts = chunk.gather_args(ctx.block_table.device)
            rows = kernels.gather_and_maybe_dequant_cache(
                self.kv_cache, ctx.block_table[reqs_t[idx]], cu, starts, q.dtype, self._k_scale(),
                total=chunk.num_rows)
            spans = [(seg.offset, seg.offset + seg.length) for seg in chunk.segments]
            if sharded:
                n = rows.shape[0]
                keep = [dcp_ops.dcp_gathered_rows(seg.start, seg.length, seg.offset, true_local[seg.req], n)
                        for seg in chunk.segments]
                spans, r0 = [], 0
                for kp in keep:
                    spans.append((r0, r0 + kp.numel()))
                    r0 += kp.numel()
                rows = ps.dcp.all_gather(rows, dim=0)[torch.cat(keep).to(rows.device)]
            k_all, v_all = self._up_project(*rows.split([self.kv_lora_rank, self.qk_rope_head_dim], dim=-1))
            # every segment of the chunk at once: its requests' new tokens attend (non-causally) to their
            # own rows of the chunk (laid out in segment order from row 0), one varlen launch; then one merge
            js = [seg.req for seg in chunk.segments]
            rsel = _row_selector(first, js, q.device)
            o, lse = kernels.attention_with_lse_varlen(q_new[rsel], k_all[:spans[-1][1]], v_all[:spans[-1][1]],
                                                       self.scale, [lens[j] for j in js],
                                                       [r1 - r0 for r0, r1 in spans], causal=False)
            o_new[rsel], lse_new[rsel] = kernels.merge_attn_states(o, lse, o_new[rsel], lse_new[rsel])
            del rows, k_all, v_all
        out[sel] = o_new

    def _up_project(self, kv_c: torch.Tensor, k_pe: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Latents [n, R], [n, rope] -> K [n, H, nope + rope], V [n, H, v] through ``kv_b_proj``."""
        n = kv_c.shape[0]
        kv = self.kv_b_proj(kv_c).view(n, self.num_heads, self.qk_nope_head_dim + self.v_head_dim)
        k_nope, v = kv.split([self.qk_nope_head_dim, self.v_head_dim], dim=-1)
        k = torch.cat([k_nope, k_pe[:, None, :].expand(-1, self.num_heads, -1)], dim=-1)
        return k, v


def _row_selector(starts: list[int], idx: list[int], device: torch.device) -> slice | torch.Tensor:
    """The rows ``starts[i] .. starts[i + 1]`` of each i in ``idx`` (ascending), in order: a slice when they
    are one run (the usual layout: no copy), else an int64 index tensor on ``device``."""
    if all(starts[a + 1] == starts[b] for a, b in zip(idx, idx[1:])):
        return slice(starts[idx[0]], starts[idx[-1] + 1])
    return to_device_async([r for i in idx for r in range(starts[i], starts[i + 1])], torch.int64, device)


def decode_op(cache: torch.Tensor):
    """The absorbed MLA decode attention for ``cache``'s device: the Triton kernel
    (``triton_mla_decode``) on a GPU, the PyTorch reference elsewhere (same signature; both accept
    device-tensor lengths with host bounds)."""
    if cache.is_cuda:
        from longflash.attention import triton_mla_decode
        return triton_mla_decode.mla_decode_attention
    return ops.mla_decode_attention
