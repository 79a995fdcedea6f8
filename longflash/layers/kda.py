"""Kimi Delta Attention (KDA): gated delta-rule linear attention with per-channel decay.

Math (``shared/specs/attnres_kimi.md``, HF transformers ``modeling_kimi_linear.py``):
q, k, v = SiLU(causal depthwise conv_K(proj(x))); q, k L2-normalised (eps 1e-6 inside the sqrt), q scaled
by 1/sqrt(dk); beta = sigmoid(b_proj x); per-channel log decay g [T, H, dk] (``kda_gate``). Per head,
with a state S [dk, dv] in fp32:

    S = diag(exp(g_t)) S;  S = S + k_t (beta_t (v_t - S^T k_t))^T;  o_t = S^T q_t

Output: ``o_proj(RMSNorm_dv(o) * sigmoid(gate))`` with the gate from ``g_proj`` (Kimi-K3, full rank) or
``g_b_proj(g_a_proj(x))`` (Kimi-Linear, low rank).

Two forms with the same result (tested against each other): ``kda_recurrent`` (one token at a time,
decode and speculative verify) and ``kda_chunked`` (WY/UT-transform chunks, prefill; varlen through
``cu_seqlens``). Both are PyTorch references (the CPU path); on CUDA the layer runs their Triton kernels
with the same signatures: ``layers/kda_triton.py`` (recurrent) and ``layers/kda_chunked_triton.py`` (chunked;
all prefill pieces of a step in one call).

State in the engine (``runner/state_pool.py``): per request and KDA layer, the recurrent state
[H, dk, dv] fp32 and the conv state [3P, K-1] (the last K-1 raw q|k|v projections). A request whose
``context_len`` is 0 starts from zeros (new request or recompute after preemption).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from longflash.runner.context import get_forward_context

DEFAULT_CHUNK_SIZE = 64


def l2norm(x: torch.Tensor, eps: float = 1e-6) -> torch.Tensor:
    """``x / sqrt(sum(x^2) + eps)`` over the last dim (FLA / HF convention: eps inside the sqrt)."""
    return x / torch.sqrt((x * x).sum(-1, keepdim=True) + eps)


def kda_gate(f: torch.Tensor, A_log: torch.Tensor, dt_bias: torch.Tensor, head_dim: int,
             lower_bound: float | None = None) -> torch.Tensor:
    """Per-channel log decay g (<= 0) from the forget-gate projection.

    Args:
        f: [T, H*dk], ``f_b_proj(f_a_proj(x))``, any float dtype.
        A_log: [H] (already narrowed to num_heads). dt_bias: [H*dk].
        lower_bound: None -> Kimi-Linear ``-exp(A_log) * softplus(f + dt_bias)`` (softplus(x) = x above 20);
            a float b (Kimi-K3 ``gate_lower_bound``, -5) -> ``b * sigmoid(exp(A_log) * (f + dt_bias))``.
    Returns:
        [T, H, dk] fp32.
    """
    T = f.shape[0]
    x = (f.float() + dt_bias.float()).view(T, dt_bias.shape[0] // head_dim, head_dim)
    a = torch.exp(A_log.float()).view(1, -1, 1)
    if lower_bound is None:
        return -a * torch.where(x > 20.0, x, torch.log(1.0 + torch.exp(x)))
    return float(lower_bound) * torch.sigmoid(a * x)


def causal_conv1d(x: torch.Tensor, conv_state: torch.Tensor, weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Causal depthwise convolution with SiLU, continuing from ``conv_state``.

    Args:
        x: [T, C] raw projections of this step's tokens (T may be 0 or 1).
        conv_state: [C, K-1], the previous K-1 raw inputs (zeros at the start of a sequence).
        weight: [C, K] depthwise kernel (checkpoint ``*_conv1d.weight`` [C, 1, K] squeezed).
    Returns:
        (SiLU(conv) [T, C] in x's dtype, new conv state [C, K-1] = the last K-1 inputs of cat(state, x)).
    """
    K = weight.shape[1]
    xe = torch.cat([conv_state.to(x.dtype), x.t()], dim=1)  # [C, K-1+T]
    y = F.conv1d(xe.unsqueeze(0).to(weight.dtype), weight.unsqueeze(1), groups=weight.shape[0])[0]  # [C, T]
    return F.silu(y).t().to(x.dtype), xe[:, xe.shape[1] - (K - 1):]


