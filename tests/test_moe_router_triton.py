"""The one-launch MoE router (``moe_router_triton.topk_routing_triton``) equals the reference
``moe.topk_routing``: on the CPU under ``TRITON_INTERPRET=1`` (a subprocess: set before Triton is imported)
at small and model shapes (sigmoid/softmax, with and without bias, groups of one or several experts, a
non-power-of-two group count, strided logits), with exact ties resolved to the lowest ids (the stable-sort
oracle below), and a hand-computed grouped example; the kernel compiles for sm_90 without a GPU; on the
GPU at the default model's and DeepSeek-V3 / Kimi shapes (fp32 and bf16 activations), under a CUDA graph,
and the one-launch expert alignment keeps ``align_by_expert``'s layout."""

import json
import math
import os
import subprocess
import sys

import pytest
import torch
import torch.nn.functional as F

from longflash.layers.moe import TopkRouter, topk_routing
from longflash.layers.moe_grouped import align_by_expert, expert_align

# (T, E, k, n_group, topk_group, scoring_func, bias, norm_topk_prob, routed_scaling_factor)
_CASES = [(0, 8, 2, 1, 1, "sigmoid", True, True, 1.0), (1, 8, 2, 1, 1, "sigmoid", True, True, 1.0),
          (9, 8, 2, 1, 1, "sigmoid", True, True, 1.0), (7, 24, 3, 4, 2, "softmax", False, False, 1.0),
          (6, 48, 6, 8, 3, "softmax", True, True, 1.0), (4, 256, 8, 8, 4, "sigmoid", True, True, 2.5),
          (3, 384, 8, 1, 1, "sigmoid", True, True, 2.827), (2, 896, 16, 1, 1, "sigmoid", True, True, 1.0),
          (3, 12, 4, 12, 4, "sigmoid", True, True, 1.0), (5, 40, 5, 5, 5, "sigmoid", True, False, 1.5),
          (4, 20, 1, 1, 1, "sigmoid", False, True, 1.0)]
# model shapes for the GPU: (name, H, E, k, n_group, topk_group, routed_scaling_factor)
_MODELS = [("default", 256, 8, 2, 1, 1, 1.0), ("deepseek_v3", 7168, 256, 8, 8, 4, 2.5),
           ("kimi_k2", 7168, 384, 8, 1, 1, 2.827), ("kimi_k3", 7168, 896, 16, 1, 1, 1.0)]


def _inputs(T, E, bias, seed, device="cpu", strided=False):
    g = torch.Generator().manual_seed(seed)
    logits = torch.randn(T, E + 3 if strided else E, generator=g) * 2
    logits = logits[:, :E] if strided else logits
    b = torch.randn(E, generator=g) * 0.3 if bias else None
    return logits.to(device), (b.to(device) if b is not None else None)


def _compare(got, ref) -> dict:
    """Ids as sets per row (the reference's slot order is unspecified), weights matched by id."""
    (gw, gi), (rw, ri) = got, ref
    if gi.numel() == 0:
        return dict(shape=list(gi.shape) == list(ri.shape), ascending=True, same_ids=True, rel=0.0)
    rs, ro = ri.sort(1)
    return dict(shape=list(gi.shape) == list(ri.shape) and gw.dtype == torch.float32 and gi.dtype == torch.int64,
                ascending=bool((gi[:, 1:] > gi[:, :-1]).all()), same_ids=bool(torch.equal(gi, rs)),
                rel=float((gw - rw.gather(1, ro)).abs().max() / rw.abs().max().clamp_min(1e-30)))


