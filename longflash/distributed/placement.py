"""Where a TP/DCP rank runs: its device, its process-group backend, and the NCCL environment defaults.

Pure functions (no process group, no CUDA call) except :func:`bind_rank_device`, which makes the
rank's GPU current. Placement rule (torchrun's, vLLM's): a rank uses ``cuda:<local rank>``; the local
rank is torchrun's ``LOCAL_RANK`` under torchrun, else the rank itself (the engine starts all ranks on
one host). Choose which GPUs with ``CUDA_VISIBLE_DEVICES``, never with an indexed ``--device``.
"""

from __future__ import annotations

import os
from collections.abc import Mapping, MutableMapping

import torch

# Set for NCCL process groups unless the user set them.
#  - NVLink multicast (NVLS) off: on the shared multi-GPU hosts a program using it can put the host's
#    GPUs out of service for a day or more (the device notes, KINDS.md); PyTorch's symmetric memory and
#    NVSHMEM keep theirs off too.
#  - TORCH_NCCL_ASYNC_ERROR_HANDLING=1: when a collective fails or outlives the process group's timeout
#    (``distributed_timeout_s``), PyTorch's watchdog aborts the communicators and ends the process, so
#    a dead peer takes the rank down instead of leaving it waiting on the GPU forever.
NCCL_ENV_DEFAULTS = {
    "NCCL_NVLS_ENABLE": "0",
    "TORCH_SYMM_MEM_DISABLE_MULTICAST": "1",
    "NVSHMEM_DISABLE_NVLS": "1",
    "TORCH_NCCL_ASYNC_ERROR_HANDLING": "1",
}


def default_backend(device: torch.device | str) -> str:
    """``nccl`` for CUDA devices, ``gloo`` otherwise (the CPU)."""
    return "nccl" if torch.device(device).type == "cuda" else "gloo"


def under_torchrun(environ: Mapping[str, str] | None = None) -> bool:
    """True when torchrun's ``RANK`` and ``WORLD_SIZE`` are set."""
    env = os.environ if environ is None else environ
    return "RANK" in env and "WORLD_SIZE" in env


def local_rank_of(rank: int, environ: Mapping[str, str] | None = None) -> int:
    """This rank's index among the ranks of its host: torchrun's ``LOCAL_RANK`` under torchrun, else
    ``rank`` (local processes, all on one host). Raises ValueError when torchrun's ``LOCAL_RANK`` is
    missing or not a non-negative integer."""
    env = os.environ if environ is None else environ
    if not under_torchrun(env):
        return rank
    try:
        local = int(env["LOCAL_RANK"])
    except (KeyError, ValueError) as e:
        raise ValueError(f"torchrun environment without a valid LOCAL_RANK ({e!r})") from e
    if local < 0:
        raise ValueError(f"LOCAL_RANK {local} < 0")
    return local


def local_world_size(tp_size: int, environ: Mapping[str, str] | None = None) -> int:
    """Ranks on this host: torchrun's ``LOCAL_WORLD_SIZE`` under torchrun (``tp_size`` when absent),
    else ``tp_size`` (local processes). Raises ValueError for a malformed value."""
    env = os.environ if environ is None else environ
    if not under_torchrun(env) or "LOCAL_WORLD_SIZE" not in env:
        return tp_size
    try:
        return int(env["LOCAL_WORLD_SIZE"])
    except ValueError as e:
        raise ValueError(f"malformed LOCAL_WORLD_SIZE: {e}") from e


def check_visible_gpus(tp_size: int, visible: int, ranks_on_host: int | None = None) -> None:
    """Raise ValueError unless this host shows a GPU for each of its ranks.

    ``ranks_on_host`` is torchrun's ``LOCAL_WORLD_SIZE`` (None: all ``tp_size`` ranks are local), e.g.
    ``-tp 4 needs 4 GPUs, 1 visible``.
    """
    need = tp_size if ranks_on_host is None else ranks_on_host
    if need > visible:
        where = "" if ranks_on_host is None else f" on this host (torchrun LOCAL_WORLD_SIZE {ranks_on_host})"
        raise ValueError(f"-tp {tp_size} needs {need} GPUs{where}, {visible} visible "
                         "(check CUDA_VISIBLE_DEVICES, or run on the CPU with --device cpu)")