def causal_conv1d_update(x: torch.Tensor, conv_state: torch.Tensor, weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """One new token for each of B requests: ``causal_conv1d`` batched.

    Args: x [B, C]; conv_state [B, C, K-1]; weight [C, K].
    Returns: (SiLU(conv) [B, C] in x's dtype, new conv states [B, C, K-1]).
    """
    xe = torch.cat([conv_state.to(x.dtype), x.unsqueeze(-1)], dim=-1)  # [B, C, K]
    y = F.conv1d(xe.to(weight.dtype), weight.unsqueeze(1), groups=weight.shape[0])[:, :, 0]  # [B, C]
    return F.silu(y).to(x.dtype), xe[:, :, 1:]


def kda_recurrent(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor,
                  state: torch.Tensor, scale: float) -> tuple[torch.Tensor, torch.Tensor]:
    """Recurrent KDA, one token at a time (decode, speculative verify, state replay).

    Args:
        q, k: [T, H, dk] (already L2-normalised). v: [T, H, dv]. g: [T, H, dk] log decay.
        beta: [T, H]. state: [H, dk, dv] (not modified). scale: multiplies q (1/sqrt(dk)).
    Returns:
        (o [T, H, dv] fp32, final state [H, dk, dv] fp32).
    """
    q, k, v, g, beta = (t.float() for t in (q, k, v, g, beta))
    q = q * scale
    S = state.float().clone()
    o = q.new_empty(q.shape[0], q.shape[1], v.shape[-1])
    for t in range(q.shape[0]):
        S = S * g[t].exp().unsqueeze(-1)
        kv_mem = (S * k[t].unsqueeze(-1)).sum(-2)
        delta = (v[t] - kv_mem) * beta[t].unsqueeze(-1)
        S = S + k[t].unsqueeze(-1) * delta.unsqueeze(-2)
        o[t] = (S * q[t].unsqueeze(-1)).sum(-2)
    return o, S


def check_cu_seqlens(cu_seqlens, T: int, state: torch.Tensor, H: int, dk: int, dv: int, name: str) -> torch.Tensor:
    """Validate a varlen batch for the chunked form; returns the offsets as an int64 CPU tensor [N+1].

    ``cu_seqlens`` None means one sequence ([0, T]) with ``state`` [H, dk, dv]; otherwise N+1 offsets
    (0 first, T last, non-decreasing) with ``state`` [N, H, dk, dv]. Raises ValueError naming the problem.
    """
    if cu_seqlens is None:
        if tuple(state.shape) != (H, dk, dv):
            raise ValueError(f"{name}: state has shape {list(state.shape)}, expected {[H, dk, dv]}")
        return torch.tensor([0, T], dtype=torch.long)
    cu = torch.as_tensor(cu_seqlens).to("cpu", torch.long)
    if cu.dim() != 1 or cu.numel() < 2 or cu[0] != 0 or cu[-1] != T or bool((cu[1:] < cu[:-1]).any()):
        raise ValueError(f"{name}: cu_seqlens must be N+1 non-decreasing offsets from 0 to T={T}, got {cu.tolist()}")
    if tuple(state.shape) != (cu.numel() - 1, H, dk, dv):
        raise ValueError(f"{name}: state has shape {list(state.shape)}, expected {[cu.numel() - 1, H, dk, dv]} "
                         f"(one state per sequence of cu_seqlens)")
    return cu


def kda_chunked(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor,
                state: torch.Tensor, scale: float, chunk_size: int | None = None,
                cu_seqlens: torch.Tensor | list[int] | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Chunked (parallel) KDA: the same function as ``kda_recurrent``, chunk by chunk.

    Inside a chunk with cumulative log decay G_i = sum_{s<=i} g_s (per channel), the delta rule is the
    UT transform: with L_ij = beta_i <k_i, k_j exp(G_i - G_j)> (i > j), T = (I + L)^-1,
    u = T (beta v), w = T (beta k exp(G)); then per chunk v' = u - w S, o = (q exp(G)) S + A_qk v'
    (A_qk_ij = <q_i, k_j exp(G_i - G_j)>, j <= i) and S' = exp(G_C) S + (k exp(G_C - G))^T v'.
    Same shapes/returns as ``kda_recurrent``; T need not be a multiple of ``chunk_size`` (None:
    ``DEFAULT_CHUNK_SIZE``; the tail is padded with g = 0, beta = 0, k = v = 0, which leaves the state
    unchanged). Varlen: with ``cu_seqlens`` (N+1 offsets into T) the N sequences are independent,
    ``state`` is [N, H, dk, dv] and the final states come back stacked the same way (``check_cu_seqlens``).
    Raises ValueError for a state or ``cu_seqlens`` that does not fit.
    """
    T, H, dk = k.shape
    dv = v.shape[-1]
    cu = check_cu_seqlens(cu_seqlens, T, state, H, dk, dv, "kda_chunked")
    if cu_seqlens is not None:
        outs, states = [q.new_empty(0, H, dv, dtype=torch.float32)], []
        for i, (s, e) in enumerate(zip(cu[:-1].tolist(), cu[1:].tolist())):
            o_i, s_i = kda_chunked(q[s:e], k[s:e], v[s:e], g[s:e], beta[s:e], state[i], scale, chunk_size)
            outs.append(o_i)
            states.append(s_i)
        return torch.cat(outs), torch.stack(states)
    q, k, v, g, beta = (t.float() for t in (q, k, v, g, beta))
    S = state.float().clone()
    o = q.new_empty(T, H, dv)
    C = chunk_size or DEFAULT_CHUNK_SIZE
    pad = (-T) % C
    if pad:
        q, k, v, g = (F.pad(t, (0, 0, 0, 0, 0, pad)) for t in (q, k, v, g))
        beta = F.pad(beta, (0, 0, 0, pad))
    # [H, N, C, d]
    q, k, v, g = (t.view(-1, C, H, t.shape[-1]).permute(2, 0, 1, 3) for t in (q, k, v, g))
    beta = beta.view(-1, C, H).permute(2, 0, 1)
    q = q * scale
    G = g.cumsum(-2)
    strict = torch.tril(torch.ones(C, C, dtype=torch.bool, device=q.device), -1)
    causal = torch.tril(torch.ones(C, C, dtype=torch.bool, device=q.device))
    eye = torch.eye(C, dtype=q.dtype, device=q.device)
    out = q.new_empty(H, q.shape[1], C, dv)
    # NOTE: one chunk at a time, so the [H, C, C, dk] decay tensor is the peak (not [H, T, C, dk]).
    for n in range(q.shape[1]):
        qn, kn, vn, Gn, bn = q[:, n], k[:, n], v[:, n], G[:, n], beta[:, n]
        decay = Gn.unsqueeze(-2) - Gn.unsqueeze(-3)  # [H, C(i), C(j), dk] = G_i - G_j
        decay = torch.where(causal[..., None], decay, torch.full_like(decay, float("-inf"))).exp()
        L = (bn.unsqueeze(-1) * torch.einsum("hid,hjd,hijd->hij", kn, kn, decay)).masked_fill(~strict, 0)
        Tinv = torch.linalg.solve_triangular(eye + L, eye.expand_as(L), upper=False, unitriangular=True)
        u = Tinv @ (bn.unsqueeze(-1) * vn)
        w = Tinv @ (bn.unsqueeze(-1) * kn * Gn.exp())
        Aqk = torch.einsum("hid,hjd,hijd->hij", qn, kn, decay).masked_fill(~causal, 0)
        v_new = u - w @ S
        out[:, n] = (qn * Gn.exp()) @ S + Aqk @ v_new
        G_last = Gn[:, -1]  # [H, dk]
        S = S * G_last.exp().unsqueeze(-1) + (kn * (G_last.unsqueeze(1) - Gn).exp()).transpose(-1, -2) @ v_new
    o[:] = out.permute(1, 2, 0, 3).reshape(-1, H, dv)[:T]
    return o, S


def _recurrent_fn(device: torch.device):
    """The Triton recurrent kernel on CUDA (``layers/kda_triton.py``), the reference elsewhere."""
    if device.type == "cuda":
        from longflash.layers.kda_triton import kda_recurrent_triton
        return kda_recurrent_triton
    return kda_recurrent


def _chunked_fn(device: torch.device):
    """The Triton chunked kernel on CUDA (``layers/kda_chunked_triton.py``), the reference elsewhere."""
    if device.type == "cuda":
        from longflash.layers.kda_chunked_triton import kda_chunked_triton
        return kda_chunked_triton
    return kda_chunked


class KimiDeltaAttention(nn.Module):
    """One KDA layer with checkpoint names (``shared/specs/kimi_k3_checkpoint.md`` §4, Kimi-Linear):
    ``{q,k,v}_proj``, ``{q,k,v}_conv1d`` [P, 1, K], ``f_a_proj``, ``f_b_proj``, ``b_proj``, ``g_proj`` (full
    rank) or ``g_a_proj``/``g_b_proj``, ``A_log``, ``dt_bias``, ``o_norm``, ``o_proj``.

    ``A_log`` is a buffer filled through ``load_checkpoint_tensor``: accepted as [H], [1, 1, H, 1] or a
    longer 1-D vector (Kimi-K3 pads it to 128; the first H are used). ``state_pool``/``state_layer``
    are set by the model runner; without a pool every forward starts from a zero state.

    ``chunk_size``: tokens per chunk of the prefill form (None: each form's default, 64 for the reference on
    the CPU, ``KERNEL_CHUNK_SIZE`` = 16 for the Triton kernel on CUDA; the result does not depend on it).

    forward: hidden [T, hidden_size] -> [T, hidden_size] (reads the forward context:
    ``query_start_loc_cpu``, ``context_lens_cpu``, ``is_decode`` and ``extras["state_slots"]``).
    """

    def __init__(self, hidden_size: int, num_heads: int, head_dim: int, conv_kernel_size: int = 4,
                 rms_norm_eps: float = 1e-5, full_rank_gate: bool = False, gate_lower_bound: float | None = None,
                 chunk_size: int | None = None):
        super().__init__()
        P = num_heads * head_dim
        self.num_heads, self.head_dim, self.conv_kernel_size = num_heads, head_dim, conv_kernel_size
        self.eps, self.gate_lower_bound, self.chunk_size = rms_norm_eps, gate_lower_bound, chunk_size
        self.scale = head_dim ** -0.5
        self.q_proj = nn.Linear(hidden_size, P, bias=False)
        self.k_proj = nn.Linear(hidden_size, P, bias=False)
        self.v_proj = nn.Linear(hidden_size, P, bias=False)
        self.q_conv1d = nn.Conv1d(P, P, conv_kernel_size, groups=P, bias=False)
        self.k_conv1d = nn.Conv1d(P, P, conv_kernel_size, groups=P, bias=False)
        self.v_conv1d = nn.Conv1d(P, P, conv_kernel_size, groups=P, bias=False)
        self.f_a_proj = nn.Linear(hidden_size, head_dim, bias=False)
        self.f_b_proj = nn.Linear(head_dim, P, bias=False)
        self.b_proj = nn.Linear(hidden_size, num_heads, bias=False)
        if full_rank_gate:
            self.g_proj = nn.Linear(hidden_size, P, bias=False)
        else:
            self.g_a_proj = nn.Linear(hidden_size, head_dim, bias=False)
            self.g_b_proj = nn.Linear(head_dim, P, bias=False)
        self.full_rank_gate = full_rank_gate
        self.dt_bias = nn.Parameter(torch.zeros(P))
        self.register_buffer("A_log", torch.zeros(num_heads))
        self.o_norm = nn.Module()
        self.o_norm.weight = nn.Parameter(torch.ones(head_dim))
        self.o_proj = nn.Linear(P, hidden_size, bias=False)
        self._A_log_loaded = False
        self.state_pool = None
        self.state_layer: int = -1

    def keep_fp32_(self) -> None:
        """Cast the tensors that Kimi checkpoints store in F32 (``A_log``, ``dt_bias``, ``{q,k,v}_conv1d``,
        ``o_norm``) back to fp32 after the model was cast to bf16 (the loader calls this)."""
        self.A_log = self.A_log.float()
        for p in (self.dt_bias, self.o_norm.weight, self.q_conv1d.weight, self.k_conv1d.weight, self.v_conv1d.weight):
            p.data = p.data.float()

    # ---- loading ----------------------------------------------------------------------------------
    def load_checkpoint_tensor(self, name: str, tensor: torch.Tensor) -> None:
        """Loader hook for ``A_log``. Raises ValueError for another name or a shape without H values."""
        if name != "A_log":
            raise ValueError(f"unexpected KDA tensor {name!r}")
        H = self.num_heads
        flat = tensor.reshape(-1) if tensor.dim() == 4 and tensor.numel() == H else tensor
        if flat.dim() != 1 or flat.numel() < H:
            raise ValueError(f"A_log has shape {list(tensor.shape)}; expected [{H}], [1, 1, {H}, 1] or a longer "
                             f"1-D vector whose first {H} values are used")
        with torch.no_grad():
            self.A_log.copy_(flat[:H].to(self.A_log.dtype))
        self._A_log_loaded = True

    def missing_checkpoint_tensors(self) -> list[str]:
        return [] if self._A_log_loaded else ["A_log"]

    # ---- state --------------------------------------------------------------------------------------
    def state_shapes(self) -> tuple[tuple[int, ...], tuple[int, ...]]:
        """(recurrent [H, dk, dv] fp32, conv [3P, K-1] model dtype) per request."""
        P = self.num_heads * self.head_dim
        return (self.num_heads, self.head_dim, self.head_dim), (3 * P, self.conv_kernel_size - 1)

    def conv_weight(self) -> torch.Tensor:
        """[3P, K]: the q | k | v depthwise kernels."""
        return torch.cat([self.q_conv1d.weight, self.k_conv1d.weight, self.v_conv1d.weight])[:, 0]

    def kernel_inputs(self, mixed: torch.Tensor, f: torch.Tensor, b: torch.Tensor):
        """Post-conv activations [T, 3P] + forget/beta projections -> (q, k, v, g, beta) of the delta rule."""
        T, H, d = mixed.shape[0], self.num_heads, self.head_dim
        q, k, v = mixed.float().view(T, 3, H, d).unbind(1)
        g = kda_gate(f, self.A_log[:H], self.dt_bias, d, self.gate_lower_bound)
        return l2norm(q), l2norm(k), v, g, torch.sigmoid(b.float())

    def _batched_decode(self, reqs: list[int], rows: list[int], slots: list[int], raw: torch.Tensor,
                        f: torch.Tensor, b: torch.Tensor, w: torch.Tensor, o: torch.Tensor) -> None:
        """One token for each of B requests whose state is in the pool: gather, step, scatter."""
        H, d, B = self.num_heads, self.head_dim, len(rows)
        pool, layer = self.state_pool, self.state_layer
        rows_t = torch.tensor(rows, dtype=torch.long, device=raw.device)
        slots_t = torch.tensor(slots, dtype=torch.long, device=raw.device)
        S0, c0 = pool.recurrent[layer][slots_t], pool.conv[layer][slots_t]
        mixed, c1 = causal_conv1d_update(raw[rows_t], c0, w)
        q, k, v, g, beta = self.kernel_inputs(mixed, f[rows_t], b[rows_t])  # [B, H, d], beta [B, H]
        ob, S1 = _recurrent_fn(raw.device)(q.reshape(1, B * H, d), k.reshape(1, B * H, d), v.reshape(1, B * H, d),
                                           g.reshape(1, B * H, d), beta.reshape(1, B * H),
                                           S0.reshape(B * H, d, d), self.scale)
        o[rows_t] = ob.view(B, H, d)
        pool.recurrent[layer][slots_t] = S1.view(B, H, d, d)
        pool.conv[layer][slots_t] = c1.to(pool.conv[layer].dtype)

    def _chunked_prefill(self, prefills: list, o: torch.Tensor) -> None:
        """All prefill pieces of a step in one varlen chunked call (``cu_seqlens``), then their states written.

        prefills: (start, end, slot or None, (q, k, v, g, beta), initial state [H, dk, dv], new conv state).
        """
        qkvgb = [torch.cat([p[3][j] for p in prefills]) for j in range(5)]
        lens = [e - s for s, e, *_ in prefills]
        cu = [0]
        for n in lens:
            cu.append(cu[-1] + n)
        S0 = torch.stack([p[4] for p in prefills])  # a copy: the slots are written below
        ob, S1 = _chunked_fn(o.device)(*qkvgb, S0, self.scale, self.chunk_size, cu_seqlens=cu)
        for n, (s, e, slot, _, _, c1) in enumerate(prefills):
            o[s:e] = ob[cu[n]:cu[n + 1]]
            if slot is not None:
                self.state_pool.write(self.state_layer, slot, S1[n], c1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        ctx = get_forward_context()
        T, H, d = x.shape[0], self.num_heads, self.head_dim
        raw = torch.cat([self.q_proj(x), self.k_proj(x), self.v_proj(x)], dim=-1)  # [T, 3P]
        f = self.f_b_proj(self.f_a_proj(x))
        b = self.b_proj(x)
        gate = self.g_proj(x) if self.full_rank_gate else self.g_b_proj(self.g_a_proj(x))
        w = self.conv_weight()
        o = torch.empty(T, H, d, dtype=torch.float32, device=x.device)
        slots = ctx.extras.get("state_slots")
        verify = ctx.extras.get("state_verify")
        pool = self.state_pool
        rec_shape, conv_shape = self.state_shapes()
        qsl = ctx.query_start_loc_cpu
        batched = []
        if pool is not None and slots is not None:
            # NOTE: plain decodes (one token, state in the pool, not a verify) run as one batch: the B
            # requests' heads are stacked into B*H heads of one recurrent call.
            batched = [i for i in range(ctx.num_reqs) if ctx.is_decode[i] and qsl[i + 1] - qsl[i] == 1
                       and ctx.context_lens_cpu[i] > 0 and not (verify is not None and verify[i])]
            if batched:
                self._batched_decode(batched, [qsl[i] for i in batched], [slots[i] for i in batched],
                                     raw, f, b, w, o)
        skip = set(batched)
        prefills = []
        for i in range(ctx.num_reqs):
            s, e = qsl[i], qsl[i + 1]
            if e == s or i in skip:
                continue
            slot = slots[i] if (pool is not None and slots is not None) else None
            if slot is None or ctx.context_lens_cpu[i] == 0:
                S0 = torch.zeros(rec_shape, dtype=torch.float32, device=x.device)
                c0 = torch.zeros(conv_shape, dtype=raw.dtype, device=x.device)
            else:
                S0, c0 = pool.read(self.state_layer, slot)
            mixed, c1 = causal_conv1d(raw[s:e], c0, w)
            q, k, v, g, beta = self.kernel_inputs(mixed, f[s:e], b[s:e])
            if not ctx.is_decode[i]:
                prefills.append((s, e, slot, (q, k, v, g, beta), S0, c1))
                continue
            o[s:e], S1 = _recurrent_fn(x.device)(q, k, v, g, beta, S0, self.scale)
            if slot is not None:
                if verify is not None and verify[i]:  # before the write: S0, c0 are views of the slot
                    pool.record_verify(self.state_layer, slot, S0, c0, raw[s:e], k, v, g, beta)
                pool.write(self.state_layer, slot, S1, c1)
        if prefills:
            self._chunked_prefill(prefills, o)
        # gated RMSNorm over dv, fp32 (HF KimiLinearRMSNormGated)
        var = o.pow(2).mean(-1, keepdim=True)
        y = o * torch.rsqrt(var + self.eps) * self.o_norm.weight.float()
        y = y * torch.sigmoid(gate.float().view(T, H, d))
        return self.o_proj(y.to(x.dtype).reshape(T, H * d))
