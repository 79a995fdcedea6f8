"""The one module that calls ``torch.distributed``: process-group set-up and collectives.

Every other file reaches the collectives through :class:`GroupCoordinator` (so a later change can
swap in NCCL tuning or custom all-reduce here alone). Layout (vLLM's): ``world = tp_size`` ranks
(pipeline parallelism does not exist yet); the tensor-parallel group is all ranks; the
decode-context-parallel (DCP) groups are consecutive runs of ``dcp_size`` ranks inside the TP group,
e.g. tp 4, dcp 2 -> DCP groups {0, 1} and {2, 3}.

Backends: ``gloo`` on the CPU; ``nccl`` on GPUs (each rank on ``cuda:<local rank>``, bound by
``placement.bind_rank_device`` before anything touches the GPU). NCCL moves CUDA tensors only, so under
NCCL every group also has a gloo twin (vLLM's ``cpu_group``): a collective on a CPU tensor (e.g. the
DFlash drafts check) and the step channel's object broadcast go over it; CUDA tensors take NCCL.

Failure model: the process groups are created with a ``timeout``; on gloo a collective whose peer
died raises (connection reset immediately, or after the timeout), it never waits forever; on NCCL
(``TORCH_NCCL_ASYNC_ERROR_HANDLING=1``, set unless the user chose otherwise) PyTorch's watchdog aborts
a collective that outlives the timeout and ends the process with the error. Callers let exceptions
propagate so the engine exits with an error.
"""

from __future__ import annotations

import datetime
import inspect
import io
import logging
import multiprocessing
import os
import pickle
import socket
import time
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch.serialization import default_restore_location

from longflash.distributed.placement import apply_nccl_env_defaults, default_backend, restore_location

logger = logging.getLogger(__name__)

DEFAULT_TIMEOUT_S = 60.0
_timeout_s = DEFAULT_TIMEOUT_S  # the timeout of the default group, reused for subgroups
_store = None                  # the rendezvous store (rank 0 hosts it unless torchrun's agent does)
_backend: str | None = None    # the default group's backend
_device: torch.device | None = None  # this rank's device (objects received land their CUDA tensors here)
_cpu_world = None              # gloo twin of the default group under NCCL (None: the default group is gloo)


