"""Staged MXFP8 drafter input vs concatenate-then-quantize (issue 9).

    python benchmarks/mxfp8_staged.py --out DIR            # GPU: M=4096, 6 taps x 7168, N=7168, bf16
    python benchmarks/mxfp8_staged.py --out DIR --smoke    # tiny shape, runs on the CPU

Writes DIR/mxfp8_staged.json and DIR/mxfp8_staged.md with:
  * peak allocated bytes of one step, staged vs concatenated (CUDA: torch.cuda.max_memory_allocated,
    reset before each; CPU: the LiveTensorBytes dispatch tracker), beside the production reference
    figures 663,355,904 vs 1,278,083,584 bytes; goal staged/concat <= 0.50;
  * time of the whole projection (quantize all taps + GEMM), staged vs concatenated; goal <= 1.00;
  * quantize-kernel bandwidth vs the copy bandwidth measured in the same run; goal >= 0.90;
  * bitwise equality (Triton vs reference bytes, staged vs concat bytes and outputs);
  * the accumulator under torch.compile(fullgraph=True) and under CUDA-graph capture + replay.
Each section records its error instead of aborting the run, and the JSON is rewritten after each.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
import traceback

import torch

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, REPO)

from longflash.ops.mxfp8 import MX_BLOCK, quantize_mxfp8_into  # noqa: E402
from longflash.ops.mxfp8 import dequantize_mxfp8  # noqa: E402
from longflash.ops import triton_launch  # noqa: E402
from longflash.spec_decode.staged_input import (DEFAULT_ROW_CHUNK, LiveTensorBytes,  # noqa: E402
                                                StagedDrafterInput, concat_then_quantize,
                                                default_dequantize_fn, mxfp8_buffers, project_mxfp8)
import gpu_timing  # noqa: E402
import provenance  # noqa: E402  (benchmarks/provenance.py: the commit a result came from)

REF_STAGED_BYTES = 663_355_904
REF_CONCAT_BYTES = 1_278_083_584


def _bits(t: torch.Tensor) -> torch.Tensor:
    ity = {torch.float32: torch.int32, torch.bfloat16: torch.int16, torch.float16: torch.int16}.get(t.dtype)
    return t.view(ity) if ity is not None else t


def bits_equal(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.shape == b.shape and a.dtype == b.dtype and torch.equal(_bits(a), _bits(b))


class Bench:
    def __init__(self, args):
        self.args = args
        self.cuda = torch.cuda.is_available() and not args.cpu
        self.dev = torch.device("cuda" if self.cuda else "cpu")
        if args.smoke:
            self.m, self.widths, self.n = 64, [256] * 6, 256
        else:
            self.m, self.widths, self.n = args.tokens, [args.width] * args.taps, args.width
        self.k = sum(self.widths)
        self.dtype = torch.bfloat16
        self.row_chunk = min(args.row_chunk, self.m)
        self.reps = 3 if args.smoke else args.reps
        self.kernel_reps = 3 if args.smoke else args.kernel_reps
        self.res: dict = {"shape": {"tokens": self.m, "tap_widths": self.widths, "out_features": self.n,
                                    "dtype": "bfloat16", "row_chunk": self.row_chunk}}
        self.out_dir = args.out
        self._flush = None  # L2-flush buffer, allocated on the first timing (after the memory section)
        self.triton_ok = False
        if self.cuda or os.environ.get("TRITON_INTERPRET", "0") not in ("", "0"):
            try:
                from longflash.ops.mxfp8_triton import quantize_mxfp8_into_triton
                self.qtri = quantize_mxfp8_into_triton
                self.triton_ok = True
            except ImportError:
                pass
        self.quantize = self.qtri if self.triton_ok else quantize_mxfp8_into
        self.dtri = None
        if self.triton_ok:
            from longflash.ops.mxfp8_triton import dequantize_mxfp8_triton
            self.dtri = dequantize_mxfp8_triton
        # the projection's dequantizer: what project_mxfp8 picks by default on this device
        self.dequantize = default_dequantize_fn(torch.empty(0, dtype=torch.uint8, device=self.dev), self.dtype)
        self.dequantize_name = getattr(self.dequantize, "__name__", str(self.dequantize))

    # ---- helpers ---------------------------------------------------------------------------------
    def sync(self):
        if self.cuda:
            torch.cuda.synchronize()

    def time_ms(self, fn, reps=None, flush=True) -> float:
        """Median wall time of fn in ms (CUDA events on GPU), L2 flushed before each rep."""
        reps = reps or self.reps
        if self._flush is None:
            self._flush = torch.empty(256 << 20 if self.cuda else 1 << 20, dtype=torch.int8, device=self.dev)
        fn()
        self.sync()
        times = []
        for _ in range(reps):
            if flush:
                self._flush.zero_()
            if self.cuda:
                a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                a.record()
                fn()
                b.record()
                b.synchronize()
                times.append(a.elapsed_time(b))
            else:
                t0 = time.perf_counter()
                fn()
                times.append((time.perf_counter() - t0) * 1e3)
        return statistics.median(times)

    def time_graph_ms(self, fns, replays=None) -> float:
        """ms per call of back-to-back launches: ``fns`` (zero-arg callables over distinct buffers whose
        total exceeds L2) captured once into a CUDA graph and replayed; median over replays of graph
        time / len(fns). Excludes Python launch overhead and event granularity, identically for the
        copy and the kernels. CUDA only."""
        replays = replays or max(5, self.kernel_reps // 5)
        return 1e3 * gpu_timing.graph_seconds(lambda: [f() for f in fns], calls=1, replays=replays) / len(fns)

    def time_interleaved_ms(self, fns: dict, reps=None) -> dict:
        """Median ms of each fn, run interleaved (a, b, a, b, ...; order alternating per rep) so drift in
        clocks/temperature hits all alike; L2 flushed before each call. Also the median of the per-rep
        ratios of the first fn over each other one (paired, robust to slow reps)."""
        reps = reps or self.reps
        if self._flush is None:
            self._flush = torch.empty(256 << 20 if self.cuda else 1 << 20, dtype=torch.int8, device=self.dev)
        names = list(fns)
        for f in fns.values():  # warm-up
            f()
        self.sync()
        times = {n: [] for n in names}
        for r in range(reps):
            for n in (names if r % 2 == 0 else names[::-1]):
                self._flush.zero_()
                if self.cuda:
                    a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                    a.record()
                    fns[n]()
                    b.record()
                    b.synchronize()
                    times[n].append(a.elapsed_time(b))
                else:
                    t0 = time.perf_counter()
                    fns[n]()
                    times[n].append((time.perf_counter() - t0) * 1e3)
        out = {n: statistics.median(t) for n, t in times.items()}
        first = names[0]
        for n in names[1:]:
            out[f"paired_ratio_{first}_over_{n}"] = statistics.median(x / y for x, y in zip(times[first], times[n]))
        out["reps"] = reps
        return out

    def host_ms(self, fns: dict, reps=None) -> dict:
        """Median host time (ms) to *enqueue* each fn (perf_counter around the call, GPU idle before it,
        L2 flush enqueued first as in the timings). When this exceeds the GPU work the call enqueues, the
        GPU waits for the host: that is the eager path's launch overhead."""
        reps = reps or self.reps
        out = {}
        for n, f in fns.items():
            f()
            times = []
            for _ in range(reps):
                self.sync()
                if self._flush is not None:
                    self._flush.zero_()
                t0 = time.perf_counter()
                f()
                times.append((time.perf_counter() - t0) * 1e3)
            self.sync()
            out[n] = statistics.median(times)
        return out

    @staticmethod
    def without_plans(fn):
        """Run ``fn()`` with the cached launch plans off (every launch through the checks and Triton's
        launcher, as in the first H200 run); returns its result."""
        triton_launch.ENABLED = False
        try:
            return fn()
        finally:
            triton_launch.ENABLED = True

    def taps(self, seed=0):
        g = torch.Generator(device=self.dev).manual_seed(seed)
        return [torch.randn(self.m, w, generator=g, device=self.dev, dtype=self.dtype) for w in self.widths]

    def weight(self):
        g = torch.Generator(device=self.dev).manual_seed(123)
        return (torch.randn(self.n, self.k, generator=g, device=self.dev, dtype=self.dtype) * 0.02)

    def save(self):
        os.makedirs(self.out_dir, exist_ok=True)
        with open(os.path.join(self.out_dir, "mxfp8_staged.json"), "w") as f:
            json.dump(self.res, f, indent=2)
        with open(os.path.join(self.out_dir, "mxfp8_staged.md"), "w") as f:
            f.write(self.markdown())

    def section(self, name, fn):
        t0 = time.perf_counter()
        try:
            self.res[name] = fn()
        except Exception as e:  # record and go on: one failing section must not hide the others
            self.res[name] = {"error": f"{type(e).__name__}: {e}", "traceback": traceback.format_exc()[-2000:]}
        self.res.setdefault("section_seconds", {})[name] = round(time.perf_counter() - t0, 2)
        print(f"[{name}] {time.perf_counter() - t0:.1f}s: {json.dumps(self.res[name], default=str)[:800]}", flush=True)
        self.save()

    # ---- sections ----------------------------------------------------------------------------------
    def env(self):
        commit = provenance.commit()
        info = {"commit": commit or "unknown", "command": " ".join([os.path.basename(sys.executable)] + sys.argv),
                "torch": torch.__version__, "python": sys.version.split()[0],
                "device": torch.cuda.get_device_name() if self.cuda else "cpu",
                "quantizer": "triton" if self.triton_ok else "reference"}
        try:
            import triton
            info["triton"] = triton.__version__
        except ImportError:
            info["triton"] = None
        return info

    def bandwidth(self):
        m, w = self.m, self.widths[0]
        kr = self.kernel_reps
        src = torch.randn(m, w, device=self.dev, dtype=self.dtype)
        dst = torch.empty_like(src)
        copy_ms = self.time_ms(lambda: dst.copy_(src), reps=kr)
        copy_bytes = 2 * src.numel() * src.element_size()
        copy_bw = copy_bytes / copy_ms
        out = {"copy_bytes": copy_bytes, "copy_ms": copy_ms, "copy_GBps": copy_bytes / copy_ms / 1e6, "reps": kr}
        data, scales, _ = mxfp8_buffers(m, self.widths, 1, device=self.dev)
        q_bytes = m * w * (src.element_size() + 1) + m * w // MX_BLOCK
        out["quantize_bytes"] = q_bytes
        col0 = self.k - w  # the last slice of the assembled buffer (row stride = total width)
        if not self.triton_ok:
            ms = self.time_ms(lambda: quantize_mxfp8_into(src, data, scales, col0))
            out["reference"] = {"ms": ms, "GBps": q_bytes / ms / 1e6, "fraction_of_copy": copy_ms / ms}
            return out
        from longflash.ops.mxfp8_triton import dequantize_config, quantize_config
        table = quantize_config(m, w)
        out["table_config"] = list(table)
        # (block_m, groups, num_warps); None = the config table's choice (the default path)
        configs = [None, (2, 32, 2), (4, 32, 2), (4, 32, 4), (8, 32, 4), (16, 32, 8), (16, 32, 16), (8, 16, 4),
                   (32, 16, 8)]
        if self.args.smoke:
            configs = configs[:2]
        rows = []
        for rounding in (["native", "bits"] if self.cuda else ["bits"]):
            for cfg in (configs if rounding == "native" or not self.cuda else configs[:1]):
                bm, gr, nw = cfg or table
                fn = lambda: self.qtri(src, data, scales, col0, rounding=rounding, block_m=bm, groups=gr, num_warps=nw)  # noqa: E731
                try:
                    ms = self.time_ms(fn, reps=kr)
                except Exception as e:  # a config that fails to compile must not hide the others
                    rows.append({"rounding": rounding, "block_m": bm, "groups": gr, "num_warps": nw,
                                 "error": f"{type(e).__name__}: {str(e)[:300]}"})
                    continue
                rows.append({"rounding": rounding, "block_m": bm, "groups": gr, "num_warps": nw, "table": cfg is None,
                             "ms": ms, "GBps": q_bytes / ms / 1e6, "fraction_of_copy": (q_bytes / ms) / copy_bw})
        out["configs"] = rows
        ok = [r for r in rows if "ms" in r]
        out["default"] = ok[0]
        out["best"] = max(ok, key=lambda r: r["fraction_of_copy"])
        out["goal_fraction_ge"] = 0.90
        if self.cuda:
            # back-to-back in a CUDA graph over all six taps (each into its column range of the
            # assembled buffer, 534 MB in total, >> L2), copy measured the same way on six tap pairs
            try:
                srcs = [src] + [torch.randn(m, w, device=self.dev, dtype=self.dtype) for _ in self.widths[1:]]
                dsts = [torch.empty_like(t) for t in srcs]
                gcopy = self.time_graph_ms([lambda a=a, b=b: b.copy_(a) for a, b in zip(srcs, dsts)])
                del dsts
                graph = {"copy_ms": gcopy, "copy_GBps": copy_bytes / gcopy / 1e6, "configs": []}
                for cfg in configs:
                    bm, gr, nw = cfg or table
                    try:
                        ms = self.time_graph_ms([
                            lambda t=t, c=c: self.qtri(t, data, scales, c, rounding="native", block_m=bm, groups=gr, num_warps=nw)
                            for t, c in zip(srcs, range(0, self.k, w))])
                        graph["configs"].append({"block_m": bm, "groups": gr, "num_warps": nw, "table": cfg is None, "ms": ms,
                                                 "GBps": q_bytes / ms / 1e6, "fraction_of_copy": (q_bytes / ms) / (copy_bytes / gcopy)})
                    except Exception as e:
                        graph["configs"].append({"block_m": bm, "groups": gr, "num_warps": nw, "error": f"{type(e).__name__}: {str(e)[:300]}"})
                gok = [r for r in graph["configs"] if "ms" in r]
                graph["default"] = gok[0]
                graph["best"] = max(gok, key=lambda r: r["fraction_of_copy"])
                out["graph"] = graph
                del srcs
            except Exception as e:
                out["graph"] = {"error": f"{type(e).__name__}: {e}", "traceback": traceback.format_exc()[-1500:]}
        # dequantize one projection row chunk [row_chunk, K_total] into the bf16 scratch:
        # fused Triton kernel (1 B read + 2 B written per element) vs the torch path (copy + in-place mul)
        rc = self.row_chunk
        dd = torch.randint(0, 0x7E, (rc, self.k), dtype=torch.uint8, device=self.dev)
        sd = torch.randint(100, 140, (rc, self.k // MX_BLOCK), dtype=torch.uint8, device=self.dev)
        scr = torch.empty(rc, self.k, dtype=self.dtype, device=self.dev)
        d_bytes = rc * self.k * 3 + rc * self.k // MX_BLOCK
        deq = {"rows": rc, "bytes": d_bytes, "table_config": list(dequantize_config(rc, self.k))}
        for name, fn in (("triton", lambda: self.dtri(dd, sd, scr)), ("torch", lambda: dequantize_mxfp8(dd, sd, out=scr))):
            ms = self.time_ms(fn, reps=kr)
            deq[name] = {"ms": ms, "GBps": d_bytes / ms / 1e6, "fraction_of_copy": (d_bytes / ms) / copy_bw,
                         "ms_whole_input": ms * self.m / rc}
            if self.cuda:
                try:
                    deq[name]["graph_ms"] = self.time_graph_ms([fn, fn])
                except Exception as e:
                    deq[name]["graph_error"] = f"{type(e).__name__}: {str(e)[:300]}"
        out["dequantize"] = deq
        return out

    def bitwise(self):
        out = {}
        taps = self.taps(seed=1)
        taps[0][1, 5] = float("nan")
        taps[1][2, 64] = float("inf")
        taps[2][3, :32] = 0.0
        taps[3][4, :3] = torch.tensor([2.0 ** -127, 2.0 ** -133, -(2.0 ** -130)], device=self.dev, dtype=self.dtype)
        w = self.weight()
        # reference vs Triton bytes, per tap and on the concatenation
        if self.triton_ok:
            cat = torch.cat(taps, dim=-1)
            d_ref, s_ref, _ = mxfp8_buffers(self.m, self.widths, 1, device=self.dev)
            quantize_mxfp8_into(cat, d_ref, s_ref, 0)
            for rounding in (["native", "bits"] if self.cuda else ["bits"]):
                d, s, _ = mxfp8_buffers(self.m, self.widths, 1, device=self.dev)
                self.qtri(cat, d, s, 0, rounding=rounding)
                out[f"triton_{rounding}_eq_reference"] = bool(torch.equal(d, d_ref) and torch.equal(s, s_ref))
            del cat
            # every positive finite bf16 as a block amax, random block contents below it
            bits = torch.arange(1, 0x7F80, dtype=torch.int32, device=self.dev)
            vals = (bits << 16).view(torch.float32)
            x = (torch.rand(vals.numel(), 32, device=self.dev) * 2 - 1) * vals[:, None]  # |x| <= amax
            x[:, 0] = vals
            x = x.to(torch.bfloat16)
            dr, sr = torch.empty(x.shape, dtype=torch.uint8, device=self.dev), torch.empty(x.shape[0], 1, dtype=torch.uint8, device=self.dev)
            quantize_mxfp8_into(x, dr, sr, 0)
            for rounding in (["native", "bits"] if self.cuda else ["bits"]):
                dt, st = torch.empty_like(dr), torch.empty_like(sr)
                self.qtri(x, dt, st, 0, rounding=rounding)
                out[f"all_bf16_amax_triton_{rounding}_eq_reference"] = bool(torch.equal(dt, dr) and torch.equal(st, sr))
            # fused Triton dequantizer vs the torch path, bytes of the bf16 scratch (NaN payloads too)
            d_all, s_all, _ = mxfp8_buffers(self.m, self.widths, 1, device=self.dev)
            quantize_mxfp8_into(torch.cat(taps, dim=-1), d_all, s_all, 0)
            rows = min(self.m, 512)
            ref_bf = dequantize_mxfp8(d_all[:rows], s_all[:rows], out=torch.empty(rows, self.k, dtype=self.dtype, device=self.dev))
            got_bf = self.dtri(d_all[:rows], s_all[:rows], torch.empty(rows, self.k, dtype=self.dtype, device=self.dev))
            out["triton_dequantize_eq_torch"] = bits_equal(got_bf, ref_bf)
            # every E4M3 byte under every E8M0 byte
            bd = torch.arange(256, dtype=torch.uint8, device=self.dev).repeat(256, 1)
            bs = torch.arange(256, dtype=torch.uint8, device=self.dev)[:, None].repeat(1, 8)
            out["triton_dequantize_all_bytes_eq_torch"] = bits_equal(
                self.dtri(bd, bs, torch.empty(256, 256, dtype=self.dtype, device=self.dev)),
                dequantize_mxfp8(bd, bs, out=torch.empty(256, 256, dtype=self.dtype, device=self.dev)))
            del d_all, s_all, ref_bf, got_bf
        # staged vs concat, same quantizer
        ds, ss, os_ = mxfp8_buffers(self.m, self.widths, self.n, device=self.dev, out_dtype=self.dtype)
        dc, sc, oc = mxfp8_buffers(self.m, self.widths, self.n, device=self.dev, out_dtype=self.dtype)
        acc = StagedDrafterInput(self.widths, w, ds, ss, os_, self.m, row_chunk=self.row_chunk, quantize_fn=self.quantize)
        for i, t in enumerate(taps):
            acc.add(i, t)
        ys = acc.finalize()
        yc = concat_then_quantize(taps, w, dc, sc, oc, row_chunk=self.row_chunk, quantize_fn=self.quantize)
        out["staged_eq_concat_data"] = bool(torch.equal(ds, dc))
        out["staged_eq_concat_scales"] = bool(torch.equal(ss, sc))
        out["staged_eq_concat_output"] = bits_equal(ys, yc)
        # the default (fused) projection gives the torch-dequantizer projection's bytes
        yt = project_mxfp8(dc, sc, w, torch.empty_like(yc), self.row_chunk,
                           dequantize_fn=lambda d, s_, o: dequantize_mxfp8(d, s_, out=o))
        out["default_projection_eq_torch_dequant_projection"] = bits_equal(yt, yc)
        # determinism: a second staged run
        acc.reset()
        for i, t in enumerate(taps):
            acc.add(i, t)
        out["staged_deterministic"] = bits_equal(acc.finalize(), yc)
        out["all_equal"] = all(v for v in out.values() if isinstance(v, bool))
        return out

    def _step(self, staged: bool, w: torch.Tensor, row_chunk: int):
        """One step as the engine runs it: buffers, taps produced one by one, quantize, project."""
        data, scales, out = mxfp8_buffers(self.m, self.widths, self.n, device=self.dev, out_dtype=self.dtype)
        g = torch.Generator(device=self.dev).manual_seed(5)
        if staged:
            acc = StagedDrafterInput(self.widths, w, data, scales, out, self.m, row_chunk=row_chunk,
                                     quantize_fn=self.quantize)
            for i, width in enumerate(self.widths):
                h = torch.randn(self.m, width, generator=g, device=self.dev, dtype=self.dtype)
                acc.add(i, h)
                del h
            y = acc.finalize()
        else:
            taps = [torch.randn(self.m, width, generator=g, device=self.dev, dtype=self.dtype) for width in self.widths]
            y = concat_then_quantize(taps, w, data, scales, out, row_chunk=row_chunk, quantize_fn=self.quantize)
            del taps
        return y

    def _chunks(self):
        """Row chunks the timing sweeps (and the memory section checks): the default, half and double."""
        return sorted({self.row_chunk, min(self.m, 2 * self.row_chunk), max(1, self.row_chunk // 2)})

    def _peaks(self, w, row_chunk) -> dict:
        res = {}
        for name, staged in (("concat", False), ("staged", True)):
            if self.cuda:
                torch.cuda.synchronize()
                torch.cuda.empty_cache()
                base = torch.cuda.memory_allocated()
                torch.cuda.reset_peak_memory_stats()
                y = self._step(staged, w, row_chunk)
                torch.cuda.synchronize()
                peak = torch.cuda.max_memory_allocated()
                res[name] = {"peak_allocated_bytes": peak, "step_peak_bytes": peak - base, "baseline_bytes": base}
                del y
            else:
                with torch.no_grad(), LiveTensorBytes() as mem:
                    y = self._step(staged, w, row_chunk)
                    del y
                res[name] = {"step_peak_bytes": mem.peak, "tracker": "LiveTensorBytes"}
        res["step_ratio"] = res["staged"]["step_peak_bytes"] / res["concat"]["step_peak_bytes"]
        if self.cuda:
            res["absolute_ratio"] = res["staged"]["peak_allocated_bytes"] / res["concat"]["peak_allocated_bytes"]
        return res

    def memory(self):
        w = self.weight()
        res = {"reference_staged_bytes": REF_STAGED_BYTES, "reference_concat_bytes": REF_CONCAT_BYTES,
               "reference_ratio": REF_STAGED_BYTES / REF_CONCAT_BYTES, "weight_bytes": w.numel() * w.element_size()}
        res.update(self._peaks(w, self.row_chunk))
        res["goal_step_ratio_le"] = 0.50
        res["scratch_bytes"] = self.row_chunk * self.k * 2
        # the same check at every row chunk the timing section sweeps
        res["by_row_chunk"] = {}
        for rc in self._chunks():
            p = self._peaks(w, rc)
            res["by_row_chunk"][rc] = {"staged_step_peak_bytes": p["staged"]["step_peak_bytes"],
                                       "concat_step_peak_bytes": p["concat"]["step_peak_bytes"],
                                       "step_ratio": p["step_ratio"]}
        return res

    def launch_host_us(self, tap, data, scales, n=50) -> dict:
        """Host µs per quantize launch (one slice, ``n`` back to back, host clock only): from a cached
        launch plan vs through the checks and Triton's launcher."""
        out = {}
        for name, enabled in (("plans", True), ("no_plans", False)):
            triton_launch.ENABLED = enabled
            try:
                self.quantize(tap, data, scales, 0)
                self.sync()
                t0 = time.perf_counter()
                for _ in range(n):
                    self.quantize(tap, data, scales, 0)
                out[name] = (time.perf_counter() - t0) * 1e6 / n
                self.sync()
            finally:
                triton_launch.ENABLED = True
        return out

    def sync_check(self, w, taps, ds, ss, os_, dc, sc, oc) -> dict:
        """Each path once under ``torch.cuda.set_sync_debug_mode("error")``: any host-device sync inside
        add()/finalize() or concat_then_quantize raises. CUDA only."""
        if not self.cuda:
            return {"skipped": "no CUDA device"}
        acc = StagedDrafterInput(self.widths, w, ds, ss, os_, self.m, row_chunk=self.row_chunk,
                                 quantize_fn=self.quantize, dequantize_fn=self.dequantize)
        scratch = torch.empty(self.row_chunk, self.k, device=self.dev, dtype=self.dtype)
        acc.scratch = scratch

        def staged():
            acc.reset()
            for i, t in enumerate(taps):
                acc.add(i, t)
            return acc.finalize()

        def concat():
            return concat_then_quantize(taps, w, dc, sc, oc, row_chunk=self.row_chunk, quantize_fn=self.quantize,
                                        scratch=scratch, dequantize_fn=self.dequantize)
        out = {}
        for name, fn in (("staged", staged), ("concat", concat)):
            fn()
            self.sync()
            torch.cuda.set_sync_debug_mode("error")
            try:
                fn()
                out[name] = "no host sync"
            except RuntimeError as e:
                out[name] = f"sync: {str(e)[:200]}"
            finally:
                torch.cuda.set_sync_debug_mode(0)
        self.sync()
        return out

    def timing(self):
        """Whole projection (quantize all taps + dequant + GEMM), staged vs concatenated, interleaved.

        Both paths use the same projection function (``project_mxfp8`` with this device's default
        dequantizer, same row chunk, same scratch), so the difference is the quantization part
        (per-tap kernels vs ``cat`` + one kernel)."""
        w = self.weight()
        taps = self.taps(seed=2)
        ds, ss, os_ = mxfp8_buffers(self.m, self.widths, self.n, device=self.dev, out_dtype=self.dtype)
        dc, sc, oc = mxfp8_buffers(self.m, self.widths, self.n, device=self.dev, out_dtype=self.dtype)
        res = {"projection_fn": f"project_mxfp8 + {self.dequantize_name}", "reps": self.reps,
               "method": "interleaved staged/concat, L2 flushed before each call, median (and median of paired ratios)"}
        chunks = self._chunks()
        # the stand-in for the target layers of the forward-pass timing (same GEMMs in both paths)
        gp = torch.Generator(device=self.dev).manual_seed(9)
        px = torch.randn(self.m, 1024, generator=gp, device=self.dev, dtype=self.dtype)
        pw = torch.randn(1024, self.widths[0], generator=gp, device=self.dev, dtype=self.dtype) * 0.03
        res["forward_producer"] = f"torch.mm [{self.m}, 1024] x [1024, {self.widths[0]}] before each tap"
        res["quantize_host_us_per_launch"] = self.launch_host_us(taps[0], ds, ss)
        res["host_sync_check"] = self.sync_check(w, taps, ds, ss, os_, dc, sc, oc)
        for rc in chunks:
            scratch = torch.empty(min(rc, self.m), self.k, device=self.dev, dtype=self.dtype)
            acc = StagedDrafterInput(self.widths, w, ds, ss, os_, self.m, row_chunk=rc, quantize_fn=self.quantize,
                                     scratch=scratch, dequantize_fn=self.dequantize)

            def staged():
                acc.reset()
                for i, t in enumerate(taps):
                    acc.add(i, t)
                return acc.finalize()

            def concat():
                return concat_then_quantize(taps, w, dc, sc, oc, row_chunk=rc, quantize_fn=self.quantize,
                                            scratch=scratch, dequantize_fn=self.dequantize)

            def staged_quant():
                for i, t in enumerate(taps):
                    self.quantize(t, ds, ss, acc.col_offsets[i])

            def concat_quant():
                self.quantize(torch.cat(taps, dim=-1), dc, sc, 0)

            def gemm_only():
                project_mxfp8(ds, ss, w, os_, rc, scratch, self.dequantize)

            def gemm_torch_dequant():
                project_mxfp8(ds, ss, w, os_, rc, scratch, lambda d, s_, o: dequantize_mxfp8(d, s_, out=o))

            def staged_fwd():  # each tap produced by a GEMM just before add(), as a target layer does
                acc.reset()
                for i, t in enumerate(taps):
                    torch.mm(px, pw, out=t)
                    acc.add(i, t)
                return acc.finalize()

            def concat_fwd():
                for t in taps:
                    torch.mm(px, pw, out=t)
                return concat()

            whole = self.time_interleaved_ms({"staged": staged, "concat": concat})
            quant = self.time_interleaved_ms({"staged": staged_quant, "concat": concat_quant})
            proj = self.time_interleaved_ms({"default": gemm_only, "torch_dequant": gemm_torch_dequant})
            r = {"staged_ms": whole["staged"], "concat_ms": whole["concat"],
                 "ratio_staged_over_concat": whole["staged"] / whole["concat"],
                 "paired_ratio_staged_over_concat": whole["paired_ratio_staged_over_concat"],
                 "staged_quantize_ms": quant["staged"], "concat_quantize_ms": quant["concat"],
                 "project_ms": proj["default"], "project_torch_dequant_ms": proj["torch_dequant"]}
            r["project_TFLOPs"] = 2 * self.m * self.k * self.n / (r["project_ms"] * 1e-3) / 1e12
            # the same without cached launch plans (the first H200 run's launch path), and the host's
            # enqueue time of each step both ways: the eager penalty is host time the GPU waits for
            nop = self.without_plans(lambda: self.time_interleaved_ms({"staged": staged, "concat": concat}))
            r.update(no_plans_staged_ms=nop["staged"], no_plans_concat_ms=nop["concat"],
                     no_plans_ratio_staged_over_concat=nop["staged"] / nop["concat"],
                     no_plans_paired_ratio=nop["paired_ratio_staged_over_concat"])
            host = self.host_ms({"staged": staged, "concat": concat, "staged_quantize": staged_quant})
            host_np = self.without_plans(lambda: self.host_ms({"staged": staged, "concat": concat,
                                                               "staged_quantize": staged_quant}))
            r["host_enqueue_ms"] = {"plans": host, "no_plans": host_np}
            # inside a forward: a [M, 1024] x [1024, width] GEMM writes each tap right before it is used
            fwd = self.time_interleaved_ms({"staged": staged_fwd, "concat": concat_fwd})
            r.update(forward_staged_ms=fwd["staged"], forward_concat_ms=fwd["concat"],
                     forward_ratio_staged_over_concat=fwd["staged"] / fwd["concat"],
                     forward_paired_ratio=fwd["paired_ratio_staged_over_concat"])
            if self.cuda:  # the same two steps captured in CUDA graphs: no Python launch overhead
                try:
                    gs, gc = self.time_graph_ms([staged]), self.time_graph_ms([concat])
                    r.update(graph_staged_ms=gs, graph_concat_ms=gc, graph_ratio_staged_over_concat=gs / gc)
                except Exception as e:
                    r["graph_error"] = f"{type(e).__name__}: {str(e)[:300]}"
            res[f"row_chunk_{rc}"] = r
            del scratch, acc
        # the plain bf16 GEMM on the concatenated bf16 input (no MX), for scale
        cat = torch.cat(taps, dim=-1)
        out = torch.empty(self.m, self.n, device=self.dev, dtype=self.dtype)
        res["bf16_gemm_ms"] = self.time_ms(lambda: torch.mm(cat, w.t(), out=out))
        del cat
        res["default"] = res[f"row_chunk_{self.row_chunk}"]
        res["best_row_chunk"] = min(chunks, key=lambda c: res[f"row_chunk_{c}"]["staged_ms"])
        res["goal_ratio_le"] = 1.00
        return res

    def compiled(self):
        w = self.weight()
        taps = self.taps(seed=3)
        data, scales, out = mxfp8_buffers(self.m, self.widths, self.n, device=self.dev, out_dtype=self.dtype)
        acc = StagedDrafterInput(self.widths, w, data, scales, out, self.m, row_chunk=self.row_chunk,
                                 quantize_fn=self.quantize)

        def step(*ts):
            acc.reset(ts[0].shape[0])
            for i, t in enumerate(ts):
                acc.add(i, t)
            return acc.finalize()

        backend = "aot_eager" if (self.args.smoke and not self.cuda) else "inductor"
        res = {"backend": backend, "fullgraph": True}
        quantizers = [("triton", self.qtri)] if self.triton_ok else []
        quantizers.append(("reference", quantize_mxfp8_into))
        for qname, qfn in quantizers:
            if qname == "reference" and self.triton_ok:
                if "error" not in res.get("triton", {}):
                    break
                # fallback only: the reference's row-chunk loop unrolls in the trace, so keep M small
                m_small = min(self.m, 64)
                taps = [t[:m_small].contiguous() for t in taps]
                acc.reset(m_small)
                res["reference_tokens"] = m_small
            acc.quantize_fn = qfn
            # the triton variant compiles the default projection too (fused Triton dequantizer on CUDA);
            # the reference fallback uses the torch dequantizer
            acc.dequantize_fn = self.dequantize if qname == "triton" else (lambda d, s_, o: dequantize_mxfp8(d, s_, out=o))
            res[f"{qname}_dequantizer"] = self.dequantize_name if qname == "triton" else "dequantize_mxfp8"
            try:
                eager = step(*taps).clone()
                torch._dynamo.reset()
                t0 = time.perf_counter()
                fn = torch.compile(step, fullgraph=True, backend=backend)
                got = fn(*taps).clone()
                self.sync()
                compile_s = time.perf_counter() - t0
                taps2 = [t[: taps[0].shape[0]].contiguous() for t in self.taps(seed=4)]
                got2 = fn(*taps2).clone()
                eager2 = step(*taps2).clone()
                res[qname] = {"compile_s": compile_s, "bitwise_equal_eager": bits_equal(got, eager),
                              "bitwise_equal_eager_new_inputs": bits_equal(got2, eager2)}
                if self.cuda:  # the compiled step against the eager one (cached launch plans on)
                    res[qname].update(compiled_ms=self.time_ms(lambda: fn(*taps2)), eager_ms=self.time_ms(lambda: step(*taps2)))
            except Exception as e:
                res[qname] = {"error": f"{type(e).__name__}: {str(e)[:1500]}"}
        return res

    def cuda_graph(self):
        if not self.cuda:
            return {"skipped": "no CUDA device"}
        w = self.weight()
        static_taps = self.taps(seed=6)
        data, scales, out = mxfp8_buffers(self.m, self.widths, self.n, device=self.dev, out_dtype=self.dtype)
        scratch = torch.empty(self.row_chunk, self.k, device=self.dev, dtype=self.dtype)
        acc = StagedDrafterInput(self.widths, w, data, scales, out, self.m, row_chunk=self.row_chunk,
                                 quantize_fn=self.quantize, scratch=scratch)

        def step():
            acc.reset()
            for i, t in enumerate(static_taps):
                acc.add(i, t)
            return acc.finalize()

        s = torch.cuda.Stream()
        s.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(s):
            for _ in range(2):
                step()
        torch.cuda.current_stream().wait_stream(s)
        g = torch.cuda.CUDAGraph()
        with torch.cuda.graph(g):
            y_static = step()
        res = {}
        for trial, seed in enumerate((7, 8)):
            new = self.taps(seed=seed)
            for t, n in zip(static_taps, new):
                t.copy_(n)
            g.replay()
            torch.cuda.synchronize()
            replayed = y_static.clone()
            eager = step().clone()
            res[f"replay_{trial}_bitwise_equal_eager"] = bits_equal(replayed, eager)
        res["replay_ms"] = self.time_ms(g.replay)
        res["eager_ms"] = self.time_ms(step)
        return res

    # ---- report -------------------------------------------------------------------------------------
    def markdown(self) -> str:
        r = self.res
        env = r.get("env", {})
        lines = [f"# Staged MXFP8 drafter input vs concatenate-then-quantize",
                 "",
                 f"device: {env.get('device')}; torch {env.get('torch')}; triton {env.get('triton')}; "
                 f"commit {env.get('commit')}; quantizer {env.get('quantizer')}",
                 f"command: `{env.get('command')}`",
                 f"shape: M={self.m}, taps {self.widths}, N={self.n}, bf16, row_chunk {self.row_chunk}",
                 "", "| metric | staged | concat | staged/concat | goal | reference (production) |",
                 "|---|---|---|---|---|---|"]
        mem = r.get("memory", {})
        if "staged" in mem:
            lines.append(f"| step peak bytes (above weight) | {mem['staged']['step_peak_bytes']:,} | "
                         f"{mem['concat']['step_peak_bytes']:,} | {mem['step_ratio']:.3f} | <= 0.50 | "
                         f"{REF_STAGED_BYTES:,} / {REF_CONCAT_BYTES:,} = {REF_STAGED_BYTES / REF_CONCAT_BYTES:.3f} |")
            if "absolute_ratio" in mem:
                lines.append(f"| max_memory_allocated (incl. weight) | {mem['staged']['peak_allocated_bytes']:,} | "
                             f"{mem['concat']['peak_allocated_bytes']:,} | {mem['absolute_ratio']:.3f} | | |")
        tim = r.get("timing", {})
        if "default" in tim:
            d = tim["default"]
            lines.append(f"| projection time, quantize all taps + dequant + GEMM (ms) | {d['staged_ms']:.3f} | {d['concat_ms']:.3f} | "
                         f"{d['ratio_staged_over_concat']:.3f} (paired {d['paired_ratio_staged_over_concat']:.3f}) | <= 1.00 | |")
            lines.append(f"| quantize only (ms) | {d['staged_quantize_ms']:.3f} | {d['concat_quantize_ms']:.3f} | "
                         f"{d['staged_quantize_ms'] / d['concat_quantize_ms']:.3f} | | spec: 0.175 / 0.324 |")
            lines.append(f"| dequant + GEMM (ms, TFLOP/s), both paths | {d['project_ms']:.3f} ({d['project_TFLOPs']:.0f}) | "
                         f"torch-dequant {d['project_torch_dequant_ms']:.3f}; plain bf16 GEMM {tim['bf16_gemm_ms']:.3f} | | | spec: 0.148 + 3.04 |")
            lines.append("")
            lines.append(f"projection function (both paths): `{tim.get('projection_fn')}`; {tim.get('method')}; "
                         f"{tim.get('reps')} reps")
            lines.append("")
            lines.append("| row_chunk | staged ms | concat ms | staged/concat | paired | graph staged / concat ms (ratio) "
                         "| quantize staged / concat ms | dequant+GEMM ms (torch dequant) | step peak staged/concat |")
            lines.append("|---|---|---|---|---|---|---|---|---|")
            by_rc = mem.get("by_row_chunk", {})
            for key in sorted((k for k in tim if k.startswith("row_chunk_")), key=lambda k: int(k.split("_")[-1])):
                x = tim[key]
                rc = int(key.split("_")[-1])
                gtxt = (f"{x['graph_staged_ms']:.3f} / {x['graph_concat_ms']:.3f} ({x['graph_ratio_staged_over_concat']:.3f})"
                        if "graph_staged_ms" in x else "-")
                mtxt = f"{by_rc[rc]['step_ratio']:.3f}" if rc in by_rc else "-"
                lines.append(f"| {rc} | {x['staged_ms']:.3f} | {x['concat_ms']:.3f} | {x['ratio_staged_over_concat']:.3f} | "
                             f"{x['paired_ratio_staged_over_concat']:.3f} | {gtxt} | {x['staged_quantize_ms']:.3f} / {x['concat_quantize_ms']:.3f} | "
                             f"{x['project_ms']:.3f} ({x['project_torch_dequant_ms']:.3f}) | {mtxt} |")
        rcs = sorted((k for k in tim if k.startswith("row_chunk_") and "no_plans_staged_ms" in tim[k]),
                     key=lambda k: int(k.split("_")[-1]))
        if rcs:
            lines.append("")
            lines.append("Eager launch overhead: the same steps with and without cached launch plans "
                         "(`longflash/ops/triton_launch.py`), the host's enqueue time per step, and the steps inside a "
                         f"forward ({tim.get('forward_producer')}):")
            lines.append("")
            lines.append("| row_chunk | eager staged / concat ms, plans (ratio) | no plans (ratio) | host enqueue staged / concat / "
                         "staged quantize ms, plans | no plans | forward staged / concat ms (ratio, paired) |")
            lines.append("|---|---|---|---|---|---|")
            for key in rcs:
                x = tim[key]
                hp, hn = x["host_enqueue_ms"]["plans"], x["host_enqueue_ms"]["no_plans"]
                lines.append(f"| {key.split('_')[-1]} | {x['staged_ms']:.3f} / {x['concat_ms']:.3f} ({x['ratio_staged_over_concat']:.3f}) | "
                             f"{x['no_plans_staged_ms']:.3f} / {x['no_plans_concat_ms']:.3f} ({x['no_plans_ratio_staged_over_concat']:.3f}) | "
                             f"{hp['staged']:.3f} / {hp['concat']:.3f} / {hp['staged_quantize']:.3f} | "
                             f"{hn['staged']:.3f} / {hn['concat']:.3f} / {hn['staged_quantize']:.3f} | "
                             f"{x['forward_staged_ms']:.3f} / {x['forward_concat_ms']:.3f} ({x['forward_ratio_staged_over_concat']:.3f}, "
                             f"{x['forward_paired_ratio']:.3f}) |")
            hu = tim.get("quantize_host_us_per_launch", {})
            if hu:
                lines.append("")
                lines.append(f"host µs per quantize launch (50 back to back): plan {hu.get('plans', float('nan')):.1f}, "
                             f"checks + Triton launcher {hu.get('no_plans', float('nan')):.1f}; "
                             f"host sync check (`set_sync_debug_mode('error')`): {tim.get('host_sync_check')}")
        bw = r.get("bandwidth", {})
        if "copy_GBps" in bw:
            lines.append("")
            lines.append(f"copy bandwidth (same run): {bw['copy_GBps']:.0f} GB/s ({bw['copy_bytes']:,} B in {bw['copy_ms'] * 1e3:.1f} µs)")
            lines.append("")
            lines.append("| quantizer (one slice) | µs | GB/s | fraction of copy BW (goal >= 0.90) |")
            lines.append("|---|---|---|---|")
            for row in bw.get("configs", []):
                tag = " (table default)" if row.get("table") else ""
                if "error" in row:
                    lines.append(f"| {row['rounding']} BLOCK_M={row['block_m']} GROUPS={row['groups']} warps={row['num_warps']} | "
                                 f"error: {row['error'][:120]} | | |")
                    continue
                lines.append(f"| {row['rounding']} BLOCK_M={row['block_m']} GROUPS={row['groups']} warps={row['num_warps']}{tag} | "
                             f"{row['ms'] * 1e3:.1f} | {row['GBps']:.0f} | {row['fraction_of_copy']:.3f} |")
            gr = bw.get("graph")
            if gr and "configs" in gr:
                lines.append("")
                lines.append(f"back-to-back in a CUDA graph (all six taps into the assembled buffer; copy the same way): "
                             f"copy {gr['copy_GBps']:.0f} GB/s ({gr['copy_ms'] * 1e3:.1f} µs per slice)")
                lines.append("")
                lines.append("| quantizer (per slice, graph) | µs | GB/s | fraction of copy BW (goal >= 0.90) |")
                lines.append("|---|---|---|---|")
                for row in gr["configs"]:
                    if "error" in row:
                        lines.append(f"| BLOCK_M={row['block_m']} GROUPS={row['groups']} warps={row['num_warps']} | error: {row['error'][:120]} | | |")
                        continue
                    tag = " (table default)" if row.get("table") else ""
                    lines.append(f"| native BLOCK_M={row['block_m']} GROUPS={row['groups']} warps={row['num_warps']}{tag} | "
                                 f"{row['ms'] * 1e3:.1f} | {row['GBps']:.0f} | {row['fraction_of_copy']:.3f} |")
            elif gr:
                lines.append(f"graph timing error: {gr.get('error')}")
            deq = bw.get("dequantize")
            if deq:
                lines.append("")
                lines.append(f"| dequantize one row chunk ({deq['rows']} x {self.k}) into bf16 scratch | µs | GB/s (3 B/elem) | fraction of copy BW | whole input (µs) |")
                lines.append("|---|---|---|---|---|")
                for name in ("triton", "torch"):
                    x = deq[name]
                    lines.append(f"| {name}{' (fused, table ' + str(deq['table_config']) + ')' if name == 'triton' else ' (copy + mul_)'} | "
                                 f"{x['ms'] * 1e3:.1f}{(' (graph %.1f)' % (x['graph_ms'] * 1e3)) if 'graph_ms' in x else ''} | "
                                 f"{x['GBps']:.0f} | {x['fraction_of_copy']:.3f} | {x['ms_whole_input'] * 1e3:.0f} (spec: 148) |")
            if "reference" in bw:
                ref = bw["reference"]
                lines.append(f"| reference (torch) | {ref['ms'] * 1e3:.1f} | {ref['GBps']:.1f} | {ref['fraction_of_copy']:.3f} |")
        lines.append("")
        for name in ("bitwise", "compiled", "cuda_graph"):
            if name in r:
                lines.append(f"- **{name}**: " + ", ".join(f"{k}={v}" for k, v in r[name].items() if k != "traceback"))
        return "\n".join(lines) + "\n"

    def run(self):
        self.section("env", self.env)
        self.section("bitwise", self.bitwise)
        self.section("memory", self.memory)
        self.section("bandwidth", self.bandwidth)
        self.section("timing", self.timing)
        self.section("cuda_graph", self.cuda_graph)
        if not self.args.no_compile:
            self.section("compiled", self.compiled)
        print(self.markdown())


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter,
                                allow_abbrev=False)
    p.add_argument("--out", required=True, help="output directory for mxfp8_staged.json / .md")
    p.add_argument("--smoke", action="store_true", help="tiny shape (M=64, 6 x 256, N=256); runs on the CPU")
    p.add_argument("--cpu", action="store_true", help="force the CPU even if CUDA is available")
    p.add_argument("--tokens", type=int, default=4096)
    p.add_argument("--taps", type=int, default=6)
    p.add_argument("--width", type=int, default=7168)
    p.add_argument("--row-chunk", type=int, default=DEFAULT_ROW_CHUNK)
    p.add_argument("--reps", type=int, default=30, help="reps of each whole-projection timing (interleaved)")
    p.add_argument("--kernel-reps", type=int, default=100, help="reps of each single-kernel timing")
    p.add_argument("--no-compile", action="store_true", help="skip the torch.compile section")
    args = p.parse_args(argv)
    torch.manual_seed(0)
    with torch.no_grad():
        Bench(args).run()


if __name__ == "__main__":
    main()
