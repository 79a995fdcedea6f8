"""Storage plan for the Block AttnRes forward: which [T, H] storage each produced tensor lives in.

Three pieces (``shared/specs/attnres_kimi.md``, "Order of operations" and "The storage-reuse fault"):

* ``attn_res_schedule(num_layers, block_size)`` lists every op of the forward in execution order with
  the values it reads and the one value it writes (embedding, mixer outputs, attention and MLP
  outputs, prefix sums, output mixture). A commit (``bank[k] = prefix``) writes nothing: the committed
  prefix *is* the bank slot, so its lifetime simply extends to the output mixture.
* ``plan_storage(schedule)`` assigns every value a storage from a fixed pool by lifetimes (linear scan
  in op order): a storage is reused only after the last read of its occupant, or by the op doing that
  last read when the op may write over its own input (elementwise prefix adds; sublayers, which consume
  their input before writing their output). Mixers never write over a source.
* ``check_plan(schedule, plan)`` replays a plan and raises ``PlanError`` naming the layer, the
  sublayer and the buffer on any write into a storage whose occupant still has a pending read.
  ``attn_res_plan`` (cached per (num_layers, block_size)) plans and checks once; model construction
  calls it.

``execute_plan`` runs a plan with caller-supplied embedding / mixer / sublayer callbacks that write into
``out`` buffers. The pool is one ``[pool_size, T, H]`` tensor allocated per forward (sized by the
forward's token count, bounded by the scheduler's token budget); every value is a fixed view
``pool[storage]``, so the same op writes to the same offset every forward of a given T (CUDA-graph
safe: under capture the pool lives in the graph's private memory pool). Allocating per forward rather
than preallocating for ``max_num_batched_tokens`` hands the memory back between forwards (MoE and
attention workspaces use it). ``reuse=False`` allocates every value separately (the baseline that
invariant 5 of DESIGN.md compares against, bitwise).
"""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass, field
from typing import Callable, NamedTuple

import torch

# Op kinds. Mixers read bank slots + prefix; sublayers read a mixer output; adds read prefix + output.
EMBED, ATTN_MIX, COMMIT, ATTN, ATTN_ADD, MLP_MIX, MLP, MLP_ADD, OUT_MIX, RESULT = (
    "embed", "attn_mix", "commit", "attn", "attn_add", "mlp_mix", "mlp", "mlp_add", "output_mix", "result")


class PlanError(ValueError):
    """A storage plan that overwrites a value before its last read (or reads a value no longer there)."""


@dataclass(frozen=True)
class Op:
    """One op of the AttnRes forward.

    layer: decoder layer (None for the embedding, output mixture and result).
    sublayer: one of the op kinds above.
    reads: value names read, in source order. write: the value produced (None for commit/result).
    may_overwrite_input: the op may write its output over an input whose last read is this op.
    bank_slot: for commit, the slot index the prefix is committed to.
    """

    index: int
    layer: int | None
    sublayer: str
    reads: tuple[str, ...]
    write: str | None
    may_overwrite_input: bool = False
    bank_slot: int | None = None

    def where(self) -> str:
        return (f"layer {self.layer} {self.sublayer}" if self.layer is not None else self.sublayer)


@dataclass
class Schedule:
    """Reads and writes of the forward, in order. ``bank[k]`` is the value committed to slot k;
    ``output`` the value of the output mixture; ``reads_of[v]`` the op indices reading v (sorted)."""

    num_layers: int
    block_size: int
    ops: list[Op]
    bank: list[str]
    output: str
    reads_of: dict[str, list[int]] = field(default_factory=dict)
    writer_of: dict[str, int] = field(default_factory=dict)

    @property
    def num_bank_slots(self) -> int:
        return len(self.bank)

    def describe(self, value: str) -> str:
        """``bank[7] (p_mlp[83], committed at layer 84)`` for a committed value, else the value name."""
        for k, v in enumerate(self.bank):
            if v == value:
                return f"bank[{k}] ({v}, committed at layer {k * self.block_size})"
        return value

    def max_live_separate(self) -> int:
        """Peak number of [T, H] values alive at once when every output is allocated separately (the
        output is allocated while the op's inputs are still alive)."""
        last = {v: r[-1] for v, r in self.reads_of.items()}
        live: set[str] = set()
        peak = 0
        for op in self.ops:
            if op.write is not None:
                live.add(op.write)
            peak = max(peak, len(live))
            live -= {v for v in op.reads if last[v] == op.index}
        return peak


