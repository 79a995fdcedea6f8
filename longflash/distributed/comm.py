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
from dataclasses import dataclass

import torch
import torch.distributed as dist

DEFAULT_TIMEOUT_S = 60.0
_timeout_s = DEFAULT_TIMEOUT_S  # the timeout of the default group, reused for subgroups


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
    dist.init_process_group(backend=backend, init_method=f"tcp://{de.master_addr}:{de.master_port}",
                            rank=de.rank, world_size=de.world_size,
                            timeout=datetime.timedelta(seconds=timeout_s))
    _timeout_s = timeout_s
    return de


def destroy_distributed() -> None:
    """Leave the default process group (no-op if none)."""
    if dist.is_initialized():
        dist.destroy_process_group()


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

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        """Sum over the group, in place; returns ``x``."""
        if self.world_size > 1:
            dist.all_reduce(x, group=self.group)
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
    """This rank's TP and DCP groups (``dcp`` = consecutive ranks inside the TP group)."""

    tp: GroupCoordinator
    dcp: GroupCoordinator

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


def initialize_model_parallel(tp_size: int, dcp_size: int) -> ParallelState:
    """Create the TP and DCP groups on an initialized default group of ``tp_size`` ranks.

    Every rank must call this (``new_group`` is collective). Raises ValueError when the world size
    is not ``tp_size`` or ``dcp_size`` does not divide it.
    """
    groups = dcp_group_ranks(tp_size, dcp_size)
    if tp_size == 1:
        return single_process_state()
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
    return ParallelState(tp, dcp)

