"""The one module that calls ``torch.distributed``: process-group set-up and collectives.

Every other file reaches the collectives through :class:`GroupCoordinator` (so a later change can
swap in NCCL tuning or custom all-reduce here alone). Layout (vLLM's): ``world = tp_size`` ranks
(pipeline parallelism does not exist yet); the tensor-parallel group is all ranks; the
decode-context-parallel (DCP) groups are consecutive runs of ``dcp_size`` ranks inside the TP group,
e.g. tp 4, dcp 2 -> DCP groups {0, 1} and {2, 3}.

Failure model: the process groups are created with a ``timeout``; on gloo a collective whose peer
died raises (connection reset immediately, or after the timeout), it never waits forever. Callers
let the exception propagate so the engine exits with an error.
"""

from __future__ import annotations

import datetime
import os
import socket
import time
from dataclasses import dataclass

import torch
import torch.distributed as dist

DEFAULT_TIMEOUT_S = 60.0
_timeout_s = DEFAULT_TIMEOUT_S  # the timeout of the default group, reused for subgroups
_store = None                  # the rendezvous store (rank 0 hosts it unless torchrun's agent does)


def free_port(host: str = "127.0.0.1") -> int:
    """A TCP port that was free a moment ago on ``host`` (bind to port 0, read it, close).

    NOTE: another process may take it before the master store binds it; callers that spawn the
    ranks themselves pass the port to all of them at once, so the window is short.
    """
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((host, 0))
        return s.getsockname()[1]


def default_backend(device: torch.device | str) -> str:
    """``nccl`` for CUDA devices, ``gloo`` otherwise."""
    return "nccl" if torch.device(device).type == "cuda" else "gloo"


