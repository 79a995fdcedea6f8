"""The varlen prefill kernel's work table (``triton_prefill.attention_with_lse_varlen``: one row per query
tile of each request with keys, longest first; requests without keys filled on the host) on seeded random
batches, CPU under ``TRITON_INTERPRET=1``: 1-6 requests whose query and key lengths are drawn from 0, 1,
BLOCK_M - 1, BLOCK_M, BLOCK_M + 1, 2·BLOCK_M (+1), 3·BLOCK_M and random values (zero-length queries and keys
anywhere, causal requests with more queries than keys), causal and not, pointer / TMA / paired-tile configs,
one KV head for several query heads, q a row slice of a larger tensor (the MLA prefill's ``q_new[rsel]``) and
v a split view of a wider projection. Each request gets exactly the single-request kernel's bits, and the
reference's result (fp32: output 1e-5, LSE 3e-5), with −inf LSE and zero output exactly where a query sees
no key. ``test_triton_prefill_varlen.py`` has hand-picked awkward batches."""

import pytest

from interpreter_run import run_interpreted

CASES = 36

_SCRIPT = r"""
import json, random
import torch
from longflash.attention import ops
from longflash.attention import triton_prefill as tp

TMA = dict(tp.INTERPRET_CONFIG, TMA=True)
OV = dict(TMA, OVERLAP=True)
BM = tp.INTERPRET_CONFIG["BLOCK_M"]
res = []
for seed in range(%(cases)d):
    rng = random.Random(seed)
    g = torch.Generator().manual_seed(seed)
    pick = lambda: rng.choice([0, 0, 1, BM - 1, BM, BM + 1, 2 * BM, 2 * BM + 1, 3 * BM, rng.randint(0, 3 * BM)])
    B = rng.randint(1, 6)
    causal = seed %% 2 == 0
    lq = [pick() for _ in range(B)]
    lk = list(lq) if causal and seed %% 4 == 0 else [pick() for _ in range(B)]
    cfg = [None, TMA, OV][seed %% 3]
    h = rng.choice([1, 2, 3])
    hk = rng.choice([1, h])
    d, dv = rng.choice([(48, 32), (24, 16)])
    pad = rng.randint(1, 3)
    q = (torch.randn(sum(lq) + pad + 1, h, d, generator=g) * 1.5)[pad:pad + sum(lq)]
    k = torch.randn(sum(lk), hk, d, generator=g) * 1.5
    v = torch.randn(sum(lk), hk, 16 + dv, generator=g)[..., 16:]
    out, lse = tp.attention_with_lse_varlen(q, k, v, 0.3, lq, lk, causal, config=cfg)
    not_single, qs, ks = [], 0, 0
    for b, (a, n) in enumerate(zip(lq, lk)):
        if a:
            o1, l1 = tp.attention_with_lse(q[qs:qs + a], k[ks:ks + n], v[ks:ks + n], 0.3, n - a if causal else None,
                                           config=cfg)
            if not (torch.equal(out[qs:qs + a], o1) and torch.equal(lse[qs:qs + a], l1)):
                not_single.append(b)
        qs, ks = qs + a, ks + n
    ro, rl = ops.attention_with_lse_varlen(q, k, v, 0.3, lq, lk, causal)
    empty = rl.isinf()
    res.append(dict(
        seed=seed, lq=lq, lk=lk, causal=causal, cfg=seed %% 3, not_single=not_single,
        inf_match=bool(torch.equal(lse.isinf(), empty)), empty_zero=bool((out[empty] == 0).all()),
        finite=bool(torch.isfinite(out).all()), n_empty=int(empty.sum()),
        keyless=sum(1 for a, n in zip(lq, lk) if a and not n),
        out_err=(out.double() - ro.double()).abs().max().item() if out.numel() else 0.0,
        lse_err=(lse - rl).masked_fill(empty, 0).abs().max().item() if lse.numel() else 0.0))
print("RESULT" + json.dumps(dict(block_m=BM, cases=res)))
""" % {"cases": CASES}


@pytest.fixture(scope="module")
def results():
    return run_interpreted(_SCRIPT)


def test_random_varlen_batches_are_the_single_request_kernel(results):
    bm, results = results["block_m"], results["cases"]
    assert len(results) == CASES
    bad = [c for c in results if c["not_single"] or not c["inf_match"] or not c["empty_zero"] or not c["finite"]
           or c["out_err"] > 1e-5 or c["lse_err"] > 3e-5]
    assert not bad, bad
    # the draws hold the awkward cases: requests without keys or queries, rows that see no key, tile-multiple
    # lengths, several tiles
    assert sum(c["keyless"] for c in results) >= 3
    assert any(0 in c["lq"] for c in results) and any(c["n_empty"] for c in results if c["causal"])
    assert any(n and n % bm == 0 for c in results for n in c["lq"])
    assert max(max(c["lq"]) for c in results) > 2 * bm