def check_parallel_device(device: str | torch.device, tp_size: int, visible: int,
                          environ: Mapping[str, str] | None = None) -> None:
    """Start-up checks of a ``tp_size > 1`` engine on ``device``: a CUDA device must be unindexed
    (each rank takes ``cuda:<local rank>``) and the host must show a GPU per local rank.
    Raises ValueError otherwise; the CPU always passes."""
    dev = torch.device(device)
    if dev.type != "cuda" or tp_size == 1:
        return
    if dev.index is not None:
        raise ValueError(f"device {dev} with tensor_parallel_size {tp_size}: each rank uses cuda:<local rank>; "
                         "pass --device cuda and choose the GPUs with CUDA_VISIBLE_DEVICES")
    env = os.environ if environ is None else environ
    check_visible_gpus(tp_size, visible, local_world_size(tp_size, env) if under_torchrun(env) else None)


def rank_device(device: str | torch.device, local_rank: int) -> torch.device:
    """The device of the rank with ``local_rank``: ``cuda:<local_rank>`` for a CUDA ``device``, the
    CPU unchanged. Raises ValueError for an indexed CUDA device (see :func:`check_parallel_device`)
    or a negative ``local_rank``."""
    dev = torch.device(device)
    if dev.type != "cuda":
        return dev
    if dev.index is not None:
        raise ValueError(f"rank_device needs an unindexed CUDA device, got {dev}")
    if local_rank < 0:
        raise ValueError(f"local rank {local_rank} < 0")
    return torch.device("cuda", local_rank)


def nccl_env_defaults(environ: Mapping[str, str] | None = None) -> dict[str, str]:
    """The entries of :data:`NCCL_ENV_DEFAULTS` that ``environ`` does not set (a user's value always
    wins, even an empty one)."""
    env = os.environ if environ is None else environ
    return {k: v for k, v in NCCL_ENV_DEFAULTS.items() if k not in env}


def apply_nccl_env_defaults(environ: MutableMapping[str, str] | None = None) -> dict[str, str]:
    """Set :func:`nccl_env_defaults` in ``environ`` (default ``os.environ``, read by NCCL and PyTorch
    when the process group is created); returns what was set."""
    env = os.environ if environ is None else environ
    missing = nccl_env_defaults(env)
    env.update(missing)
    return missing


def restore_location(location: str, device: torch.device | None) -> str:
    """Where a tensor that another rank serialized at ``location`` ("cpu", "cuda:3", ...) lands on a
    rank whose device is ``device``: CUDA tensors move to this rank's GPU, the rest stay put (used by
    the step channel: rank 0's ``cuda:0`` batch must not land on GPU 0 of a worker)."""
    if device is not None and device.type == "cuda" and location.startswith("cuda"):
        return str(device)
    return location


def bind_rank_device(device: str | torch.device, tp_size: int, rank: int = 0) -> torch.device:
    """This process's device, made current: with ``tp_size > 1`` and a CUDA ``device``,
    ``cuda:<local rank>`` (``rank`` for local processes, torchrun's ``LOCAL_RANK`` under torchrun) and
    ``torch.cuda.set_device`` on it, before anything is allocated there; else ``device`` as given, made
    current when it is an indexed CUDA device (``cuda:1``: Triton launches its kernels on the current
    device, not on their tensors').

    Raises ValueError when the host shows fewer GPUs than the local rank needs.
    """
    dev = torch.device(device)
    if tp_size == 1 or dev.type != "cuda":
        if dev.type == "cuda" and dev.index is not None:
            torch.cuda.set_device(dev)
        return dev
    local = local_rank_of(rank)
    visible = torch.cuda.device_count()
    if local >= visible:
        raise ValueError(f"-tp {tp_size}: local rank {local} needs GPU {local}, {visible} visible")
    out = rank_device(dev, local)
    torch.cuda.set_device(out)
    return out