@dataclass
class DistEnv:
    """Where this process sits: rank, world size and the master's address/port."""

    rank: int
    world_size: int
    master_addr: str
    master_port: int

    @staticmethod
    def from_torchrun_env(environ: dict | None = None) -> "DistEnv | None":
        """Read torchrun's ``RANK``, ``WORLD_SIZE``, ``MASTER_ADDR``, ``MASTER_PORT``; None if
        ``RANK``/``WORLD_SIZE`` are absent. Raises ValueError on a partial or malformed set."""
        env = os.environ if environ is None else environ
        if "RANK" not in env and "WORLD_SIZE" not in env:
            return None
        missing = [k for k in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT") if k not in env]
        if missing:
            raise ValueError(f"torchrun environment incomplete: missing {', '.join(missing)}")
        try:
            de = DistEnv(int(env["RANK"]), int(env["WORLD_SIZE"]), env["MASTER_ADDR"], int(env["MASTER_PORT"]))
        except ValueError as e:
            raise ValueError(f"malformed torchrun environment: {e}") from e
        if not 0 <= de.rank < de.world_size:
            raise ValueError(f"RANK {de.rank} outside [0, WORLD_SIZE={de.world_size})")
        return de


def init_distributed(rank: int | None = None, world_size: int | None = None, master_port: int | None = None,
                     master_addr: str = "127.0.0.1", backend: str = "gloo",
                     timeout_s: float = DEFAULT_TIMEOUT_S) -> DistEnv:
    """Join the default process group.

    Either all of ``rank``, ``world_size``, ``master_port`` are given (spawned ranks), or none
    and torchrun's environment supplies them. ``timeout_s`` bounds every later collective
    (and the rendezvous). Raises ValueError when neither source is complete, RuntimeError when
    a process group already exists with another layout.
    """
    if rank is None and world_size is None and master_port is None:
        de = DistEnv.from_torchrun_env()
        if de is None:
            raise ValueError("init_distributed needs rank/world_size/master_port or torchrun's "
                             "RANK/WORLD_SIZE/MASTER_ADDR/MASTER_PORT environment")
    elif rank is None or world_size is None or master_port is None:
        raise ValueError("give all of rank, world_size, master_port (or none, to use torchrun's env)")
    else:
        de = DistEnv(rank, world_size, master_addr, master_port)
    global _timeout_s
    if dist.is_initialized():
        if dist.get_rank() != de.rank or dist.get_world_size() != de.world_size:
            raise RuntimeError("a process group with another rank/world size already exists")
        return de
    global _store
    td = datetime.timedelta(seconds=timeout_s)
    # NOTE: under torchrun the agent already serves a store on MASTER_PORT; every rank is a client.
    agent_store = os.environ.get("TORCHELASTIC_USE_AGENT_STORE", "").lower() == "true"
    _store = dist.TCPStore(de.master_addr, de.master_port, de.world_size,
                           is_master=de.rank == 0 and not agent_store, timeout=td)
    dist.init_process_group(backend=backend, store=_store, rank=de.rank, world_size=de.world_size, timeout=td)
    _timeout_s = timeout_s
    return de


def destroy_distributed() -> None:
    """Leave the default process group (no-op if none)."""
    global _store, _state
    if dist.is_initialized():
        dist.destroy_process_group()
    _store, _state = None, None


class GroupCoordinator:
    """A process group and the collectives the engine uses on it.

    ``ranks`` are global ranks, ``rank_in_group`` this process's index among them. A group of one
    rank needs no ``torch.distributed`` at all: every collective is then the identity, so the
    same code runs single-process.
    """

    def __init__(self, ranks: list[int], rank_in_group: int, group=None):
        self.ranks = list(ranks)
        self.world_size = len(ranks)
        self.rank_in_group = rank_in_group
        self.group = group

    @property
    def is_first_rank(self) -> bool:
        return self.rank_in_group == 0

    def all_reduce(self, x: torch.Tensor, op: str = "sum") -> torch.Tensor:
        """Sum (``op="sum"``) or maximum (``op="max"``) over the group, in place; returns ``x``.
        ``x`` must be contiguous. Raises ValueError for another ``op``."""
        if op not in ("sum", "max"):
            raise ValueError(f"all_reduce op must be 'sum' or 'max', got {op!r}")
        if self.world_size > 1:
            dist.all_reduce(x, op=dist.ReduceOp.SUM if op == "sum" else dist.ReduceOp.MAX, group=self.group)
        return x

    def all_gather(self, x: torch.Tensor, dim: int = 0) -> torch.Tensor:
        """Concatenate every rank's ``x`` (same shape on all ranks) along ``dim``, rank order."""
        if self.world_size == 1:
            return x
        parts = [torch.empty_like(x) for _ in range(self.world_size)]
        dist.all_gather(parts, x.contiguous(), group=self.group)
        return torch.cat(parts, dim=dim)

    def reduce_scatter(self, x: torch.Tensor, dim: int = 0) -> torch.Tensor:
        """Sum over the group, then rank i keeps the i-th of ``world_size`` equal slices along
        ``dim``. Raises ValueError if ``x.shape[dim]`` is not divisible by the group size.

        NOTE: gloo has no reduce-scatter; there it is an all-reduce followed by a slice (same
        result, more bytes on the wire).
        """
        if x.shape[dim] % self.world_size:
            raise ValueError(f"reduce_scatter: dim {dim} of size {x.shape[dim]} not divisible by "
                             f"group size {self.world_size}")
        if self.world_size == 1:
            return x
        n = x.shape[dim] // self.world_size
        if dist.get_backend(self.group) == "nccl":
            xm = x.movedim(dim, 0).contiguous()
            out = torch.empty((n, *xm.shape[1:]), dtype=x.dtype, device=x.device)
            dist.reduce_scatter_tensor(out, xm, group=self.group)
            return out.movedim(0, dim)
        y = x.contiguous()
        dist.all_reduce(y, group=self.group)
        return y.narrow(dim, self.rank_in_group * n, n)

    def broadcast_object(self, obj=None, src: int = 0):
        """Send a picklable object from group rank ``src`` to all; returns it on every rank."""
        if self.world_size == 1:
            return obj
        box = [obj if self.rank_in_group == src else None]
        dist.broadcast_object_list(box, src=self.ranks[src], group=self.group)
        return box[0]

    def barrier(self) -> None:
        if self.world_size > 1:
            dist.barrier(group=self.group)


@dataclass
class ParallelState:
    """This rank's TP and DCP groups (``dcp`` = consecutive ranks inside the TP group) and the DCP
    KV layout's ``cp_kv_cache_interleave_size``."""

    tp: GroupCoordinator
    dcp: GroupCoordinator
    cp_kv_cache_interleave_size: int = 1

    @property
    def tp_rank(self) -> int:
        return self.tp.rank_in_group

    @property
    def tp_size(self) -> int:
        return self.tp.world_size

    @property
    def dcp_rank(self) -> int:
        return self.dcp.rank_in_group

    @property
    def dcp_size(self) -> int:
        return self.dcp.world_size


def dcp_group_ranks(tp_size: int, dcp_size: int) -> list[list[int]]:
    """DCP groups as lists of global ranks: consecutive runs of ``dcp_size`` inside the TP group.
    Raises ValueError unless ``dcp_size`` divides ``tp_size``."""
    if tp_size < 1 or dcp_size < 1 or tp_size % dcp_size:
        raise ValueError(f"decode_context_parallel_size ({dcp_size}) must divide tensor_parallel_size ({tp_size})")
    return [list(range(s, s + dcp_size)) for s in range(0, tp_size, dcp_size)]


def single_process_state() -> ParallelState:
    """TP 1, DCP 1: no process group needed."""
    return ParallelState(GroupCoordinator([0], 0), GroupCoordinator([0], 0))


def planned_tp_group(tp_size: int, rank: int | None = None) -> GroupCoordinator:
    """This rank's TP group before ``init_distributed`` has run (to build its weight shards first).

    ``rank`` defaults to torchrun's ``RANK`` or 0. The coordinator's process group is None, i.e. the
    default group: the TP group is always the whole world, so its collectives work once
    ``init_distributed`` has joined it. Raises ValueError for a rank outside [0, tp_size).
    """
    if rank is None:
        env = DistEnv.from_torchrun_env()
        rank = env.rank if env is not None else 0
    if not 0 <= rank < tp_size:
        raise ValueError(f"rank {rank} outside [0, tensor_parallel_size={tp_size})")
    return GroupCoordinator(list(range(tp_size)), rank, None)


_state: ParallelState | None = None


def get_parallel_state() -> ParallelState:
    """The state set by :func:`initialize_model_parallel`; TP 1 / DCP 1 when none was."""
    return _state if _state is not None else single_process_state()


def initialize_model_parallel(tp_size: int, dcp_size: int, cp_kv_cache_interleave_size: int = 1) -> ParallelState:
    """Create the TP and DCP groups on an initialized default group of ``tp_size`` ranks.

    Every rank must call this (``new_group`` is collective). Raises ValueError when the world size
    is not ``tp_size`` or ``dcp_size`` does not divide it.
    """
    global _state
    groups = dcp_group_ranks(tp_size, dcp_size)
    if tp_size == 1:
        _state = single_process_state()
        return _state
    if not dist.is_initialized():
        raise RuntimeError("initialize_model_parallel needs init_distributed first")
    world, rank = dist.get_world_size(), dist.get_rank()
    if world != tp_size:
        raise ValueError(f"world size {world} != tensor_parallel_size {tp_size}")
    tp = GroupCoordinator(list(range(tp_size)), rank, dist.group.WORLD)
    dcp = None
    for ranks in groups:
        # NOTE: new_group must be called by every rank for every group, in the same order.
        g = dist.new_group(ranks, timeout=datetime.timedelta(seconds=_timeout_s)) if dcp_size > 1 else None
        if rank in ranks:
            dcp = GroupCoordinator(ranks, ranks.index(rank), g)
    _state = ParallelState(tp, dcp, cp_kv_cache_interleave_size)
    return _state


class StepChannel:
    """Rank 0 (the scheduler) sends each step's batch to the workers, in order.

    ``post(obj)`` on rank 0 / ``recv()`` on the others. A worker polls the rendezvous store for the
    next step's key (naps up to ``MAX_NAP_S``), so an idle engine never trips the collective timeout; the
    payload then travels by ``broadcast_object``. If rank 0 dies, the store connection breaks and
    ``recv`` raises. ``post(None)`` tells the workers to stop.
    """

    MAX_NAP_S = 0.02

    def __init__(self, group: GroupCoordinator, prefix: str = "longflash/step"):
        if _store is None and group.world_size > 1:
            raise RuntimeError("StepChannel needs init_distributed first")
        self.group = group
        self.prefix = prefix
        self.step = 0

    def post(self, obj) -> None:
        self.step += 1
        if self.group.world_size > 1:
            _store.set(f"{self.prefix}/{self.step}", b"1")
            self.group.broadcast_object(obj, src=0)

    def recv(self):
        self.step += 1
        key = f"{self.prefix}/{self.step}"
        nap = 1e-4
        while not _store.check([key]):   # raises if rank 0 (the store's host) is gone
            time.sleep(nap)
            nap = min(nap * 2, self.MAX_NAP_S)
        obj = self.group.broadcast_object(None, src=0)
        if obj is None:
            # The stop message: rank 0 (the store's host) may exit right after posting it, so the
            # store is not touched again (a late key clean-up raced with its exit: connection reset).
            return None
        # NOTE: the last worker to pass a step deletes its keys, so the store does not grow.
        if _store.add(f"{key}/ack", 1) == self.group.world_size - 1:
            _store.delete_key(key)
            _store.delete_key(f"{key}/ack")
        return obj

