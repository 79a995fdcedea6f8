"""The two-launch row argmax (``runner/argmax_triton.py``) equals ``torch.argmax(logits, dim=-1)``: on the CPU
under ``TRITON_INTERPRET=1`` (a subprocess: set before Triton is imported) for ties inside and across chunks,
NaN (the first NaN wins, also over +inf), all -inf rows, a vocabulary that is not a multiple of the chunk, fp32
/ fp16 / bf16 rows and a strided row stride; bad input is refused by name; the engine's dispatch
(``sampler.row_argmax``) takes torch off CUDA; on the GPU (skipped without CUDA) at DeepSeek-V3's vocabulary,
batch 1 and 64, random and tied rows."""

import pytest
import torch

from interpreter_run import run_interpreted
from longflash.runner.sampler import row_argmax


def _cases():
    g = torch.Generator().manual_seed(0)
    V = 2 * 1024 + 37
    x = torch.randn(9, V, generator=g)
    x[1, 5] = x[1, 1500] = x[1, 2070] = 50.0          # a tie across chunks: the first
    x[2, 700] = x[2, 701] = 50.0                       # a tie inside a chunk
    x[3, 1800] = float("nan")                          # NaN is the maximum
    x[3, 3] = float("inf")
    x[4, 2000] = float("nan")
    x[4, 1030] = float("nan")                          # the first NaN
    x[5] = float("-inf")                               # all -inf: index 0
    x[6, V - 1] = 60.0                                 # the last, masked-tail chunk
    x[7, :] = 1.0                                      # all equal: 0
    cases = {"fp32": x, "fp16": x.half(), "bf16": x.bfloat16(),
             "strided rows": torch.randn(4, V + 64, generator=g)[:, :V], "one row": x[6:7].clone(),
             "small vocab": torch.randn(3, 5, generator=g)}
    return cases


def _interpreter_check() -> dict:
    from longflash.runner.argmax_triton import argmax_triton
    return {k: bool(torch.equal(argmax_triton(v), torch.argmax(v, dim=-1))) for k, v in _cases().items()}


def test_argmax_equals_torch_interpreter():
    got = run_interpreted("import json, sys; sys.path.insert(0, 'tests'); import test_argmax_triton as t; "
                          "print('RESULT' + json.dumps(t._interpreter_check()))")
    assert len(got) == len(_cases()) and all(got.values()), got


def test_bad_input_and_cpu_dispatch():
    pytest.importorskip("triton")
    from longflash.runner.argmax_triton import argmax_triton
    for bad, msg in ((torch.randn(2, 3, 4), r"\[B, V\]"), (torch.randn(2, 8).double(), r"\[B, V\]"),
                     (torch.randn(2, 0), "non-empty"), (torch.randn(8, 2).t(), "contiguous")):
        with pytest.raises(ValueError, match=msg):
            argmax_triton(bad)
    x = _cases()["fp32"]
    assert torch.equal(row_argmax(x), torch.argmax(x, dim=-1))  # the CPU takes torch


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_gpu_vocabulary_sizes():
    from longflash.runner.argmax_triton import argmax_triton
    g = torch.Generator(device="cuda").manual_seed(1)
    for B in (1, 64):
        for dt in (torch.float32, torch.bfloat16):
            x = torch.randn(B, 129280, generator=g, device="cuda").to(dt)
            x[0, 77] = x[0, 129000] = 30.0
            assert torch.equal(argmax_triton(x), torch.argmax(x, dim=-1)), (B, dt)
            assert torch.equal(row_argmax(x), torch.argmax(x, dim=-1))
    for k, v in _cases().items():
        v = v.cuda()
        assert torch.equal(argmax_triton(v), torch.argmax(v, dim=-1)), k
