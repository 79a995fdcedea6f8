"""Compile the MLA decode kernels for sm_90 on a machine without a GPU and report, per tile config,
what costs no device time (HOPPER.md / METHOD.md): registers, spills, shared memory, the matrix
instruction (``wgmma`` or ``mma.sync``), and whether every 2-D load of the kv loop became a pipelined
``cp.async`` into multi-buffered shared memory.

    python benchmarks/mla_decode_sm90_report.py [--out DIR]

Uses Triton's ahead-of-time ``triton.compile`` with a ``GPUTarget("cuda", 90, 32)`` and the ``ptxas``
bundled with Triton (``-v``). Pointer/stride arguments are marked 16-divisible as the JIT does for
real tensors (without that no load is vectorized and nothing is pipelined). Also compiles the variants
the engine may launch (fp32 queries, DCP visible lengths, unsplit output, stage 2) so a compile error
shows here rather than on the device. Gluon candidates (``GLUON``) are compiled in their split bf16 form;
``tests/test_gluon_mla_decode.py`` compiles the other forms the wrapper launches.
"""
from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
import tempfile

import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from longflash.attention import gluon_mla_decode, gluon_mla_decode_wgmma  # noqa: E402
from longflash.attention import triton_mla_decode as m  # noqa: E402

BIN = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin")
PTXAS = os.path.join(BIN, "ptxas")
TARGET = GPUTarget("cuda", 90, 32)


def _compile(fn, sig: dict, const: dict, div: list[str], num_warps: int, num_stages: int, maxnreg=None):
    for k in const:
        sig[k] = "constexpr"
    names = list(sig)
    src = ASTSource(fn=fn, signature=sig, constexprs={(names.index(k),): v for k, v in const.items()},
                    attrs={(names.index(k),): [["tt.divisibility", 16]] for k in div})
    return triton.compile(src, target=TARGET, options=dict(num_warps=num_warps, num_stages=num_stages,
                                                           **({"maxnreg": maxnreg} if maxnreg else {})))


def stage1(fp8: bool, cfg: dict, split: bool = True, qdt: str = "bf16", has_vis: bool = False, R=512, P=64,
           block_size: int = 16):
    sig = {"q_ptr": f"*{qdt}", "cache_ptr": "*u8" if fp8 else f"*{qdt}", "bt_ptr": "*i32", "qsl_ptr": "*i32",
           "kvlen_ptr": "*i32", "vis_ptr": "*i32", "out_ptr": "*fp32" if split else f"*{qdt}", "lse_ptr": "*fp32",
           "H": "i32", "stride_bt": "i32", "stride_qt": "i32", "stride_qh": "i32",
           "stride_ot": "i32", "stride_oh": "i32", "num_splits": "i32", "qk_scale": "fp32", "out_scale": "fp32"}
    f16 = bool(cfg.get("F16")) and fp8 and qdt != "fp32"
    const = dict(R=R, P=P, BLOCK_R=triton.next_power_of_2(R), BLOCK_P=max(16, triton.next_power_of_2(P)),
                 BLOCK_M=cfg["BLOCK_M"], BLOCK_N=cfg["BLOCK_N"], BLOCK_SIZE=block_size, FP8=fp8, HW_FP8=True,
                 HAS_VIS=has_vis, SPLIT=split, DOT_IEEE=qdt == "fp32",
                 V_RELOAD=bool(cfg["V_RELOAD"]) and not (f16 and (cfg.get("PREFETCH") or cfg.get("CVT_SMEM"))),
                 TRANS=bool(cfg.get("TRANS")), F16=f16, PREFETCH=f16 and bool(cfg.get("PREFETCH")),
                 CVT_SMEM=f16 and not cfg.get("PREFETCH") and bool(cfg.get("CVT_SMEM")), INTERPRET=False)
    div = ["q_ptr", "cache_ptr", "bt_ptr", "qsl_ptr", "kvlen_ptr", "vis_ptr", "out_ptr", "lse_ptr", "H",
           "stride_qt", "stride_qh", "stride_ot", "stride_oh"]
    return _compile(m._mla_decode_stage1, sig, const, div, cfg["num_warps"], cfg["num_stages"], cfg.get("maxnreg"))


