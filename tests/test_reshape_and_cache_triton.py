"""``triton_ops.reshape_and_cache`` (GQA K/V cache write, one launch per plane) equals the PyTorch
reference ``ops.reshape_and_cache`` byte for byte: bf16 / fp32 / fp8 caches (fp8 with k_scale and
v_scale), strided rows (K and V as views of one fused projection), slot -1 skipped, block sizes 4 and
16. Runs the kernel under ``TRITON_INTERPRET=1`` in a subprocess (the flag must be set before Triton is
imported); a GPU twin runs when CUDA is available."""

import os
import subprocess
import sys

import pytest
import torch

SCRIPT = r'''
import torch
from longflash.attention import ops, triton_ops

def bytes_of(t):
    return t.view(torch.uint8) if t.dtype == torch.float8_e4m3fn else t.contiguous().view(torch.uint8)

dev = DEVICE
g = torch.Generator().manual_seed(0)
n = 0
for cache_dtype, in_dtype, scales in ((torch.bfloat16, torch.bfloat16, (None, None)),
                                      (torch.float32, torch.float32, (None, None)),
                                      (torch.float8_e4m3fn, torch.bfloat16, (0.37, 2.5)),
                                      (torch.float8_e4m3fn, torch.float32, (None, None))):
    for bs, kvh, hd in ((4, 2, 8), (16, 1, 64), (16, 2, 48)):
        T, nb, W = 11, 6, kvh * hd
        fused = (torch.randn(T, 2 * W, generator=g) * 3).to(in_dtype).to(dev)  # K | V of one projection
        k, v = fused[:, :W].view(T, kvh, hd), fused[:, W:].view(T, kvh, hd)
        slots = torch.randperm(nb * bs, generator=g)[:T]
        slots[[2, 7]] = -1
        slots = slots.to(dev)
        ref = [torch.zeros(nb, bs, kvh, hd, dtype=cache_dtype, device=dev) for _ in range(2)]
        out = [c.clone() for c in ref]
        ops.reshape_and_cache(k, v, ref[0], ref[1], slots, *scales)
        triton_ops.reshape_and_cache(k, v, out[0], out[1], slots, *scales)
        for a, b in zip(ref, out):
            assert torch.equal(bytes_of(a), bytes_of(b)), (cache_dtype, in_dtype, bs, kvh, hd)
        n += 1
print("CASES", n)
'''


def _run(device: str, env: dict) -> str:
    code = SCRIPT.replace("DEVICE", repr(device))
    r = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stdout + r.stderr
    return r.stdout


def test_triton_reshape_and_cache_equals_reference_under_interpreter():
    env = dict(os.environ, TRITON_INTERPRET="1")
    assert "CASES 12" in _run("cpu", env)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_gpu_reshape_and_cache_equals_reference():
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    assert "CASES 12" in _run("cuda", env)
