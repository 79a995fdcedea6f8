"""The fp8 cache write's division on the GPU (``triton_ops._quantize_e4m3``, SCALE_MODE 3): the quotient
``x / k_scale`` from ``rcp = RN(1 / k_scale)`` and two FMA residual corrections, then E4M3.

The Triton interpreter's FMA is not fused, so the kernel path itself runs only on a GPU (test_fp8_kv_ops.py,
``test_gpu_fp8_of_every_bf16_value_and_every_byte_equals_reference``). Here the same operation sequence
is evaluated with an exact fp32 FMA emulated in float64 (exact product, TwoSum remainder, midpoint
fix-up) and compared with the correctly rounded quotient for every non-NaN bf16 value under many
scales: the fp32 quotients are equal wherever ``|x / k_scale| >= 2^-12`` (below that the residual can
underflow, and every such quotient stores as ±0, which is checked too), and every E4M3 byte equals
torch's conversion of the exact quotient.
"""
import numpy as np
import torch

F32, F64 = np.float32, np.float64


def _rn32(s: np.ndarray, err: np.ndarray) -> np.ndarray:
    """fp32 round-to-nearest-even of the exact value s + err (s = its float64 rounding)."""
    a = s.astype(F32)
    a64 = a.astype(F64)
    other = np.nextafter(a, np.where(s > a64, F32(np.inf), F32(-np.inf)).astype(F32))
    mid = ((a64 + other.astype(F64)) == 2 * s) & (s != a64)  # s exactly halfway between a and other
    return np.where(mid & (err != 0) & (np.sign(err) == np.sign(other.astype(F64) - a64)), other, a)


def _fma32(a, b, c) -> np.ndarray:
    p = a.astype(F64) * b.astype(F64)  # exact: 24 x 24 bits
    c64 = c.astype(F64)
    s = p + c64
    bb = s - p
    err = (p - (s - bb)) + (c64 - bb)  # TwoSum: s + err == p + c exactly
    return _rn32(s, np.where(np.isfinite(s), err, 0.0))


def _exact_div32(x: np.ndarray, s: F32) -> np.ndarray:
    """RN32(x / s): the float64 quotient rounded, then the nearest of it and its fp32 neighbours by the
    exact residual |x - s * c| (exact in float64 for these magnitudes), ties to even."""
    q = (x.astype(F64) / F64(s)).astype(F32)
    best = q
    for cand in (np.nextafter(q, F32(np.inf)), np.nextafter(q, F32(-np.inf))):
        db = np.abs(x.astype(F64) - F64(s) * best.astype(F64))
        dc = np.abs(x.astype(F64) - F64(s) * cand.astype(F64))
        better = (dc < db) | ((dc == db) & ((cand.view(np.int32) & 1) == 0))
        best = np.where(better & np.isfinite(q) & np.isfinite(cand), cand, best)
    return best


def _fma_corrected_div(x: np.ndarray, s: F32) -> np.ndarray:
    """SCALE_MODE 3 of ``_quantize_e4m3``, operation by operation."""
    rcp = np.full_like(x, F32(1.0 / F64(s)))  # the wrapper's RN32(1 / s) (float64 then fp32: safe)
    ns = np.full_like(x, -s)
    y = (x.astype(F64) * rcp.astype(F64)).astype(F32)
    y1 = _fma32(_fma32(y, ns, x), rcp, y)
    q = _fma32(_fma32(y1, ns, x), rcp, y1)
    q = np.where(np.abs(y) > 1048576.0, y, q)
    return ((q.view(np.int32) & 0x7FFFFFFF) | (x.view(np.int32) & np.int32(-2 ** 31))).view(np.float32)


def _e4m3(v: np.ndarray) -> torch.Tensor:
    return torch.from_numpy(v.copy()).clamp(-448, 448).to(torch.float8_e4m3fn).view(torch.uint8)


def test_fma_corrected_division_is_the_correctly_rounded_quotient_for_every_bf16():
    x = (np.arange(65536, dtype=np.uint32) << 16).view(np.float32)
    x = x[~np.isnan(x)]
    rng = np.random.default_rng(0)
    scales = [0.05, 0.1, 3.7, 1 / 200, 0.0123, 7.0, 1.1, 1.37 * 2.0 ** -60, 1.9 * 2.0 ** 59, 1.9999999, 1.0000001]
    scales += list(2.0 ** rng.uniform(-60, 60, 8)) + list(2.0 ** rng.uniform(-12, 6, 8))
    with np.errstate(over="ignore", invalid="ignore"):
        for s in (F32(v) for v in scales):
            want, got = _exact_div32(x, s), _fma_corrected_div(x, s)
            big = np.isfinite(want) & (np.abs(want) >= 2.0 ** -12) & (np.abs(want) < 2.0 ** 20)
            assert np.array_equal(want[big].view(np.int32), got[big].view(np.int32)), s
            assert (np.abs(got[np.abs(want) < 2.0 ** -12]) < 2.0 ** -11).all(), s
            assert torch.equal(_e4m3(want), _e4m3(got)), s
