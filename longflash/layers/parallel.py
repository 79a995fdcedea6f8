"""Tensor-parallel layers: column/row-parallel linears (Megatron-LM, arXiv 1909.08053 §3), a
vocab-parallel embedding and LM head.

Each layer holds only this rank's slice of the full weight and records where that slice sits in the
checkpoint tensor in ``tp_shards = {param_name: (dim, start, length, full_size)}``; the loader
(``models/loader.py``) reads exactly that slice (``safe_open(...).get_slice``), so no rank materializes
the full tensor. A layer built with ``tp=None`` (or a group of one rank) is a plain ``nn.Linear`` /
embedding with the full weight and no communication (the single-process engine, the DFlash drafter).

Collectives go through the ``comm.GroupCoordinator`` the layer was built with.
"""

from __future__ import annotations

import contextlib

import torch
import torch.nn.functional as F
from torch import nn

from longflash.distributed.comm import GroupCoordinator
from longflash.layers import gemv


def tp_size_of(tp: GroupCoordinator | None) -> int:
    return 1 if tp is None else tp.world_size


def tp_rank_of(tp: GroupCoordinator | None) -> int:
    return 0 if tp is None else tp.rank_in_group


def split_evenly(total: int, tp: GroupCoordinator | None, what: str) -> tuple[int, int]:
    """(start, length) of this rank's equal part of ``total``. Raises ValueError naming ``what`` when
    ``total`` is not divisible by the TP size."""
    n = tp_size_of(tp)
    if total % n:
        raise ValueError(f"{what} ({total}) must be divisible by tensor_parallel_size ({n})")
    part = total // n
    return tp_rank_of(tp) * part, part


class ColumnParallelLinear(nn.Linear):
    """``y = x W^T (+ b)`` with the *output* features split over the TP ranks: this rank holds rows
    ``[start, start + length)`` of ``W [out, in]`` (by default its equal part; ``shard=(start, length)``
    picks another range, e.g. a replicated KV head). forward: x [T, in] -> [T, length], no communication.
    Raises ValueError when ``out_features`` is not divisible by the TP size (default shard).
    """

    def __init__(self, in_features: int, out_features: int, bias: bool = False, *, tp: GroupCoordinator | None = None,
                 shard: tuple[int, int] | None = None, what: str = "output features"):
        start, length = shard if shard is not None else split_evenly(out_features, tp, what)
        super().__init__(in_features, length, bias=bias)
        self.tp_shards = {}
        if length != out_features:
            self.tp_shards["weight"] = (0, start, length, out_features)
            if bias:
                self.tp_shards["bias"] = (0, start, length, out_features)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.bias is not None:
            return F.linear(x, self.weight, self.bias)
        return gemv.linear(x, self.weight)  # a few tokens on a GPU: the Triton GEMV


class RowParallelLinear(nn.Linear):
    """``y = x W^T`` with the *input* features split: this rank holds columns ``[start, start + length)``
    of ``W [out, in]`` and gets x [T, in/tp]; forward returns the partial product summed over the TP
    group (all-reduce) when ``reduce``, else this rank's partial sum [T, out] (the caller reduces, e.g.
    after adding other partial sums). No bias (the checkpoints here have none). Raises ValueError when
    ``in_features`` is not divisible by the TP size.
    """

    def __init__(self, in_features: int, out_features: int, *, tp: GroupCoordinator | None = None,
                 reduce: bool = True, what: str = "input features"):
        start, length = split_evenly(in_features, tp, what)
        super().__init__(length, out_features, bias=False)
        self.tp = tp
        self.reduce = reduce
        self.tp_shards = {"weight": (1, start, length, in_features)} if length != in_features else {}

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = gemv.linear(x, self.weight)  # a few tokens on a GPU: the Triton GEMV
        if self.reduce and tp_size_of(self.tp) > 1:
            y = self.tp.all_reduce(y.contiguous())
        return y


