"""Train and export the embedded default model.

    # once, on any machine with pip access (CPU is fine): tokenizer + token streams under .data/
    python -m longflash.training.data --data-dir .data
    # train (GPU: bf16 autocast), export the HF-format directory and evaluate the exported weights
    python -m longflash.training.train --data-dir .data --out OUT --device cuda --time-budget-s 330

Data mix per row of `seq_len + 1` tokens: with probability `passkey_frac` the row starts with one
pass-key document (length uniform in [64, seq_len], answer and `<|endoftext|>` included) and is
filled up with a random window of code or prose; otherwise the whole row is a random window of the
code (p = code_frac) or prose stream. Attention is causal over the whole row.

Router balance: aux-loss-free bias update (DeepSeek-V3, "noaux_tc"): after every optimizer step,
for each MoE layer, `e_score_correction_bias += bias_update_rate * sign(mean_load - load_e)` where
load_e is the number of tokens routed to expert e in that step. The bias only affects which experts
are chosen, never the combine weights. No auxiliary loss.

Exported: config.json, model.safetensors (bf16; e_score_correction_bias fp32), tokenizer.json,
tokenizer_config.json, special_tokens_map.json, generation_config.json, eval.json, train_log.txt.
"""
from __future__ import annotations

import argparse
import json
import math
import os
import random
import shutil
import sys
import time
from typing import Any, Callable

import numpy as np
import torch
import torch.nn.functional as F

from .config import default_model_config
from .data import DEFAULT_DATA_DIR, make_passkey_ids, make_passkey_prompt, passkey_answer_matches
from .model import KimiK3TrainModel
from .tokenizer import EOS_TOKEN, load_tokenizer, token_byte_lengths

PASSKEY_EVAL_LENGTHS = (512, 1024, 2048)
SAMPLE_PROMPTS = ("def fibonacci(n):", "ROMEO.\n", "import os\nimport sys\n\n\ndef main():")


# ----------------------------------------------------------------------------- batches


class BatchSampler:
    """Random training rows [B, seq_len + 1] (int64) from the code/prose streams and pass-key docs."""

    def __init__(self, streams: dict[str, np.ndarray], tokenizer: Any, eos_id: int, seq_len: int,
                 batch_size: int, passkey_frac: float, code_frac: float, seed: int,
                 passkey_min_len: int = 64):
        self.streams = streams
        self.tok = tokenizer
        self.eos = eos_id
        self.T = seq_len
        self.B = batch_size
        self.pk = passkey_frac
        self.code_frac = code_frac
        self.rng = random.Random(seed)
        self.pk_min = min(passkey_min_len, seq_len)

    def _window(self, n: int) -> np.ndarray:
        name = "code" if self.rng.random() < self.code_frac else "prose"
        s = self.streams[name]
        start = self.rng.randrange(0, len(s) - n)
        return s[start : start + n].astype(np.int64)

    def row(self) -> np.ndarray:
        n = self.T + 1
        if self.rng.random() < self.pk:
            length = self.rng.randint(self.pk_min, self.T)
            ids = make_passkey_ids(self.tok, length, self.rng) + [self.eos]
            ids = np.asarray(ids[:n], dtype=np.int64)
            if len(ids) < n:
                ids = np.concatenate([ids, self._window(n - len(ids))])
            return ids
        return self._window(n)

    def __call__(self) -> torch.Tensor:
        return torch.from_numpy(np.stack([self.row() for _ in range(self.B)]))


# ----------------------------------------------------------------------------- training


def lr_at(step: int, total: int, peak: float, warmup: int, min_ratio: float = 0.1) -> float:
    """Linear warmup for `warmup` steps, then cosine from peak to min_ratio * peak at `total`."""
    if step < warmup:
        return peak * (step + 1) / warmup
    t = min(1.0, (step - warmup) / max(1, total - warmup))
    return peak * (min_ratio + (1 - min_ratio) * 0.5 * (1 + math.cos(math.pi * t)))


@torch.no_grad()
def update_router_bias(model: KimiK3TrainModel, rate: float) -> None:
    """Aux-loss-free balancing: bias_e += rate * sign(mean_load - load_e) per MoE layer."""
    for moe in model.moe_layers():
        c = moe.last_expert_counts
        if c is None:
            continue
        moe.gate.e_score_correction_bias.add_(rate * torch.sign(c.mean() - c))


def lm_loss(model: KimiK3TrainModel, batch: torch.Tensor) -> torch.Tensor:
    """Mean next-token cross entropy (nats) of batch [B, T+1]."""
    logits = model(batch[:, :-1])
    return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), batch[:, 1:].reshape(-1))


