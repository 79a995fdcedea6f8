"""DFlash speculative decoding: lossless greedy and sampled output, taps, dense reference drafter,
and the regressions of ``shared/specs/dflash.md`` ("Engines' pitfalls")."""

import json
import os
import random

import numpy as np
import pytest
import torch
from scipy.stats import chi2_contingency

from longflash import LLM, SamplingParams
from longflash.default_model_path import default_model_path
from longflash.spec_decode.dflash_config import default_target_layer_ids
from longflash.spec_decode.dflash_dense import dense_forward
from longflash.spec_decode.taps import AuxTapper
from tiny_models import make_deepseek_v3, make_drafter

GREEDY64 = SamplingParams(temperature=0, max_tokens=64, ignore_eos=True)


def _ids(outs):
    return [o.outputs[0].token_ids for o in outs]


def _default_prompts(llm, n):
    """Held-out style prompts: Python code and prose of varied length."""
    code = ["def fibonacci(n):", "import os\nimport sys\n\n\ndef main(argv):", "class Stack:\n    def __init__(self):",
            "for i in range(10):\n    if i % 2 == 0:", "    def __repr__(self):\n        return",
            "try:\n    import json\nexcept ImportError:", "def read_file(path):\n    with open(path) as f:",
            "# Copyright\n\"\"\"Utilities for parsing.\"\"\"\n\nimport re\n", "if __name__ == '__main__':",
            "    @property\n    def name(self):"]
    prose = ["To be, or not to be, that is the question:", "KING. What say you, my lord?",
             "Of Man's first disobedience, and the fruit", "Enter HAMLET and HORATIO.", "My lord, I have",
             "O Romeo, Romeo, wherefore art thou", "Now is the winter of our discontent", "FIRST WITCH. When shall we",
             "The quality of mercy is not strain'd;", "All the world's a stage,"]
    return (code + prose)[:n]


@pytest.fixture(scope="module")
def default_models():
    # Batch 8 with chunked prefill: a 96-token step budget splits longer prompts and mixes them with
    # the verify steps (8 tokens per request) of others.
    kw = dict(max_num_seqs=8, max_num_batched_tokens=96, enable_prefix_caching=True, block_size=4)
    base = LLM(speculative_config="off", **kw)
    spec = LLM(**kw)  # ships its drafter: on by default
    assert base.engine.proposer is None and spec.engine.proposer is not None
    return base, spec


def test_default_greedy_speculative_equals_target_only_batch8(default_models):
    base, spec = default_models
    prompts = _default_prompts(base, 20)
    ref = _ids(base.generate(prompts, GREEDY64))
    outs = spec.generate(prompts, GREEDY64)
    assert _ids(outs) == ref
    assert np.mean([o.metrics.mean_acceptance_length for o in outs]) > 1.3
    # Second pass: full prompt blocks come from the prefix cache (draft KV must be there too).
    again = spec.generate(prompts, GREEDY64)
    assert _ids(again) == ref
    assert [o.metrics.mean_acceptance_length for o in again] == [o.metrics.mean_acceptance_length for o in outs]


def test_default_greedy_speculative_batch1_with_random_drafter(default_models, tmp_path):
    base, _ = default_models
    cfg = json.load(open(os.path.join(default_model_path(), "config.json")))
    d = make_drafter(str(tmp_path / "rand"), cfg, block_size=8, num_layers=1, mask_token_id=3,
                     target_layer_ids=[1, 13])
    rand = LLM(speculative_config={"method": "dflash", "model": d}, max_num_seqs=1, max_num_batched_tokens=16,
               block_size=4)
    prompts = _default_prompts(base, 8)  # one request at a time, ~64 verify steps each: 8 keep it to ~25 s
    ref = _ids(base.generate(prompts, GREEDY64))
    outs = rand.generate(prompts, GREEDY64)
    assert _ids(outs) == ref
    assert all(1.0 <= o.metrics.mean_acceptance_length < 1.5 for o in outs)


