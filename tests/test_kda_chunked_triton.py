"""The Triton chunked KDA kernel equals the PyTorch reference ``kda_chunked``: on the CPU under
``TRITON_INTERPRET=1`` (in a subprocess: the variable must be set before Triton is imported) at small shapes,
on the GPU at Kimi-Linear shapes (32 heads x 128). Cases cover lengths that are not multiples of the block,
several sequences through ``cu_seqlens`` (one of them empty), initial states, dk/dv that are not powers of
two, both gates, and decays strong enough to take the elementwise (non-factored) path."""

import json
import os
import subprocess
import sys

import pytest
import torch

# (name, per-sequence lengths or None for one sequence of T, T, H, dk, dv, chunk_size, gate)
#   gate: "k3" = Kimi-K3 (-5 * sigmoid), "linear" = Kimi-Linear (-exp(A_log) * softplus), "strong" = Kimi-Linear
#   with exp(A_log) ~ 20 (a 16-token block decays by more than SAFE_LOG_DECAY), "repeat" = one key for every
#   token, beta 0.99 and almost no decay (L ~ all ones below the diagonal: the hard case for the inverse)
CASES = [
    ("one-seq", None, 37, 2, 16, 32, 16, "k3"),
    ("varlen", [5, 0, 35, 33], 73, 2, 32, 24, 16, "linear"),
    ("strong", [20, 13], 33, 1, 16, 16, 16, "strong"),
    ("strong-32", None, 45, 1, 20, 16, 32, "strong"),
    ("chunk-64", None, 70, 1, 16, 16, 64, "k3"),
    ("empty", None, 0, 2, 16, 16, 16, "k3"),
    ("repeat", None, 40, 1, 16, 16, 16, "repeat"),
]


def _inputs(T, H, dk, dv, gate, n_states, device="cpu", seed=0):
    from longflash.layers.kda import kda_gate, l2norm
    g = torch.Generator().manual_seed(seed)
    q = l2norm(torch.randn(T, H, dk, generator=g))
    k = l2norm(torch.randn(T, H, dk, generator=g))
    v = torch.randn(T, H, dv, generator=g)
    f = torch.randn(T, H * dk, generator=g)
    dt_bias = torch.randn(H * dk, generator=g)
    if gate == "k3":
        g_ = kda_gate(f, torch.randn(H, generator=g), dt_bias, dk, -5.0)
    elif gate == "linear":
        g_ = kda_gate(f, torch.randn(H, generator=g) * 0.5 - 1.0, dt_bias, dk, None)
    elif gate == "strong":
        g_ = kda_gate(f + 2.0, torch.full((H,), 3.0), dt_bias, dk, None)
    else:
        g_ = kda_gate(f, torch.full((H,), -8.0), dt_bias, dk, None)
    beta = torch.rand(T, H, generator=g)
    if gate == "repeat":
        k = k[:1].expand_as(k).contiguous()
        beta = torch.full((T, H), 0.99)
    S0 = torch.randn(*([n_states] if n_states else []), H, dk, dv, generator=g)
    return tuple(t.to(device) for t in (q, k, v, g_, beta, S0))


def _max_block_decay(gate: torch.Tensor, cu: list[int], C: int) -> float:
    """max |G| over the kernel's blocks (G = cumulative log decay from each block's start)."""
    worst = 0.0
    for s, e in zip(cu[:-1], cu[1:]):
        for b in range(s, e, C):
            worst = max(worst, gate[b:min(b + C, e)].cumsum(0).abs().max().item())
    return worst