def stage2(block_s: int, block_c: int, qdt: str = "bf16"):
    sig = {"part_ptr": "*fp32", "plse_ptr": "*fp32", "out_ptr": f"*{qdt}", "lse_ptr": "*fp32", "H": "i32",
           "num_splits": "i32", "stride_ot": "i32", "stride_oh": "i32"}
    const = dict(R=512, BLOCK_R=512, BLOCK_S=block_s, BLOCK_C=block_c)
    return _compile(m._mla_decode_stage2, sig, const, ["part_ptr", "plse_ptr", "out_ptr", "lse_ptr", "stride_ot",
                                                        "stride_oh"], 4, 1)


def loop_sass(cubin: bytes) -> dict:
    """SASS of the kernel's main loop (the longest backward branch): instructions per iteration per
    warp, and the counts of the matrix, shared-memory and conversion instructions among them."""
    with tempfile.NamedTemporaryFile("wb", suffix=".cubin", delete=False) as f:
        f.write(cubin)
    sass = subprocess.run([os.path.join(BIN, "cuobjdump"), "-sass", f.name], capture_output=True, text=True).stdout
    os.unlink(f.name)
    ins = []
    for ln in sass.splitlines():
        mt = re.match(r"\s+/\*([0-9a-f]+)\*/\s+(@!?U?P\w+\s+)?([A-Z0-9_.]+)\s*([^;]*)", ln)
        if mt:
            ins.append((int(mt.group(1), 16), mt.group(3), mt.group(4)))
    lo_hi = None
    for a, op, args in ins:
        br = re.match(r"(0x[0-9a-f]+)", args.strip()) if op == "BRA" else None
        if br and int(br.group(1), 16) < a and (lo_hi is None or a - int(br.group(1), 16) > lo_hi[1] - lo_hi[0]):
            lo_hi = (int(br.group(1), 16), a)
    body = [op for a, op, _ in ins if lo_hi and lo_hi[0] <= a <= lo_hi[1]]

    def cnt(*prefixes):
        return sum(op.startswith(prefixes) for op in body)
    return {"loop_instr": len(body), "loop_mma": cnt("HGMMA", "HMMA"), "loop_lds": cnt("LDS", "LDSM"),
            "loop_lds_u8_u16": cnt("LDS.U8", "LDS.U16"), "loop_cvt": cnt("F2F", "F2FP"),
            "loop_local_mem": cnt("LDL", "STL")}