def train_loop(model: KimiK3TrainModel, next_batch: Callable[[], torch.Tensor], *, steps: int, lr: float,
               device: torch.device, warmup: int = 100, weight_decay: float = 0.1, grad_clip: float = 1.0,
               bias_update_rate: float = 1e-3, time_budget_s: float | None = None, log_every: int = 50,
               log: Callable[[str], None] = print, eval_fn: Callable[[int], None] | None = None,
               eval_every: int = 0) -> list[float]:
    """AdamW (betas 0.9/0.95) + warmup/cosine, bf16 autocast on CUDA. When `steps` is 0 the step
    count is set from `time_budget_s` and the measured time of steps 10..30. Returns per-step losses."""
    decay, no_decay = [], []
    for n, p in model.named_parameters():
        (decay if p.dim() >= 2 and "_res_proj" not in n and "embed_tokens" not in n else no_decay).append(p)
    opt = torch.optim.AdamW([{"params": decay, "weight_decay": weight_decay},
                             {"params": no_decay, "weight_decay": 0.0}],
                            lr=lr, betas=(0.9, 0.95), eps=1e-8, fused=device.type == "cuda")
    use_amp = device.type == "cuda"
    total = steps if steps > 0 else 10**9
    losses: list[float] = []
    t0 = time.time()
    t_calib = None
    step = 0
    loss_acc = torch.zeros((), device=device)
    n_acc = 0
    while step < total:
        if steps == 0 and step == 10:
            if device.type == "cuda":
                torch.cuda.synchronize()
            t_calib = time.time()
        if steps == 0 and step == 30:
            if device.type == "cuda":
                torch.cuda.synchronize()
            per = (time.time() - t_calib) / 20
            remaining = time_budget_s - (time.time() - t0)
            total = 30 + max(1, int(remaining / per))
            log(f"step time {per * 1000:.1f} ms -> total steps {total}")
        for g in opt.param_groups:
            g["lr"] = lr_at(step, total if total < 10**9 else 10 * warmup, lr, warmup)
        batch = next_batch().to(device, non_blocking=True)
        with torch.autocast(device_type=device.type, dtype=torch.bfloat16, enabled=use_amp):
            loss = lm_loss(model, batch)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), grad_clip)
        opt.step()
        update_router_bias(model, bias_update_rate)
        loss_acc += loss.detach()
        n_acc += 1
        step += 1
        if step % log_every == 0 or step == total:
            avg = float(loss_acc) / n_acc
            losses.append(avg)
            log(f"step {step}/{total if total < 10**9 else '?'} loss {avg:.4f} lr {opt.param_groups[0]['lr']:.2e} "
                f"elapsed {time.time() - t0:.0f}s")
            loss_acc.zero_()
            n_acc = 0
        if eval_fn is not None and eval_every and step % eval_every == 0 and step != total:
            eval_fn(step)
    return losses


# ----------------------------------------------------------------------------- evaluation


@torch.no_grad()
def eval_stream(model: KimiK3TrainModel, stream: np.ndarray, byte_len: np.ndarray, eos_id: int, seq_len: int,
                device: torch.device, batch_size: int = 8, max_rows: int | None = None) -> dict[str, float]:
    """Validation loss over non-overlapping rows of seq_len + 1 tokens. Targets equal to eos (document
    separators) are excluded. Returns nats/token, bits/byte, tokens, bytes."""
    n = seq_len + 1
    rows = len(stream) // n
    if max_rows is not None:
        rows = min(rows, max_rows)
    arr = torch.from_numpy(stream[: rows * n].astype(np.int64)).view(rows, n)
    blen = torch.tensor(byte_len, dtype=torch.float64)
    nats = 0.0
    toks = 0
    nbytes = 0.0
    for i in range(0, rows, batch_size):
        b = arr[i : i + batch_size].to(device)
        logits = model(b[:, :-1])
        ce = F.cross_entropy(logits.reshape(-1, logits.shape[-1]), b[:, 1:].reshape(-1), reduction="none")
        tgt = b[:, 1:].reshape(-1)
        keep = tgt != eos_id
        nats += float(ce[keep].double().sum())
        toks += int(keep.sum())
        nbytes += float(blen[tgt[keep].cpu()].sum())
    return {"nats_per_token": nats / max(1, toks), "bits_per_byte": nats / math.log(2) / max(1.0, nbytes),
            "tokens": toks, "bytes": int(nbytes)}


