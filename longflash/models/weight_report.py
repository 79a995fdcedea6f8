"""Start-up report of model weight memory by dtype (what the weights occupy on the device).

MXFP4-packed routed experts are uint8 buffers (4-bit codes + E8M0 scales, 4.25 bits per weight); the
report also gives what the same experts would take in bf16, so the saving has its denominator.
"""

from __future__ import annotations

from torch import nn

from longflash.layers.mxfp4 import MXFP4Experts


def weight_memory_report(model: nn.Module) -> dict:
    """Bytes of parameters and persistent buffers, grouped by dtype name (shared storage counted once).

    Returns ``{"bytes_by_dtype": {dtype: bytes}, "total_bytes", "mxfp4_packed_bytes" (codes + scales of
    MXFP4 experts), "mxfp4_weights" (number of packed weights), "mxfp4_bf16_bytes" (2 bytes per packed
    weight)}``. KV caches are not weights and are not counted (they are attributes, not buffers).
    """
    by_dtype: dict[str, int] = {}
    seen: set[tuple[int, int]] = set()
    tensors = [p for _, p in model.named_parameters(remove_duplicate=True)]
    tensors += [b for _, b in model.named_buffers(remove_duplicate=True)]
    for t in tensors:
        if t.device.type == "meta":
            key = (id(t), 0)
        else:
            key = (t.untyped_storage().data_ptr(), t.storage_offset())
        if key in seen:
            continue
        seen.add(key)
        name = str(t.dtype).replace("torch.", "")
        by_dtype[name] = by_dtype.get(name, 0) + t.numel() * t.element_size()
    packed = n_weights = 0
    for m in model.modules():
        if isinstance(m, MXFP4Experts):
            for b in (m.w13_weight_packed, m.w13_weight_scale, m.w2_weight_packed, m.w2_weight_scale):
                packed += b.numel() * b.element_size()
            n_weights += 2 * (m.w13_weight_packed.numel() + m.w2_weight_packed.numel())
    return {"bytes_by_dtype": dict(sorted(by_dtype.items(), key=lambda kv: -kv[1])),
            "total_bytes": sum(by_dtype.values()), "mxfp4_packed_bytes": packed, "mxfp4_weights": n_weights,
            "mxfp4_bf16_bytes": 2 * n_weights}


def _size(n: int) -> str:
    return f"{n / 2**30:.2f} GiB" if n >= 2**30 else f"{n / 2**20:.2f} MiB"


def format_weight_report(r: dict) -> str:
    """One log line, e.g. ``weights: 1.23 GiB (bfloat16 1.00 GiB, uint8 0.23 GiB); MXFP4 routed experts ...``."""
    parts = ", ".join(f"{k} {_size(v)}" for k, v in r["bytes_by_dtype"].items())
    line = f"weights: {_size(r['total_bytes'])} ({parts})"
    if r["mxfp4_weights"]:
        bits = 8 * r["mxfp4_packed_bytes"] / r["mxfp4_weights"]
        line += (f"; MXFP4 routed experts {_size(r['mxfp4_packed_bytes'])} for {r['mxfp4_weights']} weights "
                 f"({bits:.2f} bits/weight; bf16 would be {_size(r['mxfp4_bf16_bytes'])})")
    return line
