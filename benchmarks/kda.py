"""KDA (Kimi Delta Attention) on the GPU (issue 12): kernel times against their bytes/FLOPs ceilings at
Kimi-Linear-48B shapes (32 heads x 128), state bytes per request, and engine decode tok/s of a random
Kimi-Linear-shaped model against the bandwidth roofline.

    python benchmarks/kda.py --out DIR            # GPU (H200: about 100 s)
    python benchmarks/kda.py --out DIR --smoke    # CPU, TRITON_INTERPRET=1, tiny shapes (checks the script)

Writes DIR/kda.json and DIR/kda.md (the JSON is rewritten after every section, so a timeout keeps what ran).

Ceilings, measured in the same run: copy bandwidth (``dst.copy_(src)`` of 1 GiB, read + write) and the bf16
GEMM rate (8192^3 ``torch.mm``). Kernel times are medians of CUDA-event timings with the L2 flushed before
each repetition.

- Chunked prefill (``kda_chunked_triton``) of 1 x 8192 and 8 x 2048 tokens (one varlen call), K3-style gate
  (-5 sigmoid) and a Kimi-Linear gate (-exp(A_log) softplus): bytes = q, k, v, g, o (fp32, as the layer calls
  it) + beta + initial and final states; FLOPs = the chunked algorithm at chunk C = 64 per token and head:
  6 dk dv (w S, q S, k^T v') + C (3 dk + 2 dv) (L, A_qk, w, u, A_qk v' at half for triangles) + C^2 / 3
  (the inverse). Ceiling time = max(bytes / copy, FLOPs / bf16 GEMM) (the kernel's tf32x3 dots run below the
  bf16 rate, so the FLOPs side is an upper bound). A few launch configs are timed (``--configs``); each is
  checked against the PyTorch reference on the GPU (fp32, no TF32).
- Recurrent decode (``kda_recurrent_triton``), one token for batch 1, 32, 256 as the layer calls it (B*H heads):
  bytes = state read + written (fp32) + q, k, g, v, o + beta; and the layer's path with the gather/scatter of
  the states from a slot pool.
- State bytes per request: ``state_bytes_per_request`` of Kimi-Linear-48B-A3B (20 KDA layers of 27, 32 x 128)
  and Kimi-K3 (69 of 93, 96 x 128), bf16 conv state.
- Engine decode: ``LLMEngine`` on a random model with Kimi-Linear-48B-A3B layer shapes and 4 layers (KDA, KDA,
  KDA, MLA = the 3:1 pattern; layer 0 dense MLP 9216, layers 1-3 MoE 256 experts top-8 of 1024 + 1 shared;
  hidden 2304, vocab 163840, bf16), greedy, 32-token prompts, batch 1 and 32. Roofline bytes per decode step:
  every weight except the embedding table (B rows of it) and the routed experts (the distinct experts the step's
  tokens chose, counted with router hooks on extra steps), plus each request's KDA state read + written
  (recurrent fp32 and conv) and its MLA KV rows; roofline tok/s = B / (bytes / copy bandwidth).
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def parse_args(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0], allow_abbrev=False)
    ap.add_argument("--out", required=True, help="directory for kda.json / kda.md")
    ap.add_argument("--smoke", action="store_true", help="tiny shapes on the CPU through TRITON_INTERPRET=1")
    ap.add_argument("--reps", type=int, default=10)
    ap.add_argument("--configs", default="64x8,32x4,32x8,128x8,16x4",
                    help="chunked-kernel launch configs to time, block_v x num_warps (the first is the default)")
    ap.add_argument("--budget-s", type=float, default=135.0, help="skip optional parts past this many seconds")
    return ap.parse_args(argv)


ARGS = parse_args()
if ARGS.smoke:
    os.environ["TRITON_INTERPRET"] = "1"  # before triton is first imported

import torch  # noqa: E402

sys.path.insert(0, REPO)
from longflash.layers.kda import KimiDeltaAttention, kda_chunked, kda_gate, kda_recurrent, l2norm  # noqa: E402
from longflash.layers.kda_chunked_triton import DEFAULT_CONFIG, kda_chunked_triton  # noqa: E402
from longflash.layers.kda_triton import kda_recurrent_triton  # noqa: E402
from longflash.runner.state_pool import state_bytes_per_request  # noqa: E402

T0 = time.perf_counter()
SMOKE = ARGS.smoke
DEV = torch.device("cpu" if SMOKE else "cuda")
H, D = (2, 16) if SMOKE else (32, 128)
PREFILL = [(1, 40), (2, 24)] if SMOKE else [(1, 8192), (8, 2048)]
DECODE_BATCH = [1, 4] if SMOKE else [1, 32, 256]
ENGINE_BATCH = [1, 4] if SMOKE else [1, 32]


def elapsed() -> float:
    return time.perf_counter() - T0


class Timer:
    """Median seconds of fn(): CUDA events with the L2 flushed before each repetition (host clock on the CPU)."""

    def __init__(self, reps: int):
        self.reps = reps
        self.flush = torch.empty(256 * 2**20, dtype=torch.uint8, device=DEV) if DEV.type == "cuda" else None

    def __call__(self, fn) -> float:
        fn()
        if self.flush is None:
            t = time.perf_counter()
            fn()
            return time.perf_counter() - t
        torch.cuda.synchronize()
        times = []
        for _ in range(self.reps):
            self.flush.zero_()
            a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            a.record()
            fn()
            b.record()
            torch.cuda.synchronize()
            times.append(a.elapsed_time(b) / 1e3)
        return statistics.median(times)


def ceilings(timer: Timer) -> dict:
    n = (1 << 30) if DEV.type == "cuda" else (1 << 24)
    src = torch.empty(n // 2, dtype=torch.uint8, device=DEV).random_(0, 255)
    dst = torch.empty_like(src)
    copy = 2 * src.numel() / timer(lambda: dst.copy_(src))
    m = 8192 if DEV.type == "cuda" else 256
    a = torch.randn(m, m, device=DEV).to(torch.bfloat16)
    b = torch.randn(m, m, device=DEV).to(torch.bfloat16)
    gemm = 2 * m**3 / timer(lambda: torch.mm(a, b))
    return {"copy_GBps": round(copy / 1e9, 1), "bf16_gemm_TFLOPs": round(gemm / 1e12, 1)}


def inputs(T: int, n_states: int, gate: str, seed: int = 0):
    """Random q, k (L2-normalised), v, g, beta [T, H], initial states [n_states, H, D, D] on the device."""
    g = torch.Generator(device=DEV).manual_seed(seed)
    kw = dict(generator=g, device=DEV)
    q = l2norm(torch.randn(T, H, D, **kw))
    k = l2norm(torch.randn(T, H, D, **kw))
    v = torch.randn(T, H, D, **kw)
    f = torch.randn(T, H * D, **kw)
    if gate == "k3":  # Kimi-K3: -5 sigmoid(exp(A_log) (f + dt_bias))
        gg = kda_gate(f, torch.randn(H, **kw) * 0.5, torch.randn(H * D, **kw), D, -5.0)
    else:  # Kimi-Linear: -exp(A_log) softplus(f + dt_bias), A in [1, 16] (FLA's init), dt_bias -4 (decay ~0.02-0.3)
        gg = kda_gate(f * 0.5, torch.log(torch.rand(H, **kw) * 15 + 1), torch.full((H * D,), -4.0, device=DEV), D, None)
    beta = torch.rand(T, H, **kw)
    S0 = torch.randn(n_states, H, D, D, **kw) * 0.1
    return q, k, v, gg, beta, S0


def chunked_flops(T: int, C: int = 64) -> float:
    return T * H * (6 * D * D + C * (3 * D + 2 * D) + C * C / 3)


def bench_chunked(timer: Timer, ceil: dict, configs: list[dict], out: dict) -> None:
    rows = []
    for N, L in PREFILL:
        T = N * L
        cu = [i * L for i in range(N + 1)]
        nbytes = 4 * (5 * T * H * D + T * H + 2 * N * H * D * D)
        flops = chunked_flops(T)
        for gate in ("k3", "linear"):
            q, k, v, gg, beta, S0 = inputs(T, N, gate, seed=T)
            if DEV.type == "cuda":
                torch.backends.cuda.matmul.allow_tf32 = False
            t_ref0 = time.perf_counter()
            o_ref, s_ref = kda_chunked(q, k, v, gg, beta, S0, D ** -0.5, cu_seqlens=cu)
            if DEV.type == "cuda":
                torch.cuda.synchronize()
            t_ref = time.perf_counter() - t_ref0
            blocks = gg.view(-1, 16, H, D) if T % 16 == 0 else None
            factored = (blocks.cumsum(1).abs().amax(dim=(1, 3)) <= 84.0).float().mean().item() if blocks is not None else None
            for ci, cfg in enumerate(configs if gate == "k3" else configs[:1]):
                if ci and elapsed() > ARGS.budget_s * 0.6:
                    rows.append({"tokens": f"{N}x{L}", "gate": gate, "config": cfg, "skipped": "time budget"})
                    continue
                try:
                    o, s = kda_chunked_triton(q, k, v, gg, beta, S0, D ** -0.5, cu_seqlens=cu, config=cfg)
                    err = max(((o - o_ref).abs().max() / o_ref.abs().max()).item(),
                              ((s - s_ref).abs().max() / s_ref.abs().max()).item())
                    t = timer(lambda: kda_chunked_triton(q, k, v, gg, beta, S0, D ** -0.5, cu_seqlens=cu, config=cfg))
                except Exception as e:  # noqa: BLE001 - a config that fails to compile is reported, not fatal
                    rows.append({"tokens": f"{N}x{L}", "gate": gate, "config": cfg, "error": repr(e)[:300]})
                    continue
                t_ceil = max(nbytes / (ceil["copy_GBps"] * 1e9), flops / (ceil["bf16_gemm_TFLOPs"] * 1e12))
                rows.append({"tokens": f"{N}x{L}", "gate": gate, "config": cfg, "us": round(t * 1e6, 1),
                             "tok_per_s": round(T / t), "bytes": nbytes, "GBps": round(nbytes / t / 1e9, 1),
                             "bytes_ratio": round(nbytes / t / 1e9 / ceil["copy_GBps"], 3),
                             "GFLOP": round(flops / 1e9, 2), "TFLOPs": round(flops / t / 1e12, 2),
                             "flops_ratio": round(flops / t / 1e12 / ceil["bf16_gemm_TFLOPs"], 4),
                             "ceiling_us": round(t_ceil * 1e6, 1), "roofline_ratio": round(t_ceil / t, 3),
                             "max_rel_err_vs_ref": float(f"{err:.3g}"), "ref_ms": round(t_ref * 1e3, 1),
                             "blocks_factored": None if factored is None else round(factored, 4)})
                print(rows[-1], flush=True)
            del q, k, v, gg, beta, S0, o_ref, s_ref
    out["chunked_prefill"] = rows


def bench_recurrent(timer: Timer, ceil: dict, out: dict) -> None:
    rows = []
    for B in DECODE_BATCH:
        q, k, v, gg, beta, S0 = inputs(B, B, "k3", seed=B)
        q, k, v, gg = (t.view(1, B * H, D) for t in (q, k, v, gg))
        beta, S0 = beta.view(1, B * H), S0.view(B * H, D, D)
        o_ref, s_ref = kda_recurrent(q, k, v, gg, beta, S0, D ** -0.5)
        o, s = kda_recurrent_triton(q, k, v, gg, beta, S0, D ** -0.5)
        err = max(((o - o_ref).abs().max() / o_ref.abs().max()).item(), ((s - s_ref).abs().max() / s_ref.abs().max()).item())
        t = timer(lambda: kda_recurrent_triton(q, k, v, gg, beta, S0, D ** -0.5))
        # the layer's path: states gathered from a slot pool by index, stepped, scattered back
        pool = torch.zeros(B + 1, H, D, D, device=DEV)
        slots = torch.arange(1, B + 1, device=DEV)

        def layer_path():
            _, s1 = kda_recurrent_triton(q, k, v, gg, beta, pool[slots].view(B * H, D, D), D ** -0.5)
            pool[slots] = s1.view(B, H, D, D)
        t_layer = timer(layer_path)
        nbytes = 4 * (2 * B * H * D * D + 5 * B * H * D + B * H)
        rows.append({"batch": B, "heads": B * H, "us": round(t * 1e6, 2), "bytes": nbytes,
                     "GBps": round(nbytes / t / 1e9, 1), "bytes_ratio": round(nbytes / t / 1e9 / ceil["copy_GBps"], 3),
                     "layer_path_us": round(t_layer * 1e6, 2),
                     "layer_path_bytes_ratio": round(nbytes / t_layer / 1e9 / ceil["copy_GBps"], 3),
                     "max_rel_err_vs_ref": float(f"{err:.3g}")})
        print(rows[-1], flush=True)
    out["recurrent_decode"] = rows


def state_bytes(out: dict) -> None:
    rows = []
    for name, layers, heads in (("Kimi-Linear-48B-A3B", 20, 32), ("Kimi-K3", 69, 96)):
        with torch.device("meta"):
            layer = KimiDeltaAttention(2304, heads, 128)
        per_layer = state_bytes_per_request([layer], torch.bfloat16)
        rows.append({"model": name, "kda_layers": layers, "heads_x_dim": f"{heads}x128", "bytes_per_layer": per_layer,
                     "bytes_per_request": per_layer * layers,
                     "MiB_per_request": round(per_layer * layers / 2**20, 1)})
    out["state_bytes_per_request"] = rows


def kimi_linear_config() -> dict:
    """Kimi-Linear-48B-A3B layer shapes (HF ``KimiLinearConfig`` defaults), 4 layers: KDA, KDA, KDA, MLA."""
    if SMOKE:
        big = dict(vocab_size=256, hidden_size=64, intermediate_size=96, moe_intermediate_size=32, num_attention_heads=4,
                   num_key_value_heads=4, kv_lora_rank=32, qk_nope_head_dim=16, qk_rope_head_dim=8, v_head_dim=16,
                   num_experts=8, num_experts_per_token=2, lac=dict(num_heads=H, head_dim=D))
    else:
        big = dict(vocab_size=163840, hidden_size=2304, intermediate_size=9216, moe_intermediate_size=1024,
                   num_attention_heads=32, num_key_value_heads=32, kv_lora_rank=512, qk_nope_head_dim=128,
                   qk_rope_head_dim=64, v_head_dim=128, num_experts=256, num_experts_per_token=8,
                   lac=dict(num_heads=32, head_dim=128))
    lac = big.pop("lac")
    return dict(architectures=["KimiLinearForCausalLM"], model_type="kimi_linear", num_hidden_layers=4, q_lora_rank=None,
                mla_use_nope=True, num_shared_experts=1, first_k_dense_replace=1, moe_layer_freq=1,
                moe_renormalize=True, routed_scaling_factor=2.446, num_expert_group=1, topk_group=1,
                use_grouped_topk=True, moe_router_activation_func="sigmoid", hidden_act="silu", rms_norm_eps=1e-5,
                max_position_embeddings=1048576, tie_word_embeddings=False, bos_token_id=1, eos_token_id=2,
                pad_token_id=0, torch_dtype="bfloat16",
                linear_attn_config=dict(kda_layers=[1, 2, 3], full_attn_layers=[4], short_conv_kernel_size=4, **lac),
                **big)


def random_model(model_dir: str, dtype: torch.dtype, device: torch.device, progress: bool = True, **build_kw):
    """Stands in for ``load_model``: the registered model with random weights (no checkpoint on disk);
    extra keywords (e.g. a TP group) go to ``build_model``."""
    from longflash.models.loader import build_model, load_config
    model = build_model(load_config(model_dir), dtype, device, **build_kw)
    gen = torch.Generator(device=device).manual_seed(0)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("norm.weight"):
                p.fill_(1.0)
            elif name.endswith(("dt_bias", "e_score_correction_bias")):
                p.zero_()
            else:
                p.normal_(0.0, 0.02, generator=gen)
        for m in model.modules():
            if isinstance(m, KimiDeltaAttention):
                m.load_checkpoint_tensor("A_log", torch.log(torch.rand(m.num_heads, generator=torch.Generator().manual_seed(1)) * 15 + 1))
    return model.eval(), model.config


def bench_engine(ceil: dict, out: dict) -> None:
    import longflash.engine.llm_engine as le
    from longflash.config import EngineConfig
    from longflash.sampling_params import SamplingParams
    tmp = tempfile.mkdtemp(prefix="kda_bench_")
    cfg = kimi_linear_config()
    with open(os.path.join(tmp, "config.json"), "w") as f:
        json.dump(cfg, f)
    le.load_model = random_model  # NOTE: random weights instead of a checkpoint; the engine is unchanged
    t_load = time.perf_counter()
    engine = le.LLMEngine(EngineConfig(model=tmp, dtype="bfloat16", device=DEV.type, max_num_seqs=max(ENGINE_BATCH),
                                       kv_cache_memory="16MiB" if SMOKE else "1GiB", max_model_len=4096, skip_tokenizer_init=True,
                                       speculative_config="off"))
    t_load = time.perf_counter() - t_load
    model = engine.model
    routed, dense, embed_row = 0, 0, 0
    for name, p in model.named_parameters():
        nb = p.numel() * p.element_size()
        if ".experts." in name:
            routed += nb
        elif name.endswith("embed_tokens.weight"):
            embed_row = p.shape[1] * p.element_size()
        else:
            dense += nb
    E = cfg["num_experts"]
    n_moe = sum(1 for m in model.modules() if hasattr(m, "gate") and hasattr(m, "experts"))
    expert_bytes = routed // (E * n_moe)
    counts, counting = [], [False]

    def hook(_m, _inp, res):
        if counting[0]:
            counts.append(int(res[1].unique().numel()))
    handles = [m.register_forward_hook(hook) for m in model.modules() if type(m).__name__ == "TopkRouter"]
    state_req = engine.runner.state_pool.bytes_per_request
    kv_row = model.kv_cache_spec().bytes_per_token(engine.kv_cache_dtype)
    prompt_len, warm, timed, counted = 32, 2, 8 if SMOKE else 16, 3
    rows = []
    for B in ENGINE_BATCH:
        params = SamplingParams(temperature=0, max_tokens=1 + warm + timed + counted, ignore_eos=True)
        g = torch.Generator().manual_seed(B)
        for _ in range(B):
            engine.add_request(None, {"prompt_token_ids": torch.randint(4, cfg["vocab_size"], (prompt_len,), generator=g).tolist()}, params)
        times, step = [], 0
        counts.clear()
        while engine.has_unfinished_requests():
            counting[0] = step >= 1 + warm + timed
            if DEV.type == "cuda":
                torch.cuda.synchronize()
            ts = time.perf_counter()
            engine.step()
            if DEV.type == "cuda":
                torch.cuda.synchronize()
            if 1 + warm <= step < 1 + warm + timed:
                times.append(time.perf_counter() - ts)
            step += 1
        counting[0] = False
        t_step = statistics.median(times)
        distinct = statistics.mean(counts) if counts else float("nan")  # per MoE layer and step
        ctx = prompt_len + 1 + warm + timed // 2  # mean context of the timed steps
        nbytes = dense + B * embed_row + int(distinct * n_moe * expert_bytes) + B * (2 * state_req + ctx * kv_row)
        roof = B / (nbytes / (ceil["copy_GBps"] * 1e9))
        rows.append({"batch": B, "decode_step_ms": round(t_step * 1e3, 2), "tok_per_s": round(B / t_step, 1),
                     "distinct_experts_per_moe_layer": round(distinct, 1), "bytes_per_step": nbytes,
                     "roofline_tok_per_s": round(roof, 1), "ratio": round(B / t_step / roof, 4)})
        print(rows[-1], flush=True)
    for h in handles:
        h.remove()
    out["engine_decode"] = {"model": "random Kimi-Linear-48B-A3B layer shapes, 4 layers (KDA, KDA, KDA, MLA; layer 0 "
                                     "dense MLP, 1-3 MoE 256 x top-8 + 1 shared), bf16, greedy, 32-token prompts"
                            if not SMOKE else "tiny Kimi-Linear (smoke)",
                            "config": {k: cfg[k] for k in ("hidden_size", "num_hidden_layers", "vocab_size",
                                                           "num_experts", "num_experts_per_token",
                                                           "moe_intermediate_size", "intermediate_size",
                                                           "linear_attn_config")},
                            "load_s": round(t_load, 1), "dense_weight_bytes": dense, "routed_expert_bytes": expert_bytes,
                            "kda_state_bytes_per_request": state_req, "kv_bytes_per_token": kv_row, "rows": rows}


def write(out: dict) -> None:
    os.makedirs(ARGS.out, exist_ok=True)
    out["elapsed_s"] = round(elapsed(), 1)
    with open(os.path.join(ARGS.out, "kda.json"), "w") as f:
        json.dump(out, f, indent=1)
    c = out.get("ceilings", {})
    md = [f"# KDA kernels and decode ({out['device']})", "",
          f"`python benchmarks/kda.py --out DIR`{' --smoke' if SMOKE else ''}, torch {torch.__version__}; "
          f"copy {c.get('copy_GBps')} GB/s, bf16 GEMM {c.get('bf16_gemm_TFLOPs')} TFLOP/s (measured here)", ""]
    if "chunked_prefill" in out:
        md += ["## Chunked prefill (`kda_chunked_triton`, 32 heads x 128, fp32 in/out)", "",
               "| tokens | gate | block_v x warps | µs | tok/s | GB/s | / copy | TFLOP/s | / bf16 GEMM | ceiling µs | "
               "roofline ratio | rel err vs ref | ref ms | blocks factored |", "|" + "---|" * 14]
        for r in out["chunked_prefill"]:
            cfg = f"{r['config']['block_v']}x{r['config']['num_warps']}"
            if "us" not in r:
                md.append(f"| {r['tokens']} | {r['gate']} | {cfg} | {r.get('error') or r.get('skipped')} |" + " |" * 10)
                continue
            md.append(f"| {r['tokens']} | {r['gate']} | {cfg} | {r['us']} | {r['tok_per_s']:,} | {r['GBps']} | "
                      f"{r['bytes_ratio']} | {r['TFLOPs']} | {r['flops_ratio']} | {r['ceiling_us']} | "
                      f"{r['roofline_ratio']} | {r['max_rel_err_vs_ref']} | {r['ref_ms']} | {r['blocks_factored']} |")
        md.append("")
    if "recurrent_decode" in out:
        md += ["## Recurrent decode (`kda_recurrent_triton`, one token, B x 32 heads)", "",
               "| batch | µs | bytes | GB/s | / copy | layer path (gather + kernel + scatter) µs | / copy | rel err |",
               "|---|---|---|---|---|---|---|---|"]
        for r in out["recurrent_decode"]:
            md.append(f"| {r['batch']} | {r['us']} | {r['bytes']:,} | {r['GBps']} | {r['bytes_ratio']} | "
                      f"{r['layer_path_us']} | {r['layer_path_bytes_ratio']} | {r['max_rel_err_vs_ref']} |")
        md.append("")
    if "state_bytes_per_request" in out:
        md += ["## State bytes per request (fp32 recurrent + bf16 conv)", "", "| model | KDA layers | heads | per layer | "
               "per request |", "|---|---|---|---|---|"]
        for r in out["state_bytes_per_request"]:
            md.append(f"| {r['model']} | {r['kda_layers']} | {r['heads_x_dim']} | {r['bytes_per_layer']:,} | "
                      f"{r['bytes_per_request']:,} ({r['MiB_per_request']} MiB) |")
        md.append("")
    if "engine_decode" in out:
        e = out["engine_decode"]
        md += ["## Engine decode", "", f"{e['model']}; dense weights {e['dense_weight_bytes']:,} B, one routed expert "
               f"{e['routed_expert_bytes']:,} B, KDA state {e['kda_state_bytes_per_request']:,} B/request, "
               f"KV {e['kv_bytes_per_token']} B/token", "",
               "| batch | step ms | tok/s | distinct experts / MoE layer | bytes / step | roofline tok/s | ratio |",
               "|---|---|---|---|---|---|---|"]
        for r in e["rows"]:
            md.append(f"| {r['batch']} | {r['decode_step_ms']} | {r['tok_per_s']} | {r['distinct_experts_per_moe_layer']} "
                      f"| {r['bytes_per_step']:,} | {r['roofline_tok_per_s']} | {r['ratio']} |")
        md.append("")
    for k in ("errors",):
        if out.get(k):
            md += ["## Errors", ""] + [f"- {x}" for x in out[k]]
    with open(os.path.join(ARGS.out, "kda.md"), "w") as f:
        f.write("\n".join(md) + "\n")


def main() -> int:
    configs = [{"block_v": int(a), "num_warps": int(b)} for a, b in (c.split("x") for c in ARGS.configs.split(","))]
    configs = [dict(DEFAULT_CONFIG, **c) for c in configs]
    out = {"device": torch.cuda.get_device_name() if DEV.type == "cuda" else "cpu (smoke)", "errors": []}
    timer = Timer(ARGS.reps)
    out["ceilings"] = ceilings(timer)
    print(out["ceilings"], flush=True)
    write(out)
    for name, fn in (("state", lambda: state_bytes(out)), ("recurrent", lambda: bench_recurrent(timer, out["ceilings"], out)),
                     ("chunked", lambda: bench_chunked(timer, out["ceilings"], configs, out)),
                     ("engine", lambda: bench_engine(out["ceilings"], out))):
        try:
            fn()
        except Exception as e:  # noqa: BLE001 - one failing section must not lose the others
            out["errors"].append(f"{name}: {e!r}"[:500])
            print(f"{name} failed: {e!r}", flush=True)
        write(out)
    print(open(os.path.join(ARGS.out, "kda.md")).read())
    return 1 if out["errors"] else 0


if __name__ == "__main__":
    sys.exit(main())
