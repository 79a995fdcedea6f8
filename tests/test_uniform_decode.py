"""Uniform decode/verify steps on persistent inputs (the path CUDA graphs capture) equal the general
step on the CPU: a padded decode step and a padded DFlash verify step of the default model (rows
padded to the graph bucket, lengths bounded by the cache capacity, exactly what a graph replays),
the drafter's padded block forward, and greedy generation with the whole path switched on (MLA and
GQA models). The sync-free ops they use are tested in ``test_sync_free_ops.py``; graph replay itself
in ``test_cuda_graphs.py`` (GPU only)."""

import pytest
import torch

from longflash import LLM, SamplingParams
from longflash.runner.cuda_graph import capture_sizes, prepare_uniform_model, uniform_query_len
from longflash.runner.step_inputs import StepInputs

KW = dict(max_num_seqs=8, max_num_batched_tokens=96, block_size=4)
PROMPTS = ["def fibonacci(n):", "import os\nimport sys\n", "To be, or not to be,"]


def _close(a: torch.Tensor, b: torch.Tensor) -> float:
    """max |a - b| relative to max(1, max |b|) (fp32: summation order differs with the batch shape)."""
    return float((a - b).abs().max() / max(1.0, float(b.abs().max())))


def test_capture_sizes_and_step_inputs():
    assert capture_sizes(64) == [1, 2, 4, 8, 16, 32, 48, 64]
    assert capture_sizes(3) == [1, 2, 3] and capture_sizes(1) == [1]
    inp = StepInputs({"a": (torch.int32, (3,)), "b": (torch.int64, (2, 2))}, torch.device("cpu"))
    inp.host["a"][:] = [1, 2, 3]
    inp.host["b"][1] = [7, 8]
    inp.copy_to_device()
    assert inp.dev["a"].tolist() == [1, 2, 3] and inp.dev["b"][1].tolist() == [7, 8]
    assert inp.dev["b"].data_ptr() % 8 == 0 and inp.dev["a"].data_ptr() % 4 == 0


def _decoding_step(engine, steps: int = 4):
    """A scheduled step after ``steps`` steps of the prompts (all requests decoding), with drafts
    proposed by the general path when the engine speculates."""
    params = SamplingParams(temperature=0, max_tokens=200, ignore_eos=True)
    for p in PROMPTS:
        engine.add_request(None, p, params)
    for _ in range(steps):
        engine.step()
    sched = engine.scheduler.schedule(engine._lookahead if engine.proposer else None)
    reqs = [(s.seq.token_ids[-1], s.seq.num_computed_tokens, s.num_lookahead_tokens, s.seq.block_table)
            for s in sched.scheduled if s.num_lookahead_tokens]
    drafts = engine.proposer.propose(reqs) if reqs else []
    for s, d in zip([s for s in sched.scheduled if s.num_lookahead_tokens], drafts):
        s.seq.spec_token_ids = d
    return sched, reqs, drafts


@pytest.mark.parametrize("spec,prepared", [("off", False), (None, False), ("off", True)])
def test_padded_static_step_equals_general_step(spec, prepared):
    """Default model, 3 requests padded to the bucket of 4 with the capacity bound: a plain decode
    step (spec off) and a DFlash verify step of 8 tokens per request (spec on), logits and fc outputs.
    ``prepared``: with the GPU's decode-time fusions applied first (``prepare_uniform_model``: fused
    gate_up and q_a/kv_a GEMMs, MLA's transposed W_UK copy for the query absorption)."""
    engine = LLM(speculative_config=spec, **KW).engine
    sched, reqs, drafts = _decoding_step(engine)
    q = uniform_query_len(sched.scheduled)
    assert q == (1 if spec == "off" else 8) and len(sched.scheduled) == 3
    # fewer drafts near max_tokens: still whole blocks, the first n slots returned
    short = [(p, s, n, t) for (p, s, _, t), n in zip(reqs, (7, 3, 1))]
    short_drafts = engine.proposer.propose(short) if reqs else []
    general = engine.runner.execute(sched, proposer=engine.proposer)
    g_logits, g_aux = general.logits.clone(), None if general.aux is None else general.aux.clone()
    if prepared:
        from longflash.attention.mla import MLAAttention
        prepare_uniform_model(engine.model)
        mla = [m for m in engine.model.modules() if isinstance(m, MLAAttention)]
        assert mla and all(m.w_uk_t is not None and m.w_uk_t.is_contiguous() and
                           torch.equal(m.w_uk_t, m._w_uk_uv()[0].transpose(1, 2)) for m in mla)
    engine.enable_uniform_decode(cuda_graphs=False)
    engine.runner.decode_runner.pad_like_graph = True
    if engine.proposer is not None:
        engine.proposer.uniform.pad_like_graph = True
        assert engine.proposer.propose(reqs) == drafts
        assert engine.proposer.propose(short) == short_drafts and [len(d) for d in short_drafts] == [7, 3, 1]
    static = engine.runner.execute(sched, proposer=engine.proposer)
    assert static.ctx.uniform_decode and static.logits.shape[0] == 3 * q
    for (r0, n0), (r1, n1) in zip(general.spans, static.spans):
        assert n0 == n1 == q
        assert _close(static.logits[r1:r1 + n1], g_logits[r0:r0 + n0]) <= 1e-6
    if g_aux is not None:
        assert _close(static.aux, g_aux) <= 1e-6


