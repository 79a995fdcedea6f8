"""The GPU wiring of tensor / decode-context parallelism (issue 6) that the CPU can check: device and
backend selection (``distributed/placement.py``), NCCL environment defaults that never override the
user's, the too-few-GPUs and indexed-device errors at start-up, where a received step's tensors land,
and the object broadcast / one-rank-group path of ``comm`` over a real (gloo) process group.

The NCCL runs themselves are in ``tests/test_dcp_nccl_gpu.py`` (needs >= 2 GPUs) and
``benchmarks/nccl_smoke.py`` (one GPU: a world-size-1 NCCL group through ``comm``).
"""

from __future__ import annotations

import pytest
import torch

from longflash.config import EngineConfig
from longflash.distributed import comm, placement
from longflash.runner.context import ForwardContext

TORCHRUN = {"RANK": "5", "WORLD_SIZE": "8", "MASTER_ADDR": "h0", "MASTER_PORT": "29500", "LOCAL_RANK": "1",
            "LOCAL_WORLD_SIZE": "4"}


def test_backend_and_rank_device():
    assert placement.default_backend("cpu") == "gloo" and placement.default_backend("cuda") == "nccl"
    assert placement.default_backend(torch.device("cuda", 3)) == "nccl"
    # local processes: rank r -> cuda:r; torchrun: LOCAL_RANK, not RANK
    assert placement.local_rank_of(3, {}) == 3
    assert placement.local_rank_of(0, {"LOCAL_RANK": "2"}) == 0          # a stray LOCAL_RANK outside torchrun
    assert placement.local_rank_of(0, TORCHRUN) == 1
    assert placement.rank_device("cuda", 3) == torch.device("cuda", 3)
    assert placement.rank_device("cpu", 3) == torch.device("cpu")
    with pytest.raises(ValueError, match="LOCAL_RANK"):
        placement.local_rank_of(0, {k: v for k, v in TORCHRUN.items() if k != "LOCAL_RANK"})
    with pytest.raises(ValueError, match="unindexed"):
        placement.rank_device("cuda:1", 0)
    assert placement.local_world_size(8, TORCHRUN) == 4 and placement.local_world_size(8, {}) == 8
    # one process / CPU: the device as given, nothing bound
    assert placement.bind_rank_device("cpu", 4, rank=2) == torch.device("cpu")
    assert placement.bind_rank_device("cuda", 1) == torch.device("cuda")


def test_one_process_on_an_indexed_gpu_makes_it_current(monkeypatch):
    """``--device cuda:1`` without TP: the device becomes current (Triton launches on the current device)."""
    calls = []
    monkeypatch.setattr(torch.cuda, "set_device", calls.append)
    assert placement.bind_rank_device("cuda:1", 1) == torch.device("cuda", 1)
    assert placement.bind_rank_device("cuda", 1) == torch.device("cuda")  # unindexed: left as it is
    assert calls == [torch.device("cuda", 1)]


def test_nccl_env_defaults_never_override_the_user():
    assert placement.NCCL_ENV_DEFAULTS["NCCL_NVLS_ENABLE"] == "0"
    assert placement.NCCL_ENV_DEFAULTS["TORCH_NCCL_ASYNC_ERROR_HANDLING"] == "1"
    env = {"NCCL_NVLS_ENABLE": "1", "TORCH_NCCL_ASYNC_ERROR_HANDLING": "", "PATH": "/bin"}
    assert placement.nccl_env_defaults(env) == {"TORCH_SYMM_MEM_DISABLE_MULTICAST": "1", "NVSHMEM_DISABLE_NVLS": "1"}
    set_ = placement.apply_nccl_env_defaults(env)
    assert set_ == {"TORCH_SYMM_MEM_DISABLE_MULTICAST": "1", "NVSHMEM_DISABLE_NVLS": "1"}
    assert env["NCCL_NVLS_ENABLE"] == "1" and env["TORCH_NCCL_ASYNC_ERROR_HANDLING"] == ""  # the user's values
    assert placement.apply_nccl_env_defaults(env) == {}
    fresh: dict = {}
    placement.apply_nccl_env_defaults(fresh)
    assert fresh == placement.NCCL_ENV_DEFAULTS