@torch.no_grad()
def passkey_accuracy(model: KimiK3TrainModel, hf_tokenizer: Any, lengths: tuple[int, ...], trials: int,
                     seed0: int = 0) -> dict[str, Any]:
    """Exact greedy retrieval rate with `make_passkey_prompt(tok, L, seed)` for seed in
    seed0..seed0+trials-1; greedy decoding by the training module (full recompute, 8 new tokens)."""
    eos = hf_tokenizer.convert_tokens_to_ids(EOS_TOKEN)
    out: dict[str, Any] = {}
    for L in lengths:
        ok = 0
        fails = []
        for s in range(seed0, seed0 + trials):
            prompt, key = make_passkey_prompt(hf_tokenizer, L, s)
            ids = hf_tokenizer.encode(prompt, add_special_tokens=False)
            new = model.generate_greedy(ids, 8, eos_token_id=eos)
            text = hf_tokenizer.decode(new, skip_special_tokens=True)
            if passkey_answer_matches(text, key):
                ok += 1
            elif len(fails) < 3:
                fails.append({"seed": s, "key": key, "got": text})
        out[str(L)] = {"accuracy": ok / trials, "trials": trials, "examples_failed": fails}
    return out


@torch.no_grad()
def sample(model: KimiK3TrainModel, hf_tokenizer: Any, prompt: str, max_new_tokens: int = 96) -> str:
    """Greedy continuation of prompt (stops at eos)."""
    eos = hf_tokenizer.convert_tokens_to_ids(EOS_TOKEN)
    ids = hf_tokenizer.encode(prompt, add_special_tokens=False)
    new = model.generate_greedy(ids, max_new_tokens, eos_token_id=eos)
    return hf_tokenizer.decode(new, skip_special_tokens=True)


# ----------------------------------------------------------------------------- export


def export(model: KimiK3TrainModel, out_dir: str, tokenizer_dir: str) -> None:
    """Write the HF-format model directory (config, bf16 safetensors, tokenizer files, generation config)."""
    from safetensors.torch import save_file

    os.makedirs(out_dir, exist_ok=True)
    with open(os.path.join(out_dir, "config.json"), "w") as f:
        json.dump(model.config, f, indent=2)
    save_file(model.export_state_dict(torch.bfloat16), os.path.join(out_dir, "model.safetensors"),
              metadata={"format": "pt"})
    for name in ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json"):
        shutil.copy(os.path.join(tokenizer_dir, name), os.path.join(out_dir, name))
    cfg = model.config
    gen = {"bos_token_id": cfg["bos_token_id"], "eos_token_id": cfg["eos_token_id"], "pad_token_id": cfg["pad_token_id"],
           "do_sample": True, "temperature": 0.7, "top_p": 0.95, "top_k": 0, "max_new_tokens": 256}
    with open(os.path.join(out_dir, "generation_config.json"), "w") as f:
        json.dump(gen, f, indent=2)


# ----------------------------------------------------------------------------- main


def smoke_overrides() -> dict[str, Any]:
    """A tiny config of the same architecture for CPU smoke runs and tests."""
    return dict(hidden_size=64, intermediate_size=96, num_hidden_layers=4, num_attention_heads=2, q_lora_rank=32,
                kv_lora_rank=32, qk_nope_head_dim=16, qk_rope_head_dim=8, v_head_dim=16, num_experts=4,
                num_experts_per_token=2, moe_intermediate_size=32, routed_expert_hidden_size=32,
                attn_res_block_size=2)