def test_drafter_padded_forward_equals_general():
    import os

    from longflash.default_model_path import default_model_path
    from longflash.spec_decode.dflash_model import load_drafter
    drafter = load_drafter(os.path.join(default_model_path(), "drafter"), 14, torch.float32, torch.device("cpu"))
    g = torch.Generator().manual_seed(0)
    kvh, hd = drafter.kv_row_shape()
    for attn in drafter.attention_layers():
        attn.kv_cache = torch.randn(2, 12, 4, kvh, hd, generator=g)
    bk, ctx_lens = 8, [5, 0, 11]
    tables = [[3, 7], [], [1, 9, 4]]
    bt = torch.full((3, 4), -1, dtype=torch.int32)
    for i, t in enumerate(tables):
        bt[i, :len(t)] = torch.tensor(t)
    x = torch.randn(3 * bk, drafter.cfg.hidden_size, generator=g)
    pos = torch.cat([torch.arange(s, s + bk) for s in ctx_lens])
    with torch.inference_mode():
        ref = drafter(x, pos, [0, bk, 2 * bk, 3 * bk], ctx_lens, bt)
        out = drafter.forward_padded(x, pos, torch.tensor(ctx_lens, dtype=torch.int32), bt, 16)
    assert _close(out, ref) <= 1e-6


def test_generation_with_static_padded_path_equals_default():
    """Greedy tokens of the whole engine with the uniform path on (padded like graphs, DFlash on)
    equal the default engine's, and the uniform path did run."""
    params = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True)
    ref = [o.outputs[0].token_ids for o in LLM(**KW).generate(PROMPTS, params)]
    llm = LLM(**KW)
    llm.engine.enable_uniform_decode(cuda_graphs=False)
    runner, drafter = llm.engine.runner.decode_runner, llm.engine.proposer.uniform
    runner.pad_like_graph = drafter.pad_like_graph = True
    calls = {"steps": 0}
    run = runner.run

    def counting_run(*a, **k):
        calls["steps"] += 1
        return run(*a, **k)
    runner.run = counting_run
    assert [o.outputs[0].token_ids for o in llm.generate(PROMPTS, params)] == ref
    assert calls["steps"] >= 3


def test_qwen3_gqa_generation_with_static_path_equals_default(tiny_model):
    path = tiny_model("qwen3-untied")
    params = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
    prompts = [[5, 9, 11, 20], [7, 3], [40, 41, 42, 43, 44, 45]]
    kw = dict(model=path, max_num_seqs=4, block_size=4, skip_tokenizer_init=True)
    ref = [o.outputs[0].token_ids for o in LLM(**kw).generate([{"prompt_token_ids": p} for p in prompts], params)]
    llm = LLM(**kw)
    llm.engine.enable_uniform_decode(cuda_graphs=False)
    llm.engine.runner.decode_runner.pad_like_graph = True
    assert [o.outputs[0].token_ids for o in llm.generate([{"prompt_token_ids": p} for p in prompts], params)] == ref


class _HostReads:
    """Records ops that read device values on the host or copy Python data to the device (a sync or an
    uncapturable copy on CUDA), with the longflash line that called them."""

    OPS = {"_local_scalar_dense", "item", "nonzero", "unique", "_unique2", "unique_consecutive", "masked_select",
           "lift_fresh", "bincount", "is_nonzero", "equal", "repeat_interleave"}

    def __init__(self):
        from torch.utils._python_dispatch import TorchDispatchMode

        hits = self.hits = []

        class Mode(TorchDispatchMode):
            def __torch_dispatch__(self, func, types, args=(), kwargs=None):
                if func.overloadpacket.__name__ in _HostReads.OPS:
                    import traceback
                    frames = [f for f in traceback.extract_stack() if "/longflash/" in f.filename]
                    if frames:
                        hits.append((func.overloadpacket.__name__, f"{frames[-1].filename}:{frames[-1].lineno}"))
                return func(*args, **(kwargs or {}))
        self.mode = Mode()