def free_port(host: str = "127.0.0.1") -> int:
    """A TCP port that was free a moment ago on ``host`` (bind to port 0, read it, close).

    NOTE: another process may take it before the master store binds it; callers that spawn the
    ranks themselves pass the port to all of them at once, so the window is short.
    """
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((host, 0))
        return s.getsockname()[1]


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
                     master_addr: str = "127.0.0.1", backend: str | None = None,
                     timeout_s: float = DEFAULT_TIMEOUT_S, device: torch.device | str | None = None,
                     check_peers=None) -> DistEnv:
    """Join the default process group.

    Either all of ``rank``, ``world_size``, ``master_port`` are given (spawned ranks), or none
    and torchrun's environment supplies them. ``timeout_s`` bounds every later collective
    (and the rendezvous). ``device`` is this rank's device (default: the CPU); for a CUDA device it
    must be indexed (``cuda:<local rank>``, see ``placement.bind_rank_device``). ``backend`` defaults
    to ``placement.default_backend(device)`` (``nccl`` on CUDA, ``gloo`` on the CPU). Under NCCL:
    ``placement.NCCL_ENV_DEFAULTS`` are set where the user did not set them, the device is made
    current, passed to ``init_process_group`` as ``device_id`` (eager NCCL communicator, where this
    torch supports it), and a gloo twin of the world is created for CPU tensors and objects.
    ``check_peers`` (rank 0 that started the other ranks itself): called every 0.5 s while rank 0 waits
    for them to join, so a rank that died on start-up fails the start at once (it raises) instead of
    after ``timeout_s``.
    Raises ValueError when neither source is complete or the CUDA device has no index,
    RuntimeError when a process group already exists with another layout.
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
    dev = torch.device("cpu" if device is None else device)
    backend = backend or default_backend(dev)
    if backend == "nccl" and (dev.type != "cuda" or dev.index is None):
        raise ValueError(f"the nccl backend needs this rank's indexed CUDA device (cuda:<local rank>), got {dev}")
    global _timeout_s, _store, _backend, _device, _cpu_world
    if dist.is_initialized():
        if dist.get_rank() != de.rank or dist.get_world_size() != de.world_size:
            raise RuntimeError("a process group with another rank/world size already exists")
        return de
    td = datetime.timedelta(seconds=timeout_s)
    kw = {}
    if backend == "nccl":
        apply_nccl_env_defaults()  # read when the communicators are created, i.e. below
        torch.cuda.set_device(dev)
        if "device_id" in inspect.signature(dist.init_process_group).parameters:
            kw["device_id"] = dev
    # NOTE: under torchrun the agent already serves a store on MASTER_PORT; every rank is a client.
    agent_store = os.environ.get("TORCHELASTIC_USE_AGENT_STORE", "").lower() == "true"
    watch = check_peers is not None and de.rank == 0 and not agent_store
    _store = dist.TCPStore(de.master_addr, de.master_port, de.world_size,
                           is_master=de.rank == 0 and not agent_store, timeout=td, wait_for_workers=not watch)
    if de.rank != 0:
        _store.set(f"longflash/joined/{de.rank}", b"1")
    elif watch:
        _wait_for_peers(de.world_size, timeout_s, check_peers)
    dist.init_process_group(backend=backend, store=_store, rank=de.rank, world_size=de.world_size, timeout=td, **kw)
    _timeout_s, _backend, _device = timeout_s, backend, dev
    _cpu_world = dist.new_group(list(range(de.world_size)), timeout=td, backend="gloo") if backend != "gloo" else None
    return de


def _wait_for_keys(keys: list[str], check_peers, timeout_s: float | None = None, warn_after_s: float | None = None,
                   what: str = "") -> None:
    """Rank 0: wait until every store key in ``keys`` is set, calling ``check_peers()`` (raises when a
    peer is gone) every 0.5 s. Raises TimeoutError naming ``what`` after ``timeout_s`` (None:
    no deadline); logs a warning every ``warn_after_s`` seconds of waiting (None: never)."""
    t0, warned, last_check = time.monotonic(), 0, 0.0
    # NOTE: polled with store.check, not store.wait with a short timeout: every timed-out wait logs two
    # c10d "waitForInput ... timed out" warnings (8-12 lines per engine start).
    while not _store.check(keys):
        time.sleep(0.02)
        if time.monotonic() - last_check < 0.5:
            continue
        last_check = time.monotonic()
        check_peers()
        waited = last_check - t0
        if timeout_s is not None and waited > timeout_s:
            raise TimeoutError(f"{what} within {timeout_s:.0f} s")
        if warn_after_s is not None and waited >= (warned + 1) * warn_after_s:
            warned += 1
            logger.warning("%s after %.0f s (alive; waiting)", what, waited)


def _wait_for_peers(world_size: int, timeout_s: float, check_peers) -> None:
    """Rank 0: wait until ranks 1..world_size-1 set their ``joined`` key, calling ``check_peers()``
    between 0.5 s waits. Raises TimeoutError after ``timeout_s``."""
    _wait_for_keys([f"longflash/joined/{r}" for r in range(1, world_size)], check_peers, timeout_s=timeout_s,
                   what=f"ranks 1..{world_size - 1} did not join")


def mark_ready(rank: int) -> None:
    """A locally started worker: its model and KV shard are built (see :func:`wait_until_ready`)."""
    _store.set(f"longflash/ready/{rank}", b"1")


def wait_until_ready(world_size: int, check_peers, warn_after_s: float) -> None:
    """Rank 0: wait until ranks 1..world_size-1 have called :func:`mark_ready`, calling
    ``check_peers()`` (raises when a worker is gone) between 0.5 s waits, with a warning every
    ``warn_after_s`` seconds; no deadline while the workers are alive. The workers load their shards
    after joining, so they lag rank 0 by their load time (minutes for a large fp32 model); without this
    wait rank 0's first steps, collectives and CUDA-graph capture ran into that lag and its timeouts."""
    _wait_for_keys([f"longflash/ready/{r}" for r in range(1, world_size)], check_peers, warn_after_s=warn_after_s,
                   what="TP/DCP workers still loading")


def destroy_distributed() -> None:
    """Leave the default process group and its subgroups (no-op if none)."""
    global _store, _state, _backend, _device, _cpu_world
    if dist.is_initialized():
        dist.destroy_process_group()
    _store, _state, _backend, _device, _cpu_world = None, None, None, None, None


def backend() -> str | None:
    """The default group's backend (``gloo`` / ``nccl``), None before :func:`init_distributed`."""
    return _backend


def _pack(obj) -> torch.Tensor:
    """``obj`` serialized (``torch.save``: tensors keep their device tag) as a 1-D uint8 CPU tensor."""
    buf = io.BytesIO()
    torch.save(obj, buf, pickle_protocol=pickle.HIGHEST_PROTOCOL)
    return torch.frombuffer(bytearray(buf.getbuffer()), dtype=torch.uint8)


def _unpack(data: torch.Tensor, device: torch.device | None = None):
    """Inverse of :func:`_pack`; CUDA tensors land on ``device`` when it is a CUDA device
    (``placement.restore_location``), CPU tensors stay on the CPU. Only for objects from our own ranks
    (full unpickling)."""
    def restore(storage, location):
        return default_restore_location(storage, restore_location(location, device))
    return torch.load(io.BytesIO(data.numpy().tobytes()), map_location=restore, weights_only=False)