def _errors(device: str) -> dict:
    from longflash.layers.kda import kda_chunked
    from longflash.layers.kda_chunked_triton import SAFE_LOG_DECAY, kda_chunked_triton
    out = {}
    for i, (name, lens, T, H, dk, dv, C, gate) in enumerate(CASES):
        q, k, v, g_, beta, S0 = _inputs(T, H, dk, dv, gate, len(lens) if lens else 0, seed=i)
        cu = [0] + torch.tensor(lens).cumsum(0).tolist() if lens else None
        o_ref, s_ref = kda_chunked(q, k, v, g_, beta, S0, dk ** -0.5, C, cu_seqlens=cu)
        o, s = kda_chunked_triton(*(t.to(device) for t in (q, k, v, g_, beta, S0)), dk ** -0.5, C, cu_seqlens=cu)
        assert o.shape == o_ref.shape and s.shape == s_ref.shape and o.dtype == s.dtype == torch.float32
        err = max(((o.cpu() - o_ref).abs().max().item() / max(1.0, o_ref.abs().max().item())) if T else 0.0,
                  (s.cpu() - s_ref).abs().max().item() / max(1.0, s_ref.abs().max().item()))
        decay = _max_block_decay(g_, cu or [0, T], C) if T else 0.0
        out[name] = {"err": err, "factored": decay <= SAFE_LOG_DECAY}
    return out


def test_chunked_triton_equals_reference():
    if torch.cuda.is_available():
        res = _errors("cuda")
    else:
        root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))  # importable without an install
        env = dict(os.environ, TRITON_INTERPRET="1", PYTHONPATH=os.pathsep.join([root, os.environ.get("PYTHONPATH", "")]))
        r = subprocess.run([sys.executable, __file__], env=env, capture_output=True, text=True, timeout=600)
        assert r.returncode == 0, r.stderr[-4000:]
        res = json.loads(r.stdout.strip().splitlines()[-1])
    assert set(res) == {c[0] for c in CASES}
    assert max(v["err"] for v in res.values()) <= 2e-5, res
    # both the factored (tensor-core) path and the elementwise path of strong decays were exercised
    assert res["one-seq"]["factored"] and res["varlen"]["factored"], res
    assert not res["strong"]["factored"] and not res["strong-32"]["factored"], res


def test_chunked_triton_rejects_bad_input():
    from longflash.layers.kda_chunked_triton import kda_chunked_triton
    q, k, v, g_, beta, S0 = _inputs(8, 2, 16, 16, "k3", 0)
    with pytest.raises(ValueError, match="chunk_size"):
        kda_chunked_triton(q, k, v, g_, beta, S0, 0.25, 48)
    with pytest.raises(ValueError, match="cu_seqlens"):
        kda_chunked_triton(q, k, v, g_, beta, S0[None].expand(2, -1, -1, -1), 0.25, 16, cu_seqlens=[0, 9, 8])
    with pytest.raises(ValueError, match="state"):
        kda_chunked_triton(q, k, v, g_, beta, S0, 0.25, 16, cu_seqlens=[0, 3, 8])
    with pytest.raises(ValueError, match="block_v"):
        kda_chunked_triton(q, k, v, g_, beta, S0, 0.25, 16, config={"block_v": 24})
    with pytest.raises(ValueError, match="inconsistent"):
        kda_chunked_triton(q, k[:, :1], v, g_, beta, S0, 0.25)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU")
@pytest.mark.parametrize("lens", [[1000], [300, 0, 517, 64]])
def test_gpu_chunked_equals_reference_at_kimi_linear_shapes(lens):
    """32 heads x 128, K3 and Kimi-Linear gates; the reference runs on the GPU in fp32 (no TF32)."""
    from longflash.layers.kda import kda_chunked
    from longflash.layers.kda_chunked_triton import kda_chunked_triton
    torch.backends.cuda.matmul.allow_tf32 = False
    T = sum(lens)
    cu = [0] + torch.tensor(lens).cumsum(0).tolist()
    for gate in ("k3", "linear"):
        q, k, v, g_, beta, S0 = _inputs(T, 32, 128, 128, gate, len(lens), device="cuda", seed=T)
        o_ref, s_ref = kda_chunked(q, k, v, g_, beta, S0, 128 ** -0.5, cu_seqlens=cu)
        o, s = kda_chunked_triton(q, k, v, g_, beta, S0, 128 ** -0.5, cu_seqlens=cu)
        assert (o - o_ref).abs().max().item() <= 1e-4 * max(1.0, o_ref.abs().max().item())
        assert (s - s_ref).abs().max().item() <= 1e-4 * max(1.0, s_ref.abs().max().item())


if __name__ == "__main__":
    print(json.dumps(_errors("cpu")))