def attn_res_schedule(num_layers: int, block_size: int) -> Schedule:
    """The Block AttnRes schedule of ``attnres_kimi.md`` ("Order of operations") for decoder layers
    0..num_layers-1 with ``attn_res_block_size`` = block_size.

    Values: ``embed``; per layer l ``h_attn[l]``, ``a[l]``, ``p_attn[l]`` (prefix + a, non-commit layers
    only: at a commit layer the new prefix is ``a[l]`` itself), ``h_mlp[l]``, ``m[l]``, ``p_mlp[l]``;
    ``y`` (output mixture, before ``model.norm``). The final ``result`` op reads the bank and ``y`` so
    that both survive the forward (tests compare every bank element).

    Raises ValueError for num_layers < 1 or block_size < 1.
    """
    if num_layers < 1 or block_size < 1:
        raise ValueError(f"need num_layers >= 1 and block_size >= 1, got {num_layers}, {block_size}")
    ops: list[Op] = []

    def add(layer, sub, reads, write, overwrite=False, slot=None):
        ops.append(Op(len(ops), layer, sub, tuple(reads), write, overwrite, slot))

    bs = block_size
    add(None, EMBED, (), "embed")
    bank: list[str] = []
    prefix = "embed"
    for l in range(num_layers):
        n, wr = -(-l // bs), l % bs == 0
        add(l, ATTN_MIX, bank[:n] + [prefix], f"h_attn[{l}]")
        if wr:
            add(l, COMMIT, (prefix,), None, slot=l // bs)
            bank.append(prefix)
        add(l, ATTN, (f"h_attn[{l}]",), f"a[{l}]", overwrite=True)
        if wr:
            prefix = f"a[{l}]"
        else:
            add(l, ATTN_ADD, (prefix, f"a[{l}]"), f"p_attn[{l}]", overwrite=True)
            prefix = f"p_attn[{l}]"
        add(l, MLP_MIX, bank[:n + int(wr)] + [prefix], f"h_mlp[{l}]")
        add(l, MLP, (f"h_mlp[{l}]",), f"m[{l}]", overwrite=True)
        add(l, MLP_ADD, (prefix, f"m[{l}]"), f"p_mlp[{l}]", overwrite=True)
        prefix = f"p_mlp[{l}]"
    assert len(bank) == math.ceil(num_layers / bs)
    add(None, OUT_MIX, bank + [prefix], "y")
    add(None, RESULT, bank + ["y"], None)
    sched = Schedule(num_layers, bs, ops, bank, "y")
    for op in ops:
        for v in op.reads:
            sched.reads_of.setdefault(v, []).append(op.index)
        if op.write is not None:
            sched.writer_of[op.write] = op.index
    return sched


@dataclass
class StoragePlan:
    """``storage[value]`` = index into a pool of ``pool_size`` [T, H] buffers."""

    storage: dict[str, int]
    pool_size: int

    def bytes_per_token(self, hidden_size: int, dtype: torch.dtype) -> int:
        return self.pool_size * hidden_size * torch.empty((), dtype=dtype).element_size()


def plan_storage(schedule: Schedule, pins: dict[str, int] | None = None) -> StoragePlan:
    """Assign storages by lifetimes (linear scan in op order).

    A storage is free for op i's output when its occupant's last read is before i, or is i itself and
    the op may overwrite its input. Among free storages the op's first input's storage is preferred
    (in-place prefix adds keep the prefix where it is), then the lowest index; a new storage is added
    when none is free. ``pins`` forces values into given storages *without* any check (used to build
    faulty plans for ``check_plan`` to reject); the scan then continues from the forced occupancy.
    """
    pins = pins or {}
    last = {v: r[-1] for v, r in schedule.reads_of.items()}
    storage: dict[str, int] = {}
    occupant: list[str | None] = []
    for op in schedule.ops:
        v = op.write
        if v is None:
            continue
        if v in pins:
            s = pins[v]
            while len(occupant) <= s:
                occupant.append(None)
        else:
            def free(s: int) -> bool:
                occ = occupant[s]
                if occ is None:
                    return True
                end = last.get(occ, -1)
                return end < op.index or (end == op.index and op.may_overwrite_input and occ in op.reads)

            own = [storage[r] for r in op.reads if r in storage]
            cands = [s for s in range(len(occupant)) if free(s)]
            if op.may_overwrite_input and own and own[0] in cands:
                s = own[0]
            elif cands:
                s = cands[0]
            else:
                s = len(occupant)
                occupant.append(None)
        storage[v] = s
        occupant[s] = v
    return StoragePlan(storage, len(occupant))


def check_plan(schedule: Schedule, plan: StoragePlan) -> None:
    """Replay ``plan`` against ``schedule``; raises PlanError on the first write into a storage whose
    occupant still has a pending read (naming layer, sublayer, buffer and the reads it would break),
    on a read of a value that is no longer in its storage, and on a value without a storage."""
    occupant: dict[int, str] = {}
    for op in schedule.ops:
        for v in op.reads:
            s = plan.storage.get(v)
            if occupant.get(s) != v:
                raise PlanError(f"{op.where()}: reads {schedule.describe(v)} from pool buffer {s}, which now "
                                f"holds {occupant.get(s)}")
        v = op.write
        if v is None:
            continue
        s = plan.storage.get(v)
        if s is None or not 0 <= s < plan.pool_size:
            raise PlanError(f"{op.where()}: output {v} has no storage in the pool of {plan.pool_size}")
        occ = occupant.get(s)
        if occ is not None:
            pending = [i for i in schedule.reads_of.get(occ, [])
                       if i > op.index or (i == op.index and not op.may_overwrite_input)]
            if pending:
                readers = [schedule.ops[i].where() for i in pending]
                if len(readers) > 1:  # the forward's result (bank + y) is a read of its own; name the last real one
                    readers = readers[:-1] if readers[-1] == RESULT else readers
                more = f" and {len(readers) - 1} later reads (last: {readers[-1]})" if len(readers) > 1 else ""
                raise PlanError(f"{op.where()}: writing {v} into pool buffer {s} overwrites "
                                f"{schedule.describe(occ)}, still read by {readers[0]}{more}")
        occupant[s] = v


@functools.lru_cache(maxsize=None)
def attn_res_plan(num_layers: int, block_size: int) -> tuple[Schedule, StoragePlan]:
    """Schedule and checked lifetime plan for (num_layers, block_size); computed once per pair."""
    sched = attn_res_schedule(num_layers, block_size)
    plan = plan_storage(sched)
    check_plan(sched, plan)
    return sched, plan


def production_bug_plan(num_layers: int = 93, block_size: int = 12) -> tuple[Schedule, StoragePlan]:
    """The production fault of ``attnres_kimi.md``: at the layer that commits the final block, its
    attention output is written into the storage of the slot just committed (for Kimi-K3, the eighth
    slot at layer 84). Built with a pin, so it is *not* checked; ``check_plan`` rejects it."""
    sched, good = attn_res_plan(num_layers, block_size)
    last_commit = (sched.num_bank_slots - 1) * block_size
    slot = good.storage[sched.bank[-1]]
    return sched, plan_storage(sched, pins={f"a[{last_commit}]": slot})


class AttnResBytes(NamedTuple):
    """Per-token bytes of the AttnRes state of one forward. bank: NB slots; prefix: one row;
    pool: the planned pool (bank, prefix and mixer/sublayer outputs) with reuse;
    separate_peak: peak of the same values when every output is allocated separately."""

    bank: int
    prefix: int
    pool: int
    separate_peak: int

    @property
    def bank_plus_prefix(self) -> int:
        return self.bank + self.prefix


def attn_res_bytes_per_token(cfg: dict, dtype: torch.dtype) -> AttnResBytes:
    """Bytes per token of the bank + prefix (and of the whole planned pool) for a Kimi-K3 text config.
    Kimi-K3 (H = 7168, 93 layers, block 12, bf16): bank 114,688, prefix 14,336, pool 143,360."""
    H = cfg["hidden_size"]
    sched, plan = attn_res_plan(cfg["num_hidden_layers"], cfg["attn_res_block_size"])
    row = H * torch.empty((), dtype=dtype).element_size()
    return AttnResBytes(sched.num_bank_slots * row, row, plan.pool_size * row, sched.max_live_separate() * row)


class AttnResOut(NamedTuple):
    y: torch.Tensor            # [T, H] output mixture (before model.norm)
    bank: list[torch.Tensor]   # NB tensors [T, H]: the committed slots
    pool: torch.Tensor | None  # the [pool_size, T, H] pool with reuse, else None


def execute_plan(schedule: Schedule, plan: StoragePlan, num_tokens: int, hidden_size: int, dtype: torch.dtype,
                 device: torch.device | str, *,
                 embed: Callable[[torch.Tensor], torch.Tensor],
                 mix: Callable[[int | None, str, list[torch.Tensor], torch.Tensor], torch.Tensor],
                 attn: Callable[[int, torch.Tensor, torch.Tensor], torch.Tensor],
                 mlp: Callable[[int, torch.Tensor, torch.Tensor], torch.Tensor],
                 reuse: bool = True) -> AttnResOut:
    """Run the AttnRes forward with every produced value written into its planned storage.

    Callbacks write their result into ``out`` ([T, H], ``dtype``) and return it:
    ``embed(out)``; ``mix(layer, sublayer, sources, out)`` with sublayer in {attn_mix, mlp_mix,
    output_mix} (layer None for the output mixture); ``attn(layer, h, out)`` and ``mlp(layer, h, out)``,
    which must read ``h`` completely before writing ``out`` (the plan may put both in one storage).
    Prefix adds are ``torch.add(prefix, x, out=...)``. With ``reuse=False`` every value gets its own
    ``torch.empty`` (and is dropped after its last read), the baseline reuse must equal bitwise.
    The plan is not re-checked here (``attn_res_plan`` checked it); a forced faulty plan runs as is.
    """
    T, H = num_tokens, hidden_size
    pool = torch.empty(plan.pool_size, T, H, dtype=dtype, device=device) if reuse else None

    def buf(v: str) -> torch.Tensor:
        return pool[plan.storage[v]] if pool is not None else torch.empty(T, H, dtype=dtype, device=device)

    vals: dict[str, torch.Tensor] = {}
    for op in schedule.ops:
        k = op.sublayer
        if k == COMMIT or k == RESULT:
            continue
        out = buf(op.write)
        if k == EMBED:
            vals[op.write] = embed(out)
        elif k in (ATTN_MIX, MLP_MIX, OUT_MIX):
            vals[op.write] = mix(op.layer, k, [vals[r] for r in op.reads], out)
        elif k == ATTN:
            vals[op.write] = attn(op.layer, vals[op.reads[0]], out)
        elif k == MLP:
            vals[op.write] = mlp(op.layer, vals[op.reads[0]], out)
        else:  # ATTN_ADD / MLP_ADD
            vals[op.write] = torch.add(vals[op.reads[0]], vals[op.reads[1]], out=out)
        for r in op.reads:  # drop after the last read (frees separately allocated values)
            if schedule.reads_of[r][-1] == op.index:
                del vals[r]
    return AttnResOut(vals[schedule.output], [vals[v] for v in schedule.bank], pool)