class GroupCoordinator:
    """A process group and the collectives the engine uses on it.

    ``ranks`` are global ranks, ``rank_in_group`` this process's index among them. ``group`` is the
    ``torch.distributed`` group (None: the default group); ``cpu_group`` its gloo twin under NCCL
    (None: the group itself when it is gloo, the world's twin when ``group`` is the default group).
    A group of one rank without a process group needs no ``torch.distributed`` at all: every
    collective is then the identity, so the same code runs single-process. Collectives route by
    tensor: CUDA tensors over ``group``, CPU tensors over the gloo twin.
    """

    def __init__(self, ranks: list[int], rank_in_group: int, group=None, cpu_group=None):
        self.ranks = list(ranks)
        self.world_size = len(ranks)
        self.rank_in_group = rank_in_group
        self.group = group
        self.cpu_group = cpu_group
        self._identity = self.world_size == 1 and group is None

    @property
    def is_first_rank(self) -> bool:
        return self.rank_in_group == 0

    def _cpu_pg(self):
        """The gloo group for CPU tensors and objects."""
        if self.cpu_group is not None:
            return self.cpu_group
        if _backend in (None, "gloo"):
            return self.group
        if self.group is None or self.group is dist.group.WORLD:
            return _cpu_world
        raise RuntimeError("a subgroup of an NCCL world needs its gloo twin (cpu_group)")

    def _pg(self, x: torch.Tensor):
        """The group that moves ``x``: NCCL needs CUDA tensors, gloo takes CPU tensors."""
        return self._cpu_pg() if x.device.type == "cpu" else self.group

    @staticmethod
    def _nccl(x: torch.Tensor) -> bool:
        """Whether ``x`` travels over NCCL (a CUDA tensor in an NCCL world)."""
        return _backend == "nccl" and x.device.type != "cpu"

    def all_reduce(self, x: torch.Tensor, op: str = "sum") -> torch.Tensor:
        """Sum (``op="sum"``) or maximum (``op="max"``) over the group, in place; returns ``x``.
        ``x`` must be contiguous. Raises ValueError for another ``op``."""
        if op not in ("sum", "max"):
            raise ValueError(f"all_reduce op must be 'sum' or 'max', got {op!r}")
        if not self._identity:
            dist.all_reduce(x, op=dist.ReduceOp.SUM if op == "sum" else dist.ReduceOp.MAX, group=self._pg(x))
        return x

    def all_gather(self, x: torch.Tensor, dim: int = 0) -> torch.Tensor:
        """Concatenate every rank's ``x`` (same shape on all ranks) along ``dim``, rank order."""
        if self._identity:
            return x
        pg = self._pg(x)
        if self._nccl(x):  # one buffer [world, *x.shape], then the world axis folded into dim
            out = torch.empty((self.world_size, *x.shape), dtype=x.dtype, device=x.device)
            dist.all_gather_into_tensor(out, x.contiguous(), group=pg)
            d = dim % x.dim()
            return out.movedim(0, d).flatten(d, d + 1)
        parts = [torch.empty_like(x) for _ in range(self.world_size)]
        dist.all_gather(parts, x.contiguous(), group=pg)
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
        if self._identity:
            return x
        n = x.shape[dim] // self.world_size
        pg = self._pg(x)
        if self._nccl(x):
            xm = x.movedim(dim, 0).contiguous()
            out = torch.empty((n, *xm.shape[1:]), dtype=x.dtype, device=x.device)
            dist.reduce_scatter_tensor(out, xm, group=pg)
            return out.movedim(0, dim)
        y = x.contiguous()
        dist.all_reduce(y, group=pg)
        return y.narrow(dim, self.rank_in_group * n, n)

    def broadcast_object(self, obj=None, src: int = 0):
        """Send a picklable object from group rank ``src`` to all; returns it on every rank (``src``
        gets ``obj`` itself). Travels over the gloo group as ``torch.save`` bytes (a length, then the
        bytes); tensors in it arrive on the same kind of device, CUDA ones on this rank's GPU."""
        if self._identity:
            return obj
        pg, root = self._cpu_pg(), self.ranks[src]
        if self.rank_in_group == src:
            data = _pack(obj)
            dist.broadcast(torch.tensor([data.numel()], dtype=torch.int64), src=root, group=pg)
            dist.broadcast(data, src=root, group=pg)
            return obj
        n = torch.zeros(1, dtype=torch.int64)
        dist.broadcast(n, src=root, group=pg)
        data = torch.empty(int(n), dtype=torch.uint8)
        dist.broadcast(data, src=root, group=pg)
        return _unpack(data, _device)

    def barrier(self) -> None:
        """Wait for every rank of the group (over the gloo group: no GPU work)."""
        if not self._identity:
            dist.barrier(group=self._cpu_pg())


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
    tp = GroupCoordinator(list(range(tp_size)), rank, dist.group.WORLD, _cpu_world)
    dcp = None
    td = datetime.timedelta(seconds=_timeout_s)
    for ranks in groups:
        # NOTE: new_group must be called by every rank for every group, in the same order.
        g = cg = None
        if dcp_size > 1:
            g = dist.new_group(ranks, timeout=td)
            cg = dist.new_group(ranks, timeout=td, backend="gloo") if _backend != "gloo" else None
        if rank in ranks:
            dcp = GroupCoordinator(ranks, ranks.index(rank), g, cg)
    _state = ParallelState(tp, dcp, cp_kv_cache_interleave_size)
    return _state