def report(kernel) -> dict:
    ptx, ttgir = kernel.asm["ptx"], kernel.asm["ttgir"]
    with tempfile.NamedTemporaryFile("w", suffix=".ptx", delete=False) as f:
        f.write(ptx)
    info = subprocess.run([PTXAS, "-arch=sm_90a", "-v", f.name, "-o", os.devnull], capture_output=True,
                          text=True).stderr
    os.unlink(f.name)
    regs = re.search(r"Used (\d+) registers", info)
    spill = re.search(r"(\d+) bytes spill stores, (\d+) bytes spill loads", info)
    loop = ttgir[ttgir.index("scf.for"):] if "scf.for" in ttgir else ""
    bufs = [re.search(r"memdesc<([^,]*),", ln).group(1) for ln in ttgir.splitlines() if "local_alloc : ()" in ln]
    return {"regs": int(regs.group(1)) if regs else None,
            "spill_bytes": int(spill.group(1)) + int(spill.group(2)) if spill else None,
            "smem": kernel.metadata.shared,
            "mma": "wgmma" if "wgmma" in ptx else "mma.sync" if "mma.sync" in ptx else "-",
            "buffers": bufs, "unpipelined_2d_loads": len(re.findall(r"= tt\.load .*tensor<\d+x\d+x", loop)),
            **loop_sass(kernel.asm["cubin"])}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], allow_abbrev=False)
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    import torch
    rows = []
    for fp8 in (False, True):
        dt = torch.float8_e4m3fn if fp8 else torch.bfloat16
        for q_rows in (16, 128):
            for i, cfg in enumerate(m.candidate_configs(q_rows, dt)):
                r = dict(cache="fp8" if fp8 else "bf16", q_rows=q_rows, default=i == 0, **cfg)
                try:
                    if cfg.get("GLUON") and cfg.get("WGMMA"):  # the sm_90 wgmma stage 1 (gluon_mla_decode_wgmma.py)
                        r.update(report(gluon_mla_decode_wgmma.compile_stage1(TARGET, stages=cfg["num_stages"])))
                    elif cfg.get("GLUON"):  # the mma.sync Gluon fp8 stage 1 (attention/gluon_mla_decode.py)
                        r.update(report(gluon_mla_decode.compile_stage1(
                            TARGET, block_n=cfg["BLOCK_N"], stages=cfg["num_stages"], maxnreg=cfg.get("maxnreg"),
                            warps=cfg["num_warps"])))
                    else:
                        r.update(report(stage1(fp8, cfg)))
                except Exception as e:  # noqa: BLE001  (a compile failure is a result here)
                    r["error"] = repr(e)[:500]
                rows.append(r)
                print(json.dumps(r), flush=True)
    d = m.default_config(16, torch.bfloat16)
    pre = dict(m.TRITON_FP8_CONFIG, num_warps=8, num_stages=1, V_RELOAD=False, PREFETCH=True, occupancy=1)
    t = dict(pre, TRANS=True, BLOCK_N=64)  # swap-AB, fp16, prefetch
    cv = next(c for c in m.candidate_configs(16, torch.float8_e4m3fn) if c.get("CVT_SMEM"))  # version 3
    for name, fp8, cfg, kw in (("unsplit bf16 out", False, d, dict(split=False)),
                               ("fp32 q (ieee dots)", False, d, dict(qdt="fp32")),
                               ("DCP visible lengths", False, d, dict(has_vis=True)),
                               ("default-model width 64+16", False, d, dict(R=64, P=16)),
                               ("block size 64", False, d, dict(block_size=64)),
                               ("swap-AB bf16 64+16", False, dict(d, TRANS=True, BLOCK_N=64), dict(R=64, P=16)),
                               ("swap-AB fp8 unsplit", True, t, dict(split=False)),
                               ("swap-AB fp8, fp32 q", True, t, dict(qdt="fp32")),
                               ("swap-AB fp8 DCP", True, t, dict(has_vis=True)),
                               ("swap-AB fp8 64+16", True, t, dict(R=64, P=16)),
                               ("swap-AB fp8 block size 64", True, t, dict(block_size=64)),
                               ("convert-once fp8 unsplit", True, cv, dict(split=False)),
                               ("convert-once fp8, fp16 q", True, cv, dict(qdt="fp16")),
                               ("convert-once fp8 DCP", True, cv, dict(has_vis=True)),
                               ("convert-once fp8 64+16", True, cv, dict(R=64, P=16)),
                               ("convert-once fp8 64+16 N16", True, dict(cv, BLOCK_N=16), dict(R=64, P=16)),
                               ("convert-once fp8 swap-AB N64 w8", True,
                                dict(cv, TRANS=True, BLOCK_N=64, num_warps=8, num_stages=2), {})):
        r = dict(variant=name)
        try:
            r.update(report(stage1(fp8, cfg, **kw)))
        except Exception as e:  # noqa: BLE001
            r["error"] = repr(e)[:500]
        rows.append(r)
        print(json.dumps(r), flush=True)
    for bs_, bc in ((4, 512), (32, 128), (256, 16)):
        r = dict(variant=f"stage2 BLOCK_S={bs_} BLOCK_C={bc}")
        try:
            r.update(report(stage2(bs_, bc)))
        except Exception as e:  # noqa: BLE001
            r["error"] = repr(e)[:500]
        rows.append(r)
        print(json.dumps(r), flush=True)
    if args.out:
        os.makedirs(args.out, exist_ok=True)
        with open(os.path.join(args.out, "mla_decode_sm90_report.json"), "w") as f:
            json.dump(rows, f, indent=1)
    bad = [r for r in rows if "error" in r]
    if bad:
        sys.exit(f"{len(bad)} variants failed to compile")


if __name__ == "__main__":
    main()
