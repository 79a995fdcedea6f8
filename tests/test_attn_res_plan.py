"""AttnRes output-storage reuse (issue 7, invariant 5 and 6 of DESIGN.md): the lifetime plan for the
real Kimi-K3 schedule is bitwise equal to separate allocation; the production fault (layer 84's
attention output written into the eighth slot) is rejected by the checker and changes outputs when
forced; the engine gives identical logits with reuse on and off."""

import json
import math
import os
import sys

import pytest
import torch

from longflash import LLM
from longflash.models.attn_res_plan import (PlanError, attn_res_bytes_per_token, attn_res_plan, attn_res_schedule,
                                            check_plan, plan_storage, production_bug_plan)
from longflash.training.config import default_model_config

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "benchmarks"))
from attn_res_harness import RandomSublayers, run_harness  # noqa: E402
from test_kimi_k3 import SMALL, _save_random  # noqa: E402

K3 = (93, 12)


@pytest.fixture(autouse=True, scope="module")
def _one_thread():
    """Thousands of tiny ops: one intra-op thread avoids spin-waiting on a shared, busy CPU."""
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)


def _input(T, H, dtype, seed):
    return torch.randn(T, H, generator=torch.Generator().manual_seed(seed)).to(dtype)


def _reference(x, sub, num_layers, bs):
    """The spec's order of operations written directly (Python list bank, fresh tensors)."""
    def fresh(t):
        return torch.empty_like(t)
    prefix, bank = x.clone(), []
    for l in range(num_layers):
        n, wr = math.ceil(l / bs), l % bs == 0
        h = sub.mix(l, "attn_mix", bank[:n] + [prefix], fresh(x))
        if wr:
            bank.append(prefix)
        a = sub.attn(l, h, fresh(x))
        prefix = a if wr else prefix + a
        h = sub.mix(l, "mlp_mix", bank[:n + int(wr)] + [prefix], fresh(x))
        prefix = prefix + sub.mlp(l, h, fresh(x))
    return sub.mix(None, "output_mix", bank + [prefix], fresh(x)), bank


def _equal(res_a, res_b):
    return torch.equal(res_a.y, res_b.y) and len(res_a.bank) == len(res_b.bank) and \
        all(torch.equal(a, b) for a, b in zip(res_a.bank, res_b.bank))


def test_k3_plan_pool_and_bytes_per_token():
    sched, plan = attn_res_plan(*K3)
    check_plan(sched, plan)
    assert sched.num_bank_slots == 8
    # 8 bank slots + the prefix + one mixer/sublayer output; separate allocation peaks one higher.
    assert plan.pool_size == 10 and sched.max_live_separate() == 11
    assert attn_res_plan(*K3) is attn_res_plan(*K3)  # computed once per (num_layers, block size)
    b = attn_res_bytes_per_token(dict(hidden_size=7168, num_hidden_layers=93, attn_res_block_size=12),
                                 torch.bfloat16)
    assert (b.bank, b.prefix, b.bank_plus_prefix, b.pool, b.separate_peak) == \
        (8 * 14336, 14336, 9 * 14336, 10 * 14336, 11 * 14336)
    d = attn_res_bytes_per_token(default_model_config(), torch.float32)  # 14 layers, block 4: NB = 4
    assert d.bank_plus_prefix == 5 * 256 * 4


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_k3_lifetime_harness_bitwise_equal_to_separate_allocation(dtype):
    T, H = 64, 128
    sched, plan = attn_res_plan(*K3)
    sub = RandomSublayers(K3[0], H, dtype, "cpu", seed=3)
    for rep in range(3):
        x = _input(T, H, dtype, seed=rep)
        on = run_harness(sched, plan, x, sub, reuse=True)
        off = run_harness(sched, plan, x, sub, reuse=False)
        assert on.pool is not None and on.pool.shape == (10, T, H)
        # Reuse really happened: the output and every bank slot are views of the one pool.
        ptr = on.pool.untyped_storage().data_ptr()
        assert all(t.untyped_storage().data_ptr() == ptr for t in on.bank + [on.y])
        assert _equal(on, off), f"rep {rep}: reuse differs from separate allocation"
        if rep == 0:
            y_ref, bank_ref = _reference(x, sub, *K3)
            assert torch.equal(off.y, y_ref) and all(torch.equal(a, b) for a, b in zip(off.bank, bank_ref))
        assert not torch.equal(on.bank[7], on.bank[6])  # inputs are not degenerate


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_production_bug_rejected_and_changes_outputs(dtype):
    sched, bug = production_bug_plan(*K3)
    _, good = attn_res_plan(*K3)
    assert bug.storage["a[84]"] == good.storage[sched.bank[7]]  # the eighth slot's storage
    with pytest.raises(PlanError, match=r"^layer 84 attn: writing a\[84\] into pool buffer 7 overwrites bank\[7\]"):
        check_plan(sched, bug)
    T, H = 64, 128
    sub = RandomSublayers(K3[0], H, dtype, "cpu", seed=3)
    x = _input(T, H, dtype, seed=0)
    ok = run_harness(sched, good, x, sub, reuse=False)
    forced = run_harness(sched, bug, x, sub, reuse=True)
    changed = int((forced.y != ok.y).sum())
    assert changed > T * H // 4, changed  # a large part of the output, as in production
    assert torch.equal(forced.bank[6], ok.bank[6]) and not torch.equal(forced.bank[7], ok.bank[7])


