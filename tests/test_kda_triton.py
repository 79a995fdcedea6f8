"""The Triton recurrent KDA kernel equals the PyTorch reference: on the CPU under ``TRITON_INTERPRET=1``
(run in a subprocess, the variable must be set before Triton is imported), on the GPU directly.
Shapes include T = 0 and 1, dk not a power of two, dv wider than one BV block."""

import json
import os
import subprocess
import sys

import torch

SHAPES = [(0, 2, 8, 8), (1, 3, 16, 16), (5, 2, 12, 40), (4, 1, 32, 64)]


def _max_errors(device: str) -> list[float]:
    from longflash.layers.kda import kda_gate, kda_recurrent, l2norm
    from longflash.layers.kda_triton import kda_recurrent_triton
    errs = []
    for T, H, dk, dv in SHAPES:
        g = torch.Generator().manual_seed(T + 10 * dk)
        q = l2norm(torch.randn(T, H, dk, generator=g))
        k = l2norm(torch.randn(T, H, dk, generator=g))
        v = torch.randn(T, H, dv, generator=g)
        gate = kda_gate(torch.randn(T, H * dk, generator=g), torch.randn(H, generator=g),
                        torch.randn(H * dk, generator=g), dk, -5.0)
        beta = torch.rand(T, H, generator=g)
        S0 = torch.randn(H, dk, dv, generator=g)
        o_ref, s_ref = kda_recurrent(q, k, v, gate, beta, S0, dk ** -0.5)
        o, s = kda_recurrent_triton(*(t.to(device) for t in (q, k, v, gate, beta, S0)), dk ** -0.5)
        assert o.shape == o_ref.shape and s.shape == s_ref.shape
        errs.append(max((o.cpu() - o_ref).abs().max().item() if T else 0.0, (s.cpu() - s_ref).abs().max().item()))
    return errs


def test_recurrent_triton_equals_reference():
    if torch.cuda.is_available():
        errs = _max_errors("cuda")
    else:
        root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))  # importable without an install
        env = dict(os.environ, TRITON_INTERPRET="1", PYTHONPATH=os.pathsep.join([root, os.environ.get("PYTHONPATH", "")]))
        r = subprocess.run([sys.executable, __file__], env=env, capture_output=True, text=True, timeout=600)
        assert r.returncode == 0, r.stderr[-4000:]
        errs = json.loads(r.stdout.strip().splitlines()[-1])
    assert len(errs) == len(SHAPES) and max(errs) <= 1e-5, errs


if __name__ == "__main__":
    print(json.dumps(_max_errors("cpu")))