def test_uniform_forwards_never_read_device_values(monkeypatch):
    """What the graphs hold (the padded target verify forward with DFlash taps, the drafter's padded
    block forward) runs no op that reads a device value on the host, on the CPU references; MoE goes
    through the capture-safe dispatch (on CUDA: its Triton kernel) instead of the eager one."""
    from longflash.layers import moe
    from longflash.layers.moe_grouped import grouped_experts_ref

    def capture_safe(h, experts, w, ids):
        from longflash.layers.moe_grouped import stack_expert_weights
        if not hasattr(experts, "_stack"):
            experts._stack = stack_expert_weights(experts)
        return grouped_experts_ref(h, *experts._stack, w, ids, experts[0].act_and_mul)
    monkeypatch.setattr(moe, "run_experts", capture_safe)
    engine = LLM(**KW).engine
    sched, reqs, _ = _decoding_step(engine, steps=3)
    engine.enable_uniform_decode(cuda_graphs=False)
    runner, drafter = engine.runner.decode_runner, engine.proposer.uniform
    q = uniform_query_len(sched.scheduled)
    reads = _HostReads()
    with torch.inference_mode():
        seq_lens, ctx_lens = runner._fill(runner.plan(sched.scheduled, q), 4)
        drafter._fill(reqs, 4)
        with reads.mode:
            runner._forward(runner._context(4, q, runner.capacity, seq_lens + [q], ctx_lens + [0]), engine.proposer)
            drafter._forward(4, drafter.capacity)
    assert q == 8 and reads.hits == []


def test_chained_drafts_equal_fresh_proposals():
    """A uniform verify step also drafts the next block on the device (greedy acceptance assumed):
    when the engine takes those drafts, they equal what the proposer drafts afresh from the same
    state, and greedy output still equals the engine without speculative decoding."""
    params = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
    ref = [o.outputs[0].token_ids for o in LLM(speculative_config="off", **KW).generate(PROMPTS, params)]
    llm = LLM(**KW)
    engine = llm.engine
    engine.enable_uniform_decode(cuda_graphs=False)
    engine.runner.decode_runner.pad_like_graph = engine.proposer.uniform.pad_like_graph = True
    taken = []
    use = engine._use_chained_drafts

    def checking_use(seq, n, unmasked=True):
        ok = use(seq, n, unmasked)
        if ok:
            fresh = engine.proposer.propose([(seq.token_ids[-1], seq.num_computed_tokens, n, seq.block_table)])[0]
            taken.append(fresh == seq.spec_token_ids)
        return ok
    engine._use_chained_drafts = checking_use
    assert [o.outputs[0].token_ids for o in llm.generate(PROMPTS, params)] == ref
    assert len(taken) >= 6 and all(taken)


def test_fused_projections_equal_unfused():
    """GatedMLP.fuse_gate_up (gate + up in one GEMM), MLAAttention.fuse_qkv_a (q_a + kv_a in one GEMM)
    and the drafter's fuse_projections (k + v, gate + up), which the GPU engine applies: the target's
    logits and the drafter's padded block forward are unchanged (fp32 rounding), and the parameters are
    views of the fused weights (no second copy)."""
    from longflash.attention.mla import MLAAttention
    from longflash.layers.mlp import GatedMLP
    engine = LLM(**KW).engine
    sched, reqs, _ = _decoding_step(engine)
    before = engine.runner.execute(sched, proposer=engine.proposer)
    b_logits, b_aux = before.logits.clone(), before.aux.clone()
    drafter = engine.proposer.drafter
    tables = [s.seq.block_table for s in sched.scheduled[:2]]
    n = min(len(t) for t in tables)
    dev = next(drafter.parameters()).device  # the CPU here, the GPU when CUDA is available
    table = torch.tensor([t[:n] for t in tables], dtype=torch.int32, device=dev)
    ctx = [n * KW["block_size"] - 3, n * KW["block_size"] - 5]  # context rows inside the allocated blocks
    ctx_lens = torch.tensor(ctx, dtype=torch.int32, device=dev)
    pos = torch.cat([torch.arange(c, c + 8) for c in ctx]).to(dev)
    h = torch.randn(16, drafter.cfg.hidden_size).to(device=dev, dtype=next(drafter.parameters()).dtype)
    with torch.inference_mode():
        d_before = drafter.forward_padded(h, pos, ctx_lens, table, max(ctx))
    mlps = [m for m in engine.model.modules() if isinstance(m, GatedMLP)]
    for m in mlps:
        m.fuse_gate_up()
    mla = [m for m in engine.model.modules() if isinstance(m, MLAAttention)]
    assert mla and all(m.q_lora_rank for m in mla)
    for m in mla:
        m.fuse_qkv_a()
    assert all(m.kv_a_proj_with_mqa.weight.data_ptr() == m.qkv_a_weight[m.q_lora_rank:].data_ptr() for m in mla)
    drafter.fuse_projections()
    assert all(m.gate_proj.weight.data_ptr() == m.gate_up_weight.data_ptr() for m in mlps)
    attn = drafter.layers[0].self_attn
    assert attn.v_proj.weight.data_ptr() == attn.kv_weight[attn.k_proj.weight.shape[0]:].data_ptr()
    after = engine.runner.execute(sched, proposer=engine.proposer)
    assert _close(after.logits, b_logits) <= 1e-6 and _close(after.aux, b_aux) <= 1e-6
    with torch.inference_mode():
        d_after = drafter.forward_padded(h, pos, ctx_lens, table, max(ctx))
    assert _close(d_after, d_before) <= 1e-6