def _rank0_check(key: str) -> bool:
    """A worker: whether store key ``key`` is set. Raises ConnectionError naming rank 0 when it is gone: a
    local worker first checks its parent process (rank 0 started it), because a store call to a dead rank 0
    (the store's host) fails only after c10d has printed a warning with a C++ stack trace; a worker on
    another host learns it from the store's own error (torch.distributed.DistNetworkError)."""
    parent = multiprocessing.parent_process()
    if parent is not None and not parent.is_alive():
        raise ConnectionError(f"rank 0 (pid {parent.pid}, this worker's parent) exited")
    return _store.check([key])


class StepChannel:
    """Rank 0 (the scheduler) sends each step's batch to the workers, in order.

    ``post(obj)`` on rank 0 / ``recv()`` on the others; ``post(None)`` tells the workers to stop. The
    object travels as ``torch.save`` bytes (``_pack``; CUDA tensors arrive on each worker's own GPU).
    With a ``link`` (``shm_channel.LocalLink``: workers that rank 0 started on its own host) the bytes
    go through shared memory, woken by semaphores; a message too long for it, and every message
    without a link (torchrun ranks), take the general path: a worker polls the rendezvous store for the
    next step's key, every 50 µs for ``BUSY_S`` (longer than the gap between a busy engine's steps),
    then with naps doubling up to ``MAX_NAP_S`` so an idle engine never trips the collective timeout,
    and the bytes follow as a gloo broadcast (``broadcast_object``; gloo also in an NCCL world: no GPU
    work). If rank 0 dies, the store connection breaks and ``recv`` raises; rank 0 waiting on a link
    calls ``check_worker(rank)`` (set by the engine; raises when that worker is gone).
    """

    MAX_NAP_S = 0.02
    BUSY_S = 0.05

    def __init__(self, group: GroupCoordinator, prefix: str = "longflash/step", link=None):
        if _store is None and group.world_size > 1:
            raise RuntimeError("StepChannel needs init_distributed first")
        self.group = group
        self.prefix = prefix
        self.step = 0
        self.link = link
        self.check_worker = lambda rank: None

    def post(self, obj, plain: bool = False, deadline_s: float | None = None) -> None:
        """Send ``obj`` to the workers. ``plain``: it holds no torch tensors (Python values and NumPy
        arrays only), so on a link it is pickled as is (tens of µs) instead of by ``torch.save``.
        ``deadline_s`` (link only; the stop message): raise TimeoutError if a live worker has not taken
        the previous message within it (by default a busy worker is waited for, with warnings)."""
        self.step += 1
        if self.group.world_size == 1:
            return
        if self.link is not None:
            data = (b"p" + pickle.dumps(obj, protocol=pickle.HIGHEST_PROTOCOL)) if plain else \
                (b"t" + _pack(obj).numpy().tobytes())
            if not self.link.write(data, _timeout_s, self.check_worker, deadline_s):
                self.group.broadcast_object(obj, src=0)   # too long for the buffer: the workers wait in it
            return
        _store.set(f"{self.prefix}/{self.step}", b"1")
        self.group.broadcast_object(obj, src=0)

    def recv(self):
        self.step += 1
        if self.link is not None:
            data = self.link.read(lambda: _rank0_check(f"{self.prefix}/alive"))  # raises if rank 0 is gone
            if data is None:
                return self.group.broadcast_object(None, src=0)
            if data[:1] == b"p":
                return pickle.loads(data[1:])
            return _unpack(torch.frombuffer(bytearray(data[1:]), dtype=torch.uint8), _device)
        key = f"{self.prefix}/{self.step}"
        nap, t0 = 5e-5, time.monotonic()
        while not _rank0_check(key):   # raises if rank 0 (the store's host) is gone
            time.sleep(nap)
            if time.monotonic() - t0 > self.BUSY_S:  # idle: back off (busy steps come within BUSY_S)
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