SCHEDULES = [(14, 4), (12, 4), (12, 3), (5, 5), (7, 10), (6, 1), (1, 1), (2, 1), (13, 12)]


@pytest.mark.parametrize("num_layers,bs", SCHEDULES)
def test_other_schedules(num_layers, bs):
    T, H = 8, 32
    sched, plan = attn_res_plan(num_layers, bs)
    nb = math.ceil(num_layers / bs)
    assert sched.num_bank_slots == nb and plan.pool_size == nb + 2
    sub = RandomSublayers(num_layers, H, torch.float32, "cpu", seed=num_layers * 100 + bs)
    for rep in range(3):
        x = _input(T, H, torch.float32, seed=rep)
        on, off = run_harness(sched, plan, x, sub, True), run_harness(sched, plan, x, sub, False)
        assert _equal(on, off)
    y_ref, bank_ref = _reference(x, sub, num_layers, bs)
    assert torch.equal(off.y, y_ref) and all(torch.equal(a, b) for a, b in zip(off.bank, bank_ref))
    # The same fault at this schedule's last commit layer: rejected, and it changes outputs.
    last = (nb - 1) * bs
    bsched, bug = production_bug_plan(num_layers, bs)
    with pytest.raises(PlanError, match=rf"^layer {last} attn: .* overwrites bank\[{nb - 1}\]"):
        check_plan(bsched, bug)
    assert not torch.equal(run_harness(bsched, bug, x, sub, True).y, off.y)


def test_checker_accepts_only_plans_that_keep_outputs():
    """Every single-value re-pin of the (7 layers, block 3) plan: a plan the checker accepts is bitwise
    equal to separate allocation (the checker is sound). It is conservative on purpose: a mixer writing
    over its own source is rejected even though the reference mixer happens to read all sources first."""
    L, bs, T, H = 7, 3, 4, 16
    sched, plan = attn_res_plan(L, bs)
    sub = RandomSublayers(L, H, torch.float32, "cpu", seed=7)
    x = _input(T, H, torch.float32, seed=9)
    ref = run_harness(sched, plan, x, sub, reuse=False)
    accepted = rejected = 0
    for v in sched.writer_of:
        for s in range(plan.pool_size):
            if s == plan.storage[v]:
                continue
            cand = plan_storage(sched, pins={v: s})
            try:
                check_plan(sched, cand)
            except PlanError as e:
                assert str(e).startswith("layer ") or str(e).startswith("output_mix")
                rejected += 1
                continue
            accepted += 1
            assert _equal(run_harness(sched, cand, x, sub, reuse=True), ref), (v, s)
    assert rejected > 0 and accepted > 0


def test_checker_rejects_stale_read_and_missing_storage():
    sched = attn_res_schedule(4, 2)
    plan = plan_storage(sched)
    broken = type(plan)(dict(plan.storage), plan.pool_size)
    del broken.storage["h_mlp[2]"]
    with pytest.raises(PlanError, match=r"layer 2 mlp_mix: output h_mlp\[2\] has no storage"):
        check_plan(sched, broken)
    # A mixer may not write over one of its own sources (the prefix it is reading).
    bad = plan_storage(sched, pins={"h_attn[1]": plan.storage["a[0]"]})
    with pytest.raises(PlanError, match=r"layer 1 attn_mix: writing h_attn\[1\] into pool buffer \d+ overwrites p_mlp\[0\]"):
        check_plan(sched, bad)


def _engine_logits_on_off(path, prompts):
    llm = LLM(path, skip_tokenizer_init=True, dtype="float32", block_size=4, num_gpu_blocks=256,
              enable_prefix_caching=False)  # a prefix-cache hit would score the second pass differently
    model = llm.engine.model.model
    assert model.attn_res_reuse is True
    on = [llm.engine.score(p) for p in prompts]
    model.attn_res_reuse = False
    off = [llm.engine.score(p) for p in prompts]
    return on, off


PROMPTS = [list(range(3, 40)), [7], [100 + (i * 37) % 400 for i in range(23)]]


def test_engine_k3_test_config_reuse_on_off_identical(tmp_path):
    cfg = default_model_config(**SMALL)
    ref = _save_random(tmp_path / "k3", cfg, seed=5)
    on, off = _engine_logits_on_off(str(tmp_path / "k3"), PROMPTS)
    assert all(torch.equal(a, b) for a, b in zip(on, off))
    with torch.no_grad():
        want = ref(torch.tensor([PROMPTS[0]]))[0]
    assert ((on[0] - want).abs().max() / want.abs().max()).item() <= 1e-4
    # The option also comes from the model config (``attn_res_reuse``).
    (tmp_path / "k3" / "config.json").write_text(json.dumps(dict(cfg, attn_res_reuse=False)))
    llm = LLM(str(tmp_path / "k3"), skip_tokenizer_init=True, dtype="float32", num_gpu_blocks=64)
    assert llm.engine.model.model.attn_res_reuse is False
    assert torch.equal(llm.engine.score(PROMPTS[0]), on[0])


def test_engine_default_model_reuse_on_off_identical(tmp_path):
    """The default model's config (14 layers, block 4); the shipped weights when present, else random."""
    try:
        from longflash.default_model_path import default_model_path
        path = default_model_path()
    except FileNotFoundError:
        path = str(tmp_path / "default")
        _save_random(tmp_path / "default", default_model_config(), seed=2)
    on, off = _engine_logits_on_off(path, PROMPTS[:2])
    assert all(torch.equal(a, b) for a, b in zip(on, off))