def main(argv: list[str] | None = None) -> dict[str, Any]:
    ap = argparse.ArgumentParser(description="Train and export the longflash default model", allow_abbrev=False)
    ap.add_argument("--out", required=True)
    ap.add_argument("--data-dir", default=DEFAULT_DATA_DIR)
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--steps", type=int, default=0, help="0: derive from --time-budget-s")
    ap.add_argument("--time-budget-s", type=float, default=330.0)
    ap.add_argument("--seq-len", type=int, default=2048)
    ap.add_argument("--batch-size", type=int, default=32)
    ap.add_argument("--lr", type=float, default=2e-3)
    ap.add_argument("--warmup", type=int, default=150)
    ap.add_argument("--weight-decay", type=float, default=0.1)
    ap.add_argument("--passkey-frac", type=float, default=0.3)
    ap.add_argument("--code-frac", type=float, default=0.5)
    ap.add_argument("--bias-update-rate", type=float, default=1e-3)
    ap.add_argument("--passkey-trials", type=int, default=50)
    ap.add_argument("--eval-every", type=int, default=500)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--smoke", action="store_true", help="tiny config, few steps, short eval (CPU dry run)")
    args = ap.parse_args(argv)

    os.makedirs(args.out, exist_ok=True)
    logf = open(os.path.join(args.out, "train_log.txt"), "a")

    def log(msg: str) -> None:
        print(msg, flush=True)
        logf.write(msg + "\n")
        logf.flush()

    torch.manual_seed(args.seed)
    device = torch.device(args.device)
    if device.type == "cuda":
        torch.backends.cuda.matmul.allow_tf32 = True
        torch.backends.cudnn.allow_tf32 = True
    tok_dir = os.path.join(args.data_dir, "tokenizer")
    tok = load_tokenizer(tok_dir)
    from transformers import AutoTokenizer

    hf_tok = AutoTokenizer.from_pretrained(tok_dir)
    eos = tok.token_to_id(EOS_TOKEN)
    streams = {k: np.load(os.path.join(args.data_dir, f"{k}_train.npy")) for k in ("code", "prose")}
    val = {k: np.load(os.path.join(args.data_dir, f"{k}_val.npy")) for k in ("code", "prose")}
    byte_len = np.asarray(token_byte_lengths(tok), dtype=np.float64)

    overrides: dict[str, Any] = {}
    pk_lengths = PASSKEY_EVAL_LENGTHS
    if args.smoke:
        overrides = smoke_overrides()
        args.seq_len = min(args.seq_len, 256)
        args.batch_size = min(args.batch_size, 4)
        args.steps = args.steps or 20
        args.passkey_trials = min(args.passkey_trials, 2)
        args.warmup = 5
        args.eval_every = 10
        pk_lengths = (256,)
    cfg = default_model_config(vocab_size=tok.get_vocab_size(), bos_token_id=eos, eos_token_id=eos, pad_token_id=eos,
                               **overrides)
    model = KimiK3TrainModel(cfg).to(device)
    counts = model.num_parameters()
    log(f"args {vars(args)}")
    log(f"params total {counts['total']:,} active/token {counts['active']:,}; device {device} "
        f"{torch.cuda.get_device_name() if device.type == 'cuda' else ''}")
    sampler = BatchSampler(streams, tok, eos, args.seq_len, args.batch_size, args.passkey_frac, args.code_frac,
                           args.seed)

    def quick_eval(step: int) -> None:
        model.eval()
        with torch.autocast(device_type=device.type, dtype=torch.bfloat16, enabled=device.type == "cuda"):
            r = {k: eval_stream(model, val[k], byte_len, eos, args.seq_len, device, max_rows=16) for k in val}
            pk = passkey_accuracy(model, hf_tok, (pk_lengths[-1],), 5, seed0=10_000)
        model.train()
        log(f"eval step {step}: code {r['code']['nats_per_token']:.3f} nats/tok, prose "
            f"{r['prose']['nats_per_token']:.3f} nats/tok, passkey@{pk_lengths[-1]} (5 trials) "
            f"{pk[str(pk_lengths[-1])]['accuracy']:.2f}")

    model.train()
    t0 = time.time()
    losses = train_loop(model, sampler, steps=args.steps, lr=args.lr, device=device, warmup=args.warmup,
                        weight_decay=args.weight_decay, bias_update_rate=args.bias_update_rate,
                        time_budget_s=args.time_budget_s, log_every=10 if args.smoke else 50, log=log,
                        eval_fn=quick_eval, eval_every=args.eval_every)
    train_s = time.time() - t0
    for i, moe in enumerate(model.moe_layers()):
        c = moe.last_expert_counts
        if i in (0, len(model.moe_layers()) - 1) and c is not None:
            log(f"moe layer {i + 1} last-step load {[int(x) for x in c.tolist()]} "
                f"bias {[round(x, 3) for x in moe.gate.e_score_correction_bias.tolist()]}")
    export(model, args.out, tok_dir)
    log(f"exported to {args.out} after {train_s:.0f}s of training")

    # Evaluate the exported (bf16-rounded) weights in fp32.
    del model
    ref = KimiK3TrainModel.from_pretrained(args.out, dtype=torch.float32, device=device)
    if device.type == "cuda":
        torch.backends.cuda.matmul.allow_tf32 = False
        torch.backends.cudnn.allow_tf32 = False
    res: dict[str, Any] = {"params": counts, "train_seconds": train_s, "final_train_loss": losses[-1] if losses else None,
                           "args": vars(args), "device": torch.cuda.get_device_name() if device.type == "cuda" else "cpu"}
    max_rows = 4 if args.smoke else None
    res["val"] = {k: eval_stream(ref, val[k], byte_len, eos, args.seq_len, device, max_rows=max_rows) for k in val}
    log(f"val {json.dumps(res['val'])}")
    res["passkey"] = passkey_accuracy(ref, hf_tok, pk_lengths, args.passkey_trials, seed0=0)
    log(f"passkey {json.dumps({k: v['accuracy'] for k, v in res['passkey'].items()})}")
    res["samples"] = {p: sample(ref, hf_tok, p, 24 if args.smoke else 96) for p in SAMPLE_PROMPTS}
    for p, s in res["samples"].items():
        log(f"--- sample: {p!r}\n{p}{s}")
    with open(os.path.join(args.out, "eval.json"), "w") as f:
        json.dump(res, f, indent=2)
    logf.close()
    return res


if __name__ == "__main__":
    main(sys.argv[1:])
