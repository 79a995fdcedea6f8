"""Train the DFlash drafter of the embedded default model (SpecForge recipe, ``shared/specs/dflash.md``).

1. Regenerate: the target's greedy continuations (``gen_len`` tokens) of random ``prompt_len``-token
   windows of the code and prose training streams (KV-cached, batches of ``--regen-batch`` rows, bf16 on
   the GPU), plus held-out continuations of the validation streams. Saved under ``OUT/regen/``;
   ``--regen-from DIR`` reuses a saved set instead.
2. Capture the target's aux taps (pre-norm AttnRes mixtures of ``target_layer_ids``), stored in bf16.
3. Train on sampled anchors a in [P, T−B] (P = prompt_len: the pending token is a generated one, as in
   the engine): block ``[x_a, MASK × (B−1)]``, context strictly before a, slot k predicts x_{a+k}, loss
   weights exp(−(k−1)/γ) (γ = 4 for B = 8); AdamW lr 6e-4, cosine, 4% warmup. The target's embedding
   and LM head stay frozen. With ``--steps 0`` the step count fills ``--time-budget-s`` (total wall
   time of the run) from the measured time of steps 10..30.
4. Report on held-out regenerations (``dflash_eval.evaluate``): per-slot accuracy, the marginal
   estimate, the exact per-anchor acceptance, and the engine's greedy acceptance for ``--eval-max-new``
   new tokens (what ``longflash bench`` measures). Export ``drafter/`` (config.json +
   model.safetensors, bf16) and ``dflash_train_report.json``.

GPU: ``bash benchmarks/train_drafter_gpu.sh`` (one H200 call). CPU smoke: ``--smoke``.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import time

import numpy as np
import torch
import torch.nn.functional as F
from safetensors.torch import save_file

from longflash.spec_decode.dflash_config import DFlashConfig
from longflash.spec_decode.dflash_model import DFlashDraftModel
from longflash.spec_decode.taps import AuxTapper
from longflash.training.dflash_eval import draft_logits, evaluate, expected_acceptance
from longflash.training.dflash_regen import (capture_taps, file_sha256, load_regen, regenerate, sample_prompts,
                                             save_regen)
from longflash.training.model import KimiK3TrainModel


def drafter_config(target_cfg: dict, mask_token_id: int, block_size: int, num_layers: int,
                   target_layer_ids: list[int], intermediate_size: int | None = None) -> dict:
    """HF-style ``DFlashDraftModel`` config.json for a drafter of the default model (hidden = target's)."""
    H = target_cfg["hidden_size"]
    return {
        "architectures": ["DFlashDraftModel"], "model_type": "qwen3", "hidden_size": H,
        "num_hidden_layers": num_layers, "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 64,
        "intermediate_size": intermediate_size or 3 * H, "rms_norm_eps": 1e-6, "rope_theta": 10000.0,
        "max_position_embeddings": target_cfg.get("max_position_embeddings", 4096),
        "vocab_size": target_cfg["vocab_size"], "block_size": block_size,
        "num_target_layers": target_cfg["num_hidden_layers"], "tie_word_embeddings": False,
        "dflash_config": {"mask_token_id": mask_token_id, "target_layer_ids": target_layer_ids,
                          "block_size": block_size, "aux_hidden_state_mode": "attn_res_mixture"},
    }


def draft_loss(drafter, target, aux, seqs, anchors, B, gamma, mask_id):
    """Weighted CE over slots 1..B−1 (weights exp(−(k−1)/γ)) and per-slot accuracy [B−1]."""
    logits, labels = draft_logits(drafter, target, aux, seqs, anchors, B, mask_id)
    S, N = anchors.shape
    ce = F.cross_entropy(logits.reshape(-1, logits.shape[-1]), labels.reshape(-1), reduction="none").view(S, N, B - 1)
    w = torch.exp(-(torch.arange(1, B, device=seqs.device, dtype=torch.float32) - 1) / gamma)
    loss = (ce * w).sum(-1).mean() / w.sum()
    acc = (logits.argmax(-1) == labels).float().mean(dim=(0, 1))
    return loss, acc


def lr_at(step: int, total: int, peak: float, warmup: int) -> float:
    """Linear warmup, then cosine to 0 at ``total``."""
    if step < warmup:
        return peak * (step + 1) / warmup
    return peak * 0.5 * (1 + math.cos(math.pi * min(1.0, (step - warmup) / max(1, total - warmup))))


def _sync(device):
    if device.type == "cuda":
        torch.cuda.synchronize()


def build_data(args, target, tok_mask_id, device, log) -> tuple[dict[str, np.ndarray], dict]:
    """Regenerated token arrays {code_train, prose_train, code_val, prose_val} (uint16 [N, P+G]) and meta."""
    if args.regen_from:
        arrays, meta = load_regen(args.regen_from)
        log(f"regenerated data from {args.regen_from}: " + ", ".join(f"{k} {v.shape}" for k, v in arrays.items()))
        if meta.get("target_sha256") and meta["target_sha256"] != args._target_sha:
            log("WARNING: the saved regeneration was made by another target checkpoint")
        return arrays, meta
    rng = np.random.default_rng(args.seed)
    arrays = {}
    t0 = time.time()
    for kind in ("code", "prose"):  # each training split gets half of --regen-budget-s
        for split, n in (("train", args.num_seqs // 2), ("val", args.num_val_seqs // 2)):
            stream = np.load(os.path.join(args.data, f"{kind}_{split}.npy"))
            prompts = sample_prompts(stream, n, args.prompt_len, rng)
            budget = None if split == "val" else args.regen_budget_s / 2
            log(f"regenerating {kind}_{split}: {n} rows of {args.prompt_len}+{args.gen_len} tokens")
            arrays[f"{kind}_{split}"] = regenerate(target, prompts, args.gen_len, args.regen_batch, device,
                                                   budget_s=budget, log=log)
    meta = {"prompt_len": args.prompt_len, "gen_len": args.gen_len, "seed": args.seed,
            "target_sha256": args._target_sha, "target_dtype": str(next(target.parameters()).dtype),
            "device": str(device), "regen_s": round(time.time() - t0, 1)}
    save_regen(os.path.join(args.out, "regen"), arrays, meta)
    return arrays, meta


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0], allow_abbrev=False)
    ap.add_argument("--target", default="longflash/default_model")
    ap.add_argument("--data", default=".data")
    ap.add_argument("--out", required=True)
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--block-size", type=int, default=8)
    ap.add_argument("--layers", type=int, default=5)
    ap.add_argument("--intermediate-size", type=int, default=1024)
    ap.add_argument("--target-layer-ids", default="1,5,9,13")
    ap.add_argument("--num-seqs", type=int, default=120000, help="regenerated training rows (half code, half prose)")
    ap.add_argument("--num-val-seqs", type=int, default=512)
    ap.add_argument("--prompt-len", type=int, default=64)
    ap.add_argument("--gen-len", type=int, default=192)
    ap.add_argument("--regen-batch", type=int, default=15000)
    ap.add_argument("--regen-budget-s", type=float, default=150.0, help="no new training batch starts after this")
    ap.add_argument("--regen-from", default=None, help="reuse OUT/regen of an earlier run")
    ap.add_argument("--steps", type=int, default=0, help="0: fill --time-budget-s")
    ap.add_argument("--time-budget-s", type=float, default=500.0, help="total wall time of the run (with --steps 0)")
    ap.add_argument("--batch", type=int, default=128, help="sequences per step")
    ap.add_argument("--anchors", type=int, default=32, help="anchors per sequence per step")
    ap.add_argument("--lr", type=float, default=6e-4)
    ap.add_argument("--eval-max-new", type=int, default=128)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--smoke", action="store_true", help="tiny CPU run of every stage")
    args = ap.parse_args(argv)
    if args.smoke:
        args.num_seqs, args.num_val_seqs, args.prompt_len, args.gen_len = 8, 4, 16, 40
        args.regen_batch, args.batch, args.anchors, args.eval_max_new = 4, 4, 4, 24
        args.steps = args.steps or 3
    t0 = time.time()
    os.makedirs(args.out, exist_ok=True)
    log_f = open(os.path.join(args.out, "train_dflash.log"), "a")

    def log(msg: str) -> None:
        line = f"[{time.time() - t0:6.1f}s] {msg}"
        print(line, flush=True)
        log_f.write(line + "\n")
        log_f.flush()

    device = torch.device(args.device)
    torch.manual_seed(args.seed)
    # The checkpoint is bf16: on the GPU the target runs in bf16 (its own weights, exactly), on the CPU in fp32.
    tdtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    target = KimiK3TrainModel.from_pretrained(args.target, dtype=tdtype, device=device)
    for p in target.parameters():
        p.requires_grad_(False)
    args._target_sha = file_sha256(os.path.join(args.target, "model.safetensors"))
    tcfg = target.config
    from transformers import AutoTokenizer
    mask_id = AutoTokenizer.from_pretrained(args.target).convert_tokens_to_ids("<|mask|>")
    ids = [int(x) for x in args.target_layer_ids.split(",")]
    dcfg_dict = drafter_config(tcfg, mask_id, args.block_size, args.layers, ids, args.intermediate_size)
    dcfg = DFlashConfig.from_dict(dcfg_dict, tcfg["num_hidden_layers"])
    drafter = DFlashDraftModel(dcfg).to(device)
    with torch.no_grad():
        for p in drafter.parameters():
            p.fill_(1.0) if p.dim() == 1 else p.normal_(0, 0.02)
    tapper = AuxTapper(target, ids, "attn_res_mixture")
    report = {"args": {k: v for k, v in vars(args).items() if not k.startswith("_")},
              "target_layer_ids": ids, "block_size": args.block_size, "drafter_layers": args.layers,
              "drafter_intermediate_size": dcfg.intermediate_size,
              "drafter_params": sum(p.numel() for p in drafter.parameters()), "device": str(device)}
    if device.type == "cuda":
        report["gpu"] = torch.cuda.get_device_name(device)
    log(f"target loaded ({tdtype}); drafter {report['drafter_params']:,} params")

    arrays, meta = build_data(args, target, mask_id, device, log)
    P, G = meta["prompt_len"], meta["gen_len"]
    report["regen"] = {k: list(v.shape) for k, v in arrays.items()} | {"prompt_len": P, "gen_len": G}
    report["regen_s"] = round(time.time() - t0, 1)
    log(f"regeneration done: {report['regen']}")

    def to_dev(a):
        return torch.from_numpy(a.astype(np.int64)).to(device)

    train_seqs = torch.cat([to_dev(arrays["code_train"]), to_dev(arrays["prose_train"])])
    train_aux = capture_taps(target, tapper, train_seqs, 512)
    val = {k: (to_dev(arrays[f"{k}_val"]),) for k in ("code", "prose")}
    val = {k: (s, capture_taps(target, tapper, s, 256)) for k, (s,) in val.items()}
    _sync(device)
    report["taps_s"] = round(time.time() - t0, 1)
    log(f"taps captured: train {tuple(train_aux.shape)} {train_aux.dtype} "
        f"({train_aux.numel() * 2 / 2**30:.1f} GiB)")

    B, gamma = args.block_size, 4.0 if args.block_size <= 8 else 7.0
    T = train_seqs.shape[1]
    n_train = train_seqs.shape[0]
    opt = torch.optim.AdamW(drafter.parameters(), lr=args.lr, betas=(0.9, 0.95), weight_decay=0.01,
                            fused=device.type == "cuda")
    gen = torch.Generator(device=device).manual_seed(args.seed)
    total = args.steps if args.steps > 0 else 10**9
    eval_reserve = 40.0 if device.type == "cuda" else 0.0  # monitoring evals, final eval, export
    log_every = 10 if args.smoke or args.steps == 0 else max(10, args.steps // 40)
    log_rows, step, t_cal = [], 0, None
    mon = {k: (s[:64], a[:64]) for k, (s, a) in val.items()}
    drafter.train()
    while step < total:
        if args.steps == 0 and step == 10:
            _sync(device)
            t_cal = time.time()
        if args.steps == 0 and step == 30:
            _sync(device)
            per = (time.time() - t_cal) / 20
            total = 30 + max(1, int((args.time_budget_s - eval_reserve - (time.time() - t0)) / per))
            log(f"step time {per * 1000:.1f} ms -> {total} steps")
            report["step_ms"] = round(per * 1000, 2)
            log_every = max(10, total // 40)  # 40 log lines, 8 of them with a held-out evaluation
        if args.steps == 0 and step > 30 and step % 50 == 0 and time.time() - t0 > args.time_budget_s - eval_reserve:
            log(f"time budget reached at step {step} of {total}: stopping early")  # evaluations ran long
            break
        warm = max(1, int(0.04 * (total if total < 10**9 else 10**4)))
        for g in opt.param_groups:
            g["lr"] = lr_at(step, total if total < 10**9 else 10**4, args.lr, warm)
        rows = torch.randint(0, n_train, (args.batch,), device=device, generator=gen)
        anchors = torch.randint(P, T - B + 1, (args.batch, args.anchors), device=device, generator=gen)
        loss, acc = draft_loss(drafter, target, train_aux[rows], train_seqs[rows], anchors, B, gamma, mask_id)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(drafter.parameters(), 1.0)
        opt.step()
        step += 1
        if step % log_every == 0 or step == total:
            row = {"step": step, "loss": round(loss.item(), 4), "train_marginal": round(expected_acceptance(acc), 3),
                   "lr": round(opt.param_groups[0]["lr"], 6), "elapsed_s": round(time.time() - t0, 1)}
            if step % (log_every * 5) == 0 or step == total:
                drafter.eval()
                for k, (s, a) in mon.items():
                    row[f"val_{k}_engine"] = evaluate(drafter, target, a, s, P, B, mask_id, args.eval_max_new)["engine"]
                drafter.train()
            log_rows.append(row)
            log(json.dumps(row))
    report["steps"] = step
    report["train_s"] = round(time.time() - t0, 1)
    report["log"] = log_rows
    drafter.eval()
    for k, (s, a) in val.items():
        report[f"val_{k}"] = evaluate(drafter, target, a, s, P, B, mask_id, args.eval_max_new)
        log(f"held-out {k}: {json.dumps(report[f'val_{k}'])}")
    sub = torch.randperm(n_train, generator=torch.Generator().manual_seed(1))[:min(n_train, 256)].to(device)
    report["train_subset"] = evaluate(drafter, target, train_aux[sub], train_seqs[sub], P, B, mask_id,
                                      args.eval_max_new)
    log(f"training subset: {json.dumps(report['train_subset'])}")
    out_d = os.path.join(args.out, "drafter")
    os.makedirs(out_d, exist_ok=True)
    with open(os.path.join(out_d, "config.json"), "w") as f:
        json.dump(dcfg_dict, f, indent=2)
    save_file({k: v.detach().to(torch.bfloat16).cpu().contiguous() for k, v in drafter.state_dict().items()},
              os.path.join(out_d, "model.safetensors"))
    report["total_s"] = round(time.time() - t0, 1)
    with open(os.path.join(args.out, "dflash_train_report.json"), "w") as f:
        json.dump(report, f, indent=2)
    log(f"wrote {out_d} and dflash_train_report.json, total {report['total_s']}s")
    log_f.close()
    return report


if __name__ == "__main__":
    main()