def test_too_few_gpus_and_indexed_device_are_refused_at_start():
    with pytest.raises(ValueError, match=r"^-tp 4 needs 4 GPUs, 1 visible"):
        placement.check_visible_gpus(4, 1)
    placement.check_visible_gpus(2, 8)
    with pytest.raises(ValueError, match=r"-tp 8 needs 4 GPUs on this host \(torchrun LOCAL_WORLD_SIZE 4\), 2 visible"):
        placement.check_parallel_device("cuda", 8, 2, TORCHRUN)
    placement.check_parallel_device("cuda", 8, 4, TORCHRUN)
    placement.check_parallel_device("cpu", 8, 0, {})
    with pytest.raises(ValueError, match="CUDA_VISIBLE_DEVICES"):
        placement.check_parallel_device("cuda:1", 2, 8, {})
    # through EngineConfig: the NotImplementedError of the CPU-only days is gone, the checks stay
    visible = torch.cuda.device_count()
    tp = max(2, visible + 1)
    with pytest.raises(ValueError, match=rf"-tp {tp} needs {tp} GPUs, {visible} visible"):
        EngineConfig(model="x", tensor_parallel_size=tp, device="cuda")
    with pytest.raises(ValueError, match="cuda:<local rank>"):
        EngineConfig(model="x", tensor_parallel_size=2, device="cuda:0")
    with pytest.raises(ValueError, match="must divide"):
        EngineConfig(model="x", tensor_parallel_size=2, decode_context_parallel_size=4, device="cuda")
    EngineConfig(model="x", tensor_parallel_size=2, decode_context_parallel_size=2, device="cpu")


def test_received_cuda_tensors_land_on_the_receivers_gpu():
    cuda1 = torch.device("cuda", 1)
    assert placement.restore_location("cuda:0", cuda1) == "cuda:1"
    assert placement.restore_location("cuda", cuda1) == "cuda:1"
    assert placement.restore_location("cpu", cuda1) == "cpu"          # host-side tensors stay on the host
    assert placement.restore_location("cuda:0", torch.device("cpu")) == "cuda:0"
    assert placement.restore_location("cpu", None) == "cpu"


def _ctx() -> ForwardContext:
    t = torch.arange(6)
    return ForwardContext(positions=t, slot_mapping=t + 10, query_start_loc=torch.tensor([0, 2, 6], dtype=torch.int32),
                          seq_lens=torch.tensor([2, 4], dtype=torch.int32),
                          context_lens=torch.zeros(2, dtype=torch.int32),
                          block_table=torch.tensor([[0], [1]], dtype=torch.int32), is_decode=[False, False],
                          query_start_loc_cpu=[0, 2, 6], seq_lens_cpu=[2, 4], context_lens_cpu=[0, 0], block_size=4,
                          extras={"all_logits": True, "w": torch.randn(3, dtype=torch.bfloat16)})


def test_step_object_round_trip_and_one_rank_group_over_a_real_process_group():
    """The step channel's payload survives ``_pack``/``_unpack`` (dtypes, devices, extras); a
    one-rank coordinator *with* a process group runs real collectives (the path ``nccl_smoke.py``
    takes on one GPU), one without is the identity."""
    step = (torch.tensor([3, 4, 5]), _ctx(), None)
    back = comm._unpack(comm._pack(step), torch.device("cpu"))
    assert torch.equal(back[0], step[0]) and back[2] is None
    for f in ("positions", "slot_mapping", "query_start_loc", "seq_lens", "block_table"):
        a, b = getattr(back[1], f), getattr(step[1], f)
        assert a.dtype == b.dtype and a.device.type == "cpu" and torch.equal(a, b)
    assert back[1].seq_lens_cpu == [2, 4] and back[1].extras["all_logits"] is True
    assert torch.equal(back[1].extras["w"], step[1].extras["w"])

    alone = comm.GroupCoordinator([0], 0)
    x = torch.ones(2)
    assert alone.all_reduce(x) is x and alone.broadcast_object(step) is step
    assert comm.backend() is None
    comm.init_distributed(0, 1, comm.free_port(), timeout_s=20)
    try:
        assert comm.backend() == "gloo"
        g = comm.GroupCoordinator([0], 0, torch.distributed.group.WORLD)
        assert g.all_reduce(torch.tensor([2.0, -1.0]), op="max").tolist() == [2.0, -1.0]
        assert g.all_gather(torch.arange(6.0).view(2, 3), dim=1).tolist() == [[0, 1, 2], [3, 4, 5]]
        assert g.reduce_scatter(torch.arange(4.0), dim=0).tolist() == [0, 1, 2, 3]
        assert g.broadcast_object({"step": 7}) == {"step": 7}
        g.barrier()
    finally:
        comm.destroy_distributed()
    assert comm.backend() is None


def test_nccl_backend_needs_an_indexed_cuda_device():
    with pytest.raises(ValueError, match="indexed CUDA device"):
        comm.init_distributed(0, 1, 1, device="cuda")
    with pytest.raises(ValueError, match="indexed CUDA device"):
        comm.init_distributed(0, 1, 1, backend="nccl", device="cpu")
