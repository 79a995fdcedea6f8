"""The checks every Triton tile config of this project shares (``config=`` of the attention kernels)."""

from __future__ import annotations


def check_tile_shape(cfg: dict, what: str) -> None:
    """Raise ValueError, prefixed with ``what`` (e.g. "prefill config") and naming the key, when ``cfg``'s
    BLOCK_M or BLOCK_N is not a power of two >= 16 (``tl.dot``'s smallest side), its num_warps is not a power
    of two in 1..16, or its num_stages is not an int >= 1. Bools are refused where ints are meant."""
    for key in ("BLOCK_M", "BLOCK_N"):
        b = cfg[key]
        if not isinstance(b, int) or isinstance(b, bool) or b < 16 or b & (b - 1):
            raise ValueError(f"{what}: {key} must be a power of two >= 16, got {b!r}")
    w, st = cfg["num_warps"], cfg["num_stages"]
    if not isinstance(w, int) or isinstance(w, bool) or w not in (1, 2, 4, 8, 16):
        raise ValueError(f"{what}: num_warps must be a power of two in 1..16, got {w!r}")
    if not isinstance(st, int) or isinstance(st, bool) or st < 1:
        raise ValueError(f"{what}: num_stages must be an int >= 1, got {st!r}")