def _tie_oracle(logits, bias, k, n_group, topk_group):
    """Chosen ids (ascending) when ties go to the lowest ids: stable descending sorts of the choice scores."""
    T, E = logits.shape
    choice = logits.sigmoid() + (bias if bias is not None else 0)
    if n_group > 1:
        grouped = choice.view(T, n_group, E // n_group)
        best = grouped.sort(dim=-1, descending=True, stable=True)[0]
        gscore = best[..., :2].sum(-1) if best.shape[-1] >= 2 else best[..., 0]
        keep = torch.zeros(T, n_group, dtype=torch.bool)
        keep.scatter_(1, gscore.sort(dim=-1, descending=True, stable=True)[1][:, :topk_group], True)
        choice = choice.masked_fill(~keep.repeat_interleave(E // n_group, 1), float("-inf"))
    return choice.sort(dim=-1, descending=True, stable=True)[1][:, :k].sort(1)[0]


_TIE_CASES = [(6, 40, 6, 1, 1), (6, 32, 4, 4, 2), (5, 16, 5, 16, 3), (4, 64, 8, 8, 3)]


def _tied_logits(T, E, seed):
    return torch.randint(-2, 3, (T, E), generator=torch.Generator().manual_seed(seed)).float() / 2


def _hand_example():
    """E = 8 in 4 groups of 2, keep 2 groups, k = 2. Group scores (sum of both sigmoids): g0 = s(3) + s(-3)
    = 1, g1 = s(2) + s(1.9) = 1.75, g2 = s(2.5) + s(-5) = 0.93, g3 = 0.04: g1 and g0 stay, so expert 4
    (logit 2.5, second best overall) is out and the choice is {0, 2}."""
    logits = torch.tensor([[3.0, -3.0, 2.0, 1.9, 2.5, -5.0, -4.0, -4.0]])
    s = torch.sigmoid(torch.tensor([3.0, 2.0]))
    return logits, torch.tensor([[0, 2]]), (s / s.sum() * 2.5)[None]


def _interpreter_check() -> dict:
    from longflash.layers.moe_router_triton import topk_routing_triton
    out = {}
    for i, (T, E, k, ng, tg, sf, bias, renorm, scale) in enumerate(_CASES):
        logits, b = _inputs(T, E, bias, seed=i, strided=i % 3 == 1)
        args = (b, k, ng, tg, renorm, scale, sf)
        out[f"T{T}-E{E}-k{k}-g{ng}/{tg}-{sf}"] = _compare(topk_routing_triton(logits, *args), topk_routing(logits, *args))
    # activations in bf16: the logits are still one fp32 GEMM
    x = torch.randn(5, 64, generator=torch.Generator().manual_seed(7)).bfloat16()
    w = torch.randn(256, 64, generator=torch.Generator().manual_seed(8)) * 0.1
    logits, b = F.linear(x.float(), w), torch.randn(256, generator=torch.Generator().manual_seed(9)) * 0.1
    out["bf16-x-dsv3"] = _compare(topk_routing_triton(logits, b, 8, 8, 4, True, 2.5),
                                  topk_routing(logits, b, 8, 8, 4, True, 2.5))
    ties = {}
    for i, (T, E, k, ng, tg) in enumerate(_TIE_CASES):
        logits = _tied_logits(T, E, seed=i)
        bias = torch.zeros(E) if i % 2 else None
        ties[f"T{T}-E{E}-k{k}-g{ng}/{tg}"] = bool(torch.equal(topk_routing_triton(logits, bias, k, ng, tg)[1],
                                                              _tie_oracle(logits, bias, k, ng, tg)))
    logits, want_ids, want_w = _hand_example()
    hw, hi = topk_routing_triton(logits, None, 2, 4, 2, True, 2.5)
    return dict(cases=out, ties=ties, hand=[hi.tolist() == want_ids.tolist(),
                                            float((hw - want_w).abs().max())])


def test_reference_hand_example():
    logits, want_ids, want_w = _hand_example()
    w, ids = topk_routing(logits, None, 2, 4, 2, True, 2.5)
    order = ids.sort(1)[1]
    assert ids.gather(1, order).tolist() == want_ids.tolist()
    assert float((w.gather(1, order) - want_w).abs().max()) <= 1e-6
    # without groups the second expert is 4 (logit 2.5)
    assert sorted(topk_routing(logits, None, 2)[1][0].tolist()) == [0, 4]


def test_router_forward_is_linear_then_routing():
    router = TopkRouter(16, 12, 3, n_group=4, topk_group=2, routed_scaling_factor=1.5)
    with torch.no_grad():
        router.weight.copy_(torch.randn(12, 16, generator=torch.Generator().manual_seed(0)))
        router.e_score_correction_bias.copy_(torch.randn(12, generator=torch.Generator().manual_seed(1)) * 0.1)
    x = torch.randn(5, 16, generator=torch.Generator().manual_seed(2)).bfloat16()
    w, ids = router(x)
    rw, ri = topk_routing(F.linear(x.float(), router.weight), router.e_score_correction_bias, 3, 4, 2, True, 1.5)
    assert torch.equal(ids, ri) and torch.equal(w, rw)


@pytest.mark.parametrize("bad, match", [
    (dict(logits=torch.zeros(2, 3, 8)), "must be \\[T, num_experts\\]"),
    (dict(bias=torch.zeros(7)), "e_score_correction_bias must be \\[8\\]"),
    (dict(k=9), "top_k \\(9\\)"), (dict(k=0), "top_k \\(0\\)"),
    (dict(n_group=3), "divisible by n_group"), (dict(n_group=4, topk_group=5), "topk_group \\(5\\)"),
    (dict(scoring_func="relu"), "scoring_func"), (dict(logits=torch.zeros(2, 8, dtype=torch.int32)), "floating"),
])
def test_bad_arguments_raise(bad, match):
    from longflash.layers.moe_router_triton import topk_routing_triton
    a = dict(logits=torch.zeros(2, 8), bias=torch.zeros(8), k=2, n_group=1, topk_group=1, scoring_func="sigmoid")
    a.update(bad)
    for fn in (topk_routing, topk_routing_triton):  # the launcher checks before it launches anything
        with pytest.raises(ValueError, match=match):
            fn(a["logits"], a["bias"], a["k"], a["n_group"], a["topk_group"], True, 1.0, a["scoring_func"])


def test_triton_launcher_only_limits():
    from longflash.layers.moe_router_triton import MAX_EXPERTS, topk_routing_triton
    with pytest.raises(ValueError, match="must be fp32"):
        topk_routing_triton(torch.zeros(2, 8, dtype=torch.bfloat16), None, 2)
    with pytest.raises(ValueError, match="exceeds the fused router's limit"):
        topk_routing_triton(torch.zeros(1, MAX_EXPERTS * 2), None, 2)


def test_kernel_equals_reference_interpreter():
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    env = dict(os.environ, TRITON_INTERPRET="1", PYTHONPATH=os.pathsep.join([root, os.environ.get("PYTHONPATH", "")]))
    res = subprocess.run([sys.executable, os.path.abspath(__file__)], env=env, capture_output=True, text=True,
                         timeout=300)
    assert res.returncode == 0, res.stderr[-3000:]
    r = json.loads(res.stdout.strip().splitlines()[-1])
    assert len(r["cases"]) == len(_CASES) + 1
    for key, v in r["cases"].items():
        # NumPy's exp (interpreter) vs torch's CPU exp: a few ulps of the scores
        assert v["shape"] and v["ascending"] and v["same_ids"] and v["rel"] <= 1e-6, (key, v)
    assert len(r["ties"]) == len(_TIE_CASES) and all(r["ties"].values()), r["ties"]
    assert r["hand"][0] and r["hand"][1] <= 1e-6, r["hand"]


_SM90_SCRIPT = r"""
import json, re, triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource
from longflash.layers.moe_router_triton import _topk_routing_kernel as kern, _IDX_BITS
idx = kern.arg_names.index
out = {}
for ng, gs, k, tg, soft, warps in [(1, 8, 2, 1, False, 1), (8, 32, 8, 4, False, 2), (1, 896, 16, 1, False, 4),
                                   (1, 384, 8, 1, True, 2)]:
    consts = dict(N_GROUP=ng, GROUP_SIZE=gs, NG_P=triton.next_power_of_2(ng), GS_P=triton.next_power_of_2(gs),
                  TOP_K=k, TOPK_GROUP=tg, HAS_BIAS=True, SOFTMAX=soft, RENORM=True, INTERPRET=False,
                  IDX_BITS=_IDX_BITS)
    sig = dict(logits_ptr="*fp32", bias_ptr="*fp32", w_ptr="*fp32", ids_ptr="*i64", stride_l="i32", scale="fp32")
    sig.update({c: "constexpr" for c in consts})
    src = ASTSource(fn=kern, signature=sig, constexprs={(idx(n),): v for n, v in consts.items()})
    c = triton.compile(src, target=GPUTarget("cuda", 90, 32), options=dict(num_warps=warps))
    ptx = c.asm["ptx"]
    out[f"g{ng}x{gs}-k{k}-softmax={soft}"] = dict(ok=bool(c.asm.get("cubin")), shared=c.metadata.shared,
                                                 div_rn=len(re.findall(r"div\.rn\.f32", ptx)),
                                                 div_approx=len(re.findall(r"div\.(approx|full)", ptx)))
print("RESULT" + json.dumps(out))
"""


def test_kernel_compiles_for_sm90_without_a_gpu():
    """The GPU path (libdevice exp, IEEE division, int64 keys) compiles for sm_90 with Triton's ptxas; every
    division is div.rn (PyTorch's CUDA division), none approximate."""
    triton = pytest.importorskip("triton")
    if not os.path.exists(os.path.join(os.path.dirname(triton.__file__), "backends/nvidia/bin/ptxas")):
        pytest.skip("Triton's bundled ptxas is not available")
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["PYTHONPATH"] = os.pathsep.join([os.path.dirname(os.path.dirname(os.path.abspath(__file__))),
                                         env.get("PYTHONPATH", "")])
    proc = subprocess.run([sys.executable, "-c", _SM90_SCRIPT], capture_output=True, text=True, env=env, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    res = json.loads([ln for ln in proc.stdout.splitlines() if ln.startswith("RESULT")][-1][len("RESULT"):])
    assert len(res) == 4, res
    for key, v in res.items():
        assert v["ok"] and v["div_rn"] > 0 and v["div_approx"] == 0 and v["shared"] <= 4096, (key, v)


# ---------------------------------------------------------------------------------------------- GPU

def _router(H, E, k, ng, tg, scale, scoring="sigmoid", seed=0):
    router = TopkRouter(H, E, k, ng, tg, routed_scaling_factor=scale, scoring_func=scoring).cuda()
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        router.weight.copy_(torch.randn(E, H, generator=g) / math.sqrt(H))
        router.e_score_correction_bias.copy_(torch.randn(E, generator=g) * 0.05)
    return router


def _near_tie_rows(logits, bias, k, rows):
    """True when each row in ``rows`` has its k-th and (k+1)-th softmax choice scores within 1e-6 relative
    (ungrouped routing): the only rows where an ulp of the softmax sum may change the chosen set."""
    c = (logits[rows].softmax(-1) + bias).sort(-1, descending=True)[0]
    return bool(((c[:, k - 1] - c[:, k]).abs() <= 1e-6 * c[:, k - 1].abs()).all())


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_router_gpu_model_shapes():
    """TopkRouter on CUDA (the kernel) equals the reference on CUDA at the model shapes, bf16 and fp32
    activations: sigmoid ids as sets in every row, weights within fp32 rounding, and without
    renormalisation the weights within one ulp (the scores are bitwise; the factor multiplies once).
    Softmax (ungrouped models): ids differ only in rows with a near tie at the k-th place."""
    bad = {}
    for name, H, E, k, ng, tg, scale in _MODELS:
        for scoring in ("sigmoid", "softmax") if ng == 1 else ("sigmoid",):
            router = _router(H, E, k, ng, tg, scale, scoring)
            bias = router.e_score_correction_bias
            for dtype in (torch.bfloat16, torch.float32):
                for T in (1, 16, 128, 1000):
                    x = torch.randn(T, H, device="cuda").to(dtype)
                    with torch.no_grad():
                        got = router(x)
                        logits = F.linear(x.float(), router.weight)
                        ref = topk_routing(logits, bias, k, ng, tg, True, scale, scoring)
                        router.norm_topk_prob = False
                        got_raw = router(x)
                        router.norm_topk_prob = True
                        ref_raw = topk_routing(logits, bias, k, ng, tg, False, scale, scoring)
                    differ = (got[1] != ref[1].sort(1)[0]).any(1)
                    if scoring == "softmax" and differ.any():
                        assert _near_tie_rows(logits, bias, k, differ.nonzero()[:, 0]), (name, dtype, T)
                        keep = ~differ
                        got, ref = (got[0][keep], got[1][keep]), (ref[0][keep], ref[1][keep])
                        got_raw, ref_raw = (got_raw[0][keep], got_raw[1][keep]), (ref_raw[0][keep], ref_raw[1][keep])
                    r, r_raw = _compare(got, ref), _compare(got_raw, ref_raw)
                    ok = r["shape"] and r["ascending"] and r["same_ids"] and r["rel"] <= 1e-6 and r_raw["same_ids"] \
                        and r_raw["rel"] <= (1.2e-7 if scoring == "sigmoid" else 1e-6)
                    if not ok:
                        bad[f"{name}-{scoring}-{dtype}-T{T}"] = (r, r_raw)
    assert not bad, bad


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_router_gpu_ties_and_cuda_graph():
    from longflash.layers.moe_router_triton import topk_routing_triton
    for i, (T, E, k, ng, tg) in enumerate(_TIE_CASES):  # exact ties: the lowest ids, as the stable oracle
        logits = _tied_logits(T, E, seed=i)
        got = topk_routing_triton(logits.cuda(), None, k, ng, tg)[1].cpu()
        assert torch.equal(got, _tie_oracle(logits, None, k, ng, tg)), (T, E, k, ng, tg)
    # capture the router and the expert alignment; replay with new activations
    router = _router(7168, 256, 8, 8, 4, 2.5)
    x = torch.randn(16, 7168, device="cuda")
    with torch.no_grad():
        s = torch.cuda.Stream()
        s.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(s):
            router(x)
        torch.cuda.current_stream().wait_stream(s)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            w, ids = router(x)
            rows, block_expert, num_blocks = expert_align(ids, 256, 16)
        x.copy_(torch.randn(16, 7168, device="cuda"))
        graph.replay()
        ew, eids = router(x)
        er, eb, en = expert_align(eids, 256, 16)
    assert torch.equal(ids, eids) and torch.equal(w, ew)
    assert torch.equal(block_expert, eb) and torch.equal(num_blocks, en)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_expert_align_gpu_keeps_the_layout():
    """expert_align on CUDA (one launch) vs align_by_expert: same blocks, experts, padding and block count,
    and each expert's rows (their order within the expert may differ)."""
    for T, k, E, bm in [(1, 2, 8, 16), (16, 8, 256, 16), (128, 16, 896, 16), (1000, 8, 384, 64), (4096, 8, 256, 64)]:
        ids = torch.stack([torch.randperm(E)[:k] for _ in range(T)]).cuda()
        ref = align_by_expert(ids, E, bm)
        got = expert_align(ids, E, bm)
        assert [t.shape for t in got] == [t.shape for t in ref]
        assert torch.equal(got[1], ref[1]) and torch.equal(got[2], ref[2])
        n = T * k
        assert torch.equal(got[0] >= n, ref[0] >= n)  # padding in the same places
        pairs = [(rows.long() + n * be.long().repeat_interleave(bm))[rows < n].sort()[0] for rows, be, _ in (got, ref)]
        assert torch.equal(*pairs), (T, k, E, bm)  # each expert's blocks hold the same rows


if __name__ == "__main__":
    print(json.dumps(_interpreter_check()))