@pytest.fixture(scope="module")
def tiny_vocab(tmp_path_factory):
    root = tmp_path_factory.mktemp("tinyvocab")
    path = make_deepseek_v3(str(root / "t"), vocab_size=8, num_layers=2, seed=5)
    cfg = json.load(open(os.path.join(path, "config.json")))
    d = make_drafter(str(root / "d"), cfg, block_size=4, mask_token_id=7, seed=5, scale=0.3, target_layer_ids=[0, 1])
    return path, d


def test_temperature_one_distribution_matches_target_only(tiny_vocab):
    """4,000 seeded samples of the first 3 tokens: chi-square homogeneity p > 0.01."""
    path, d = tiny_vocab
    kw = dict(skip_tokenizer_init=True, dtype="float32", block_size=4, num_gpu_blocks=8192, max_num_seqs=512,
              max_num_batched_tokens=4096)
    n = 4000
    prompt = {"prompt_token_ids": [1, 2, 3, 4, 5]}
    params = [SamplingParams(temperature=1.0, seed=i, max_tokens=3, ignore_eos=True) for i in range(n)]
    base = LLM(path, speculative_config="off", **kw)
    spec = LLM(path, speculative_config={"method": "dflash", "model": d}, **kw)
    a = [tuple(o.outputs[0].token_ids) for o in base.generate([prompt] * n, params)]
    b_outs = spec.generate([prompt] * n, [SamplingParams(temperature=1.0, seed=10_000 + i, max_tokens=3,
                                                         ignore_eos=True) for i in range(n)])
    b = [tuple(o.outputs[0].token_ids) for o in b_outs]
    cells = sorted(set(a) | set(b))
    table = np.array([[a.count(c) for c in cells], [b.count(c) for c in cells]])
    # Merge rare cells so every expected count is >= 5.
    order = np.argsort(table.sum(0))
    merged, acc = [], np.zeros(2)
    for j in order:
        acc = acc + table[:, j]
        if acc.sum() >= 20:
            merged.append(acc)
            acc = np.zeros(2)
    if acc.sum():
        merged[-1] = merged[-1] + acc
    _, p, _, _ = chi2_contingency(np.array(merged).T)
    assert p > 0.01, f"speculative sampling changed the distribution (p = {p:.4f})"
    assert spec.engine.stats.spec_num_accepted_tokens > 0
    assert np.mean([o.metrics.mean_acceptance_length for o in b_outs]) > 1.0


@pytest.fixture(scope="module")
def tiny_ds(tmp_path_factory):
    root = tmp_path_factory.mktemp("tds")
    path = make_deepseek_v3(str(root / "t"), vocab_size=256, num_layers=3, seed=7)
    return path, json.load(open(os.path.join(path, "config.json")))


def test_taps_equal_hf_hidden_states(tiny_ds, tmp_path):
    from transformers import AutoModelForCausalLM
    from tiny_models import make_qwen3
    for path in (tiny_ds[0], make_qwen3(str(tmp_path / "q"))):
        hf = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
        llm = LLM(path, skip_tokenizer_init=True, dtype="float32", block_size=4, num_gpu_blocks=64)
        L = hf.config.num_hidden_layers
        ids = list(range(5, 30))
        tapper = AuxTapper(llm.engine.model, list(range(L)), "auto")
        assert tapper.mode == "layer_output"
        with torch.no_grad():
            hs = hf(torch.tensor([ids]), output_hidden_states=True).hidden_states
        eng = llm.engine
        from longflash.engine.scheduler import ScheduledSeq, SchedulerOutput
        from longflash.engine.sequence import Sequence
        seq = Sequence("t", ids, SamplingParams(max_tokens=1))
        eng.block_manager.allocate_for_new(seq, len(ids))
        res = eng.runner.execute(SchedulerOutput([ScheduledSeq(seq, len(ids))], []), tapper=tapper)
        eng.block_manager.free(seq)
        H = hf.config.hidden_size
        for i in range(L - 1):
            torch.testing.assert_close(res.aux[:, i * H:(i + 1) * H], hs[i + 1][0], rtol=1e-4, atol=1e-4)
        # The last tap is before the final norm (HF's last hidden_states entry is after it).
        last = res.aux[:, (L - 1) * H:]
        normed = hf.model.norm(last)
        torch.testing.assert_close(normed, hs[L][0], rtol=1e-4, atol=1e-4)
        assert not torch.allclose(last, hs[L][0], atol=1e-3)
        tapper.remove()