def _vocab_shard(vocab_size: int, tp: GroupCoordinator | None) -> tuple[int, int, int]:
    """(start, length, padded) of this rank's vocab rows: parts of ``ceil(V / tp)`` rows, the last one
    shorter (``length`` < ``padded``) when tp does not divide V."""
    n = tp_size_of(tp)
    padded = -(-vocab_size // n)
    start = min(tp_rank_of(tp) * padded, vocab_size)
    return start, min(padded, vocab_size - start), padded


class VocabParallelEmbedding(nn.Module):
    """Token embedding with the vocabulary split over the TP ranks (``weight`` [ceil(V/tp), H]; rows
    past this rank's ``length`` are zero padding).

    forward(input_ids [T] int64, out=None) -> [T, H] in the weight's dtype: each rank looks up the ids
    it owns, zero rows for the others, all-reduce over TP (exact: one nonzero term per row).
    ``out`` (optional [T, H]) receives the result. With one rank this is ``index_select`` of the full table
    (bitwise ``nn.Embedding``).
    """

    def __init__(self, vocab_size: int, hidden_size: int, *, tp: GroupCoordinator | None = None):
        super().__init__()
        self.vocab_size = vocab_size
        self.tp = tp
        self.start, self.length, padded = _vocab_shard(vocab_size, tp)
        self.weight = nn.Parameter(torch.empty(padded, hidden_size))
        self.tp_shards = {"weight": (0, self.start, self.length, vocab_size)} if padded != vocab_size else {}

    def forward(self, input_ids: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
        if tp_size_of(self.tp) == 1:
            return torch.index_select(self.weight, 0, input_ids, out=out) if out is not None \
                else F.embedding(input_ids, self.weight)
        local = input_ids - self.start
        outside = (local < 0) | (local >= self.length)
        e = F.embedding(local.clamp(0, max(self.length - 1, 0)), self.weight)
        e = self.tp.all_reduce(e.masked_fill(outside[:, None], 0.0).contiguous())
        return e if out is None else out.copy_(e)

    def extra_repr(self) -> str:
        return f"vocab {self.vocab_size}, rows [{self.start}, {self.start + self.length}), dim {self.weight.shape[1]}"


class ParallelLMHead(nn.Module):
    """LM head with the vocabulary split like :class:`VocabParallelEmbedding` (so the two can be tied).

    forward(hidden [N, H]) -> logits [N, V] in hidden's dtype on every rank: this rank's
    ``[N, ceil(V/tp)]`` slice, all-gathered over TP along the vocab and cut to V. Every TP rank must
    call it with the same N (it is a collective).
    """

    def __init__(self, hidden_size: int, vocab_size: int, *, tp: GroupCoordinator | None = None):
        super().__init__()
        self.vocab_size = vocab_size
        self.tp = tp
        self.start, self.length, padded = _vocab_shard(vocab_size, tp)
        self.weight = nn.Parameter(torch.empty(padded, hidden_size))
        self.tp_shards = {"weight": (0, self.start, self.length, vocab_size)} if padded != vocab_size else {}

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        logits = F.linear(hidden, self.weight)
        if tp_size_of(self.tp) == 1:
            return logits
        return self.tp.all_gather(logits.contiguous(), dim=-1)[..., :self.vocab_size]


_BUILD_TP: list = []   # tp_group_for_build's stack


@contextlib.contextmanager
def tp_group_for_build(tp: GroupCoordinator | None):
    """Within the block, :func:`model_tp_group` returns ``tp`` (None or one rank: build replicated),
    whatever ``comm.get_parallel_state()`` says; used to build rank 0's shards before the process
    group exists (``comm.planned_tp_group``)."""
    _BUILD_TP.append(tp)
    try:
        yield
    finally:
        _BUILD_TP.pop()


def model_tp_group() -> GroupCoordinator | None:
    """The TP group a model being built shards over: the one given to :func:`tp_group_for_build`, else
    ``comm.get_parallel_state().tp``; None when that has one rank (replicated, single process).
    Models call it once in their constructor and hand it to their layers."""
    if _BUILD_TP:
        tp = _BUILD_TP[-1]
    else:
        from longflash.distributed.comm import get_parallel_state
        tp = get_parallel_state().tp
    return tp if tp is not None and tp.world_size > 1 else None
