"""The one-kernel Triton RMSNorm equals the reference ``norm.rms_norm``: on the CPU under
``TRITON_INTERPRET=1`` (a subprocess: set before Triton is imported) in fp32 and fp16 at awkward shapes
(0 rows, 1 row, widths that are not powers of two, 3-D input, a strided row view), and on the GPU in
bf16 at model widths. (bf16 is not checked in the interpreter: its fp32 -> bf16 cast truncates.)"""

import json
import os
import subprocess
import sys

import pytest
import torch

from longflash.layers.norm import rms_norm


def _cases(device="cpu", dtypes=(torch.float32, torch.float16)):
    g = torch.Generator().manual_seed(0)
    for dtype in dtypes:
        for shape in [(0, 48), (1, 48), (7, 48), (5, 3, 80), (33, 256), (2, 7168)]:
            x = (torch.randn(*shape, generator=g) * 3).to(device=device, dtype=dtype)
            w = (torch.rand(shape[-1], generator=g) + 0.5).to(device=device, dtype=dtype)
            yield f"{str(dtype)[6:]}-{shape}", x, w
        x = torch.randn(6, 96, generator=g).to(device=device, dtype=dtype)[:, :80]  # rows with a stride
        yield f"{str(dtype)[6:]}-strided", x, torch.ones(80, dtype=dtype, device=device)


def _ulps(got: torch.Tensor, ref: torch.Tensor) -> float:
    """Largest difference in units of the dtype's eps relative to max(1, |ref|) elementwise."""
    if ref.numel() == 0:
        return 0.0
    eps = torch.finfo(ref.dtype).eps
    return float(((got.float() - ref.float()).abs() / ref.float().abs().clamp(min=1.0)).max() / eps)


def _interpreter_check() -> dict:
    from longflash.layers.norm_triton import rms_norm_triton
    out = {k: [list(rms_norm_triton(x, w, 1e-6).shape) == list(x.shape), _ulps(rms_norm_triton(x, w, 1e-6),
                                                                                rms_norm(x, w, 1e-6))]
           for k, x, w in _cases()}
    out.update(_add_check())
    return out


def _add_check(device="cpu", dtypes=(torch.float32, torch.float16)) -> dict:
    """add_rms_norm_triton vs the reference add_rms_norm: the sum must be the PyTorch add exactly (0 ulps),
    the norm as for rms_norm; keys end in '-sum' and '-norm'."""
    from longflash.layers.norm import add_rms_norm
    from longflash.layers.norm_triton import add_rms_norm_triton
    g = torch.Generator().manual_seed(1)
    out = {}
    for k, x, w in _cases(device, dtypes):
        r = (torch.randn(x.shape, generator=g) * 2).to(device=device, dtype=x.dtype)
        (n_got, s_got), (n_ref, s_ref) = add_rms_norm_triton(x, r, w, 1e-6), add_rms_norm(x, r, w, 1e-6)
        ok = list(n_got.shape) == list(x.shape) and list(s_got.shape) == list(x.shape)
        out[f"add-{k}-sum"] = [ok, _ulps(s_got, s_ref) if s_ref.numel() else 0.0]
        out[f"add-{k}-norm"] = [ok, _ulps(n_got, n_ref)]
    return out


def test_rms_norm_triton_equals_reference_interpreter():
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    env = dict(os.environ, TRITON_INTERPRET="1", PYTHONPATH=os.pathsep.join([root, os.environ.get("PYTHONPATH", "")]))
    res = subprocess.run([sys.executable, os.path.abspath(__file__)], env=env, capture_output=True, text=True,
                         timeout=300)
    assert res.returncode == 0, res.stderr[-3000:]
    for key, (shape_ok, ulps) in json.loads(res.stdout.strip().splitlines()[-1]).items():
        # fp32: the mean's summation order (a few ulps); fp16: one rounding step of the output at most;
        # the residual sum of add_rms_norm: exactly the PyTorch add
        bound = 0 if key.endswith("-sum") else 8 if "float32" in key else 2
        assert shape_ok and ulps <= bound, (key, ulps)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_rms_norm_triton_gpu():
    from longflash.layers.norm_triton import rms_norm_triton
    for key, x, w in _cases("cuda", (torch.bfloat16, torch.float32)):
        assert _ulps(rms_norm_triton(x, w, 1e-6), rms_norm(x, w, 1e-6)) <= (8 if x.dtype == torch.float32 else 2), key
    for key, (shape_ok, ulps) in _add_check("cuda", (torch.bfloat16, torch.float32)).items():
        assert shape_ok and ulps <= (0 if key.endswith("-sum") else 8 if "float32" in key else 2), (key, ulps)


if __name__ == "__main__":
    print(json.dumps(_interpreter_check()))