def test_k3_tap_is_the_attn_res_mixture(default_models):
    """The AttnRes tap of layer i equals the mixture over bank ++ [prefix] with layer i+1's
    self_attention_res weights, computed independently from the spec reference's internals."""
    from longflash.training.model import KimiK3TrainModel, attn_res_mix
    ref = KimiK3TrainModel.from_pretrained(default_model_path())
    ids = torch.tensor([list(range(40, 70))])
    captured = {}
    layers = ref.model.layers
    # Record the mixture inputs by recomputing them from the reference's own bank/prefix loop.
    taps = AuxTapper(ref, [2, 13], "attn_res_mixture")
    with torch.no_grad(), taps.capture() as t:
        ref.hidden_states(ids)
    bs = ref.bs
    with torch.no_grad():
        h = ref.model.embed_tokens(ids)
        bank, prefix = [], h
        for l, layer in enumerate(layers):
            n, wr = -(-l // bs), l % bs == 0
            x = attn_res_mix(bank[:n] + [prefix], layer.self_attention_res_norm.weight,
                             layer.self_attention_res_proj.weight, ref.eps)
            if l == 3:
                captured[2] = x
            if wr:
                bank.append(prefix)
            a = layer.self_attn(layer.input_layernorm(x), *__import__("longflash.training.model", fromlist=["x"]).rope_cos_sin(
                torch.arange(ids.shape[1]), ref.config["qk_rope_head_dim"], ref.config["rope_theta"]))
            prefix = a if wr else prefix + a
            x = attn_res_mix(bank[:n + int(wr)] + [prefix], layer.mlp_res_norm.weight, layer.mlp_res_proj.weight, ref.eps)
            prefix = prefix + layer.ffn(layer.post_attention_layernorm(x))
        captured[13] = attn_res_mix(bank + [prefix], ref.model.output_attn_res_norm.weight,
                                    ref.model.output_attn_res_proj.weight, ref.eps)
    torch.testing.assert_close(t[2], captured[2], rtol=0, atol=0)
    torch.testing.assert_close(t[13], captured[13], rtol=0, atol=0)
    assert not torch.allclose(t[2], prefix)  # the mixture is not the raw prefix


def test_dense_reference_drafter_equals_engine(default_models):
    _, spec = default_models
    eng, prop = spec.engine, spec.engine.proposer
    ids = list(range(100, 160))
    from longflash.engine.scheduler import ScheduledSeq, SchedulerOutput
    from longflash.engine.sequence import Sequence
    seq = Sequence("dense", ids, SamplingParams(max_tokens=8))
    eng.block_manager.enable_prefix_caching = False
    try:
        assert eng.block_manager.allocate_for_new(seq, len(ids))
        res = eng.runner.execute(SchedulerOutput([ScheduledSeq(seq, len(ids))], []), tapper=prop.tapper)
        with torch.inference_mode():
            prop.write_context(prop.drafter.fc(res.aux), res.ctx.positions, res.ctx.slot_mapping)
        seq.num_computed_tokens = len(ids)
        eng.block_manager.append_slots(seq, 8)
        pending = 42
        B = prop.block_size
        # Paged engine path: hidden of the block rows.
        toks = torch.tensor([pending] + [prop.mask_token_id] * (B - 1))
        with torch.inference_mode():
            emb = prop.drafter.embed_block(eng.model.model.embed_tokens, toks)
        table = torch.tensor([seq.block_table], dtype=torch.int32)
        with torch.inference_mode():
            paged = prop.drafter(emb, torch.arange(len(ids), len(ids) + B), [0, B], [len(ids)], table)
            dense = dense_forward(prop.drafter, res.aux[None], emb[None, None], torch.tensor([[len(ids)]]))[0, 0]
            lp, ld = eng.model.compute_logits(paged), eng.model.compute_logits(dense)
        assert ((lp - ld).abs().max() / ld.abs().max()).item() <= 1e-4
    finally:
        eng.block_manager.free(seq)
        eng.block_manager.enable_prefix_caching = True


def test_mask_token_in_output_is_kept(tiny_ds, tmp_path):
    """A generated token equal to mask_token_id is ordinary output (never filtered)."""
    path, cfg = tiny_ds
    base = LLM(path, skip_tokenizer_init=True, dtype="float32", block_size=4, num_gpu_blocks=256)
    ref = _ids(base.generate([{"prompt_token_ids": list(range(9, 40))}], GREEDY64))[0]
    mask = ref[3]  # make the drafter's mask id a token the target really generates
    d = make_drafter(str(tmp_path / "m"), cfg, mask_token_id=mask)
    spec = LLM(path, skip_tokenizer_init=True, dtype="float32", block_size=4, num_gpu_blocks=256,
               speculative_config={"method": "dflash", "model": d})
    out = _ids(spec.generate([{"prompt_token_ids": list(range(9, 40))}], GREEDY64))[0]
    assert out == ref and mask in out


def test_fresh_draft_state_per_request_and_rollback(tiny_ds, tmp_path):
    """Different requests one after another (and interleaved) get their own draft context; every
    rejection count 0..B−1 rolls back to exactly the committed length."""
    path, cfg = tiny_ds
    kw = dict(skip_tokenizer_init=True, dtype="float32", block_size=4, num_gpu_blocks=256)
    base = LLM(path, **kw)
    d = make_drafter(str(tmp_path / "r"), cfg, block_size=6)
    spec = LLM(path, speculative_config={"method": "dflash", "model": d}, **kw)
    prompts = [{"prompt_token_ids": [random.Random(i).randrange(4, 256) for _ in range(20 + i)]} for i in range(4)]
    refs = _ids(base.generate(prompts, GREEDY64))
    for p, r in zip(prompts, refs):  # one after another: no state leaks between requests
        assert _ids(spec.generate([p], GREEDY64))[0] == r

    # Rollback: an oracle proposer that knows the reference continuation and corrupts draft j.
    eng = spec.engine
    real = eng.proposer.propose
    B = eng.proposer.block_size
    seen = set()
    calls = iter(range(10_000))

    def oracle(reqs, masks=None):
        out = []
        for pending, s, n, _ in reqs:
            j = next(calls) % B  # cycle the rejection point through 0..B−1
            full = prompts[0]["prompt_token_ids"] + refs[0]
            drafts = full[s + 1:s + 1 + n]
            drafts += [0] * (n - len(drafts))
            if j < n:
                drafts[j] = (drafts[j] + 1) % 256  # first j drafts right, then a wrong one
            seen.add(min(j, n))
            out.append(drafts)
        return out

    eng.proposer.propose = oracle
    try:
        assert _ids(spec.generate([prompts[0]], GREEDY64))[0] == refs[0]
    finally:
        eng.proposer.propose = real
    assert seen >= set(range(B))  # 0..B−1 accepted drafts before the rejection (B−1 = all accepted)


def test_default_target_layer_ids_formula():
    assert default_target_layer_ids(36, 5) == [1, 9, 17, 25, 33]
    assert default_target_layer_ids(36, 1) == [18]


def test_staged_mxfp8_drafter_input_on_off_identical(default_models):
    """Staged MXFP8 (each tap quantized as the target produces it) vs list-and-concatenate then
    quantize: identical drafts, so identical tokens and acceptance lengths (DESIGN invariant 4)."""
    base, _ = default_models
    prompts = _default_prompts(base, 6)
    params = SamplingParams(temperature=0, max_tokens=32, ignore_eos=True)
    kw = dict(max_num_seqs=8, max_num_batched_tokens=96, block_size=4, dflash_mxfp8_input=True)
    staged = LLM(dflash_staged_threshold=1, **kw)       # every forward staged
    concat = LLM(dflash_staged_threshold=10 ** 9, **kw)  # never staged
    a, b = staged.generate(prompts, params), concat.generate(prompts, params)
    assert _ids(a) == _ids(b) == _ids(base.generate(prompts, params))
    assert [o.metrics.mean_acceptance_length for o in a] == [o.metrics.mean_acceptance_length for o in b]
    assert np.mean([o.metrics.mean_acceptance_length for o in a]) > 1.2
