#!/usr/bin/env bash
# One device call for all GPU benchmarks; results land in $OUT/results.tar.gz (+ suite.log).
# Usage on the device machine: bash benchmarks/run_gpu_suite.sh
#   ONLY="kda mxfp4_moe" runs just those steps; BUDGET_S=570 skips a step whose timeout would end past
#   the budget (counted from the suite's start), so one device call (10 min max) always returns.
set -u
ONLY=${ONLY:-}; BUDGET_S=${BUDGET_S:-100000}; T0=${T0:-$(date +%s)}  # export T0 to share one budget across calls
export PYTHONUNBUFFERED=1 PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH}
R=$OUT/results; mkdir -p "$R"
{
  echo "commit $(git rev-parse HEAD 2>/dev/null || echo unknown)"; nvidia-smi --query-gpu=name,driver_version --format=csv,noheader
  python3 -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__)"
} > "$R/device.txt" 2>&1
run() {
  name=$1; shift
  if [ -n "$ONLY" ] && [[ " $ONLY " != *" $name "* ]]; then return; fi
  if [ $(( $(date +%s) - T0 + $1 )) -gt "$BUDGET_S" ]; then echo "=== $name skipped (budget)"; return; fi
  echo "=== $name: $*"; start=$(date +%s)
  timeout "$@" > "$R/$name.log" 2>&1; rc=$?
  echo "=== $name rc=$rc $(( $(date +%s) - start ))s"; tail -n 25 "$R/$name.log"
  tar czf "$OUT/results.tar.gz" -C "$OUT" results  # refreshed after every step: a later timeout loses nothing
}
run kv_cache_ops 90 python3 benchmarks/kv_cache_ops.py --out "$R"
run mla_decode 150 python3 benchmarks/mla_decode.py --out "$R"
run mla_decode_tests 90 python3 -m pytest -q -p no:cacheprovider tests/test_triton_mla_decode.py
run dflash_attention 70 python3 benchmarks/dflash_attention.py --out "$R" --budget-s 45
run dflash_attention_tests 50 python3 -m pytest -q -p no:cacheprovider tests/test_dflash_attention.py -k "gpu and not sm90"
run mxfp8_staged 120 python3 benchmarks/mxfp8_staged.py --out "$R"
run mxfp4_moe 120 python3 benchmarks/mxfp4_moe.py --out "$R"
run attn_res_harness 100 python3 benchmarks/attn_res_harness.py --out "$R"
run attn_res_kernel 70 python3 benchmarks/attn_res_kernel.py --out "$R"
run attn_res_kernel_tests 50 python3 -m pytest -q -p no:cacheprovider tests/test_attn_res_triton.py -k "(gpu or graph) and not sm90"
run attn_res_two_phase 80 python3 benchmarks/attn_res_two_phase.py --out "$R"
run attn_res_two_phase_tests 40 python3 -m pytest -q -p no:cacheprovider tests/test_attn_res_two_phase.py -k gpu
run moe_routing 90 python3 benchmarks/moe_routing.py --out "$R"
run moe_router_gpu_tests 90 python3 -m pytest -q -p no:cacheprovider tests/test_moe_router_triton.py -k "gpu and not sm90"
run fused_elementwise 70 python3 benchmarks/fused_elementwise.py --out "$R"
run fused_elementwise_tests 50 python3 -m pytest -q -p no:cacheprovider tests/test_rotary_triton.py tests/test_activation_triton.py -k "(gpu or graph) and not sm90"
run kda 160 python3 benchmarks/kda.py --out "$R"
# gpu_tests: the CPU-only interpreter and sm_90-compile tests of these files are left to the CPU suite
run gpu_tests 150 python3 -m pytest -q -p no:cacheprovider tests/test_mxfp4_triton.py tests/test_mxfp8.py tests/test_fp8_kv_ops.py tests/test_kda_triton.py tests/test_kda_chunked_triton.py -k "not interpreter and not sm90"
run cuda_graph_tests 200 python3 -m pytest -q -p no:cacheprovider tests/test_cuda_graphs.py tests/test_moe_grouped.py tests/test_norm_triton.py tests/test_gemv_triton.py -k "(graph or gpu or sync) and not interpreter and not sm90"
run gluon_decode_tests 200 python3 -m pytest -q -p no:cacheprovider tests/test_gluon_mla_decode.py tests/test_gluon_mla_decode_wgmma.py tests/test_grid_sync.py -k gpu
run mla_decode_ab 100 python3 benchmarks/mla_decode_ab.py --out "$R" --configs '{}' '{"WGMMA": false}' --shapes 16x32768 16x131072 64x32768 64x131072
run mla_decode_fp8 150 python3 benchmarks/mla_decode.py --out "$R" --only fp8:1 fp8:8
run mla_decode_copy_ceiling 90 python3 benchmarks/mla_decode_copy_ceiling.py --out "$R"
run moe_decode 120 python3 benchmarks/moe_decode.py --out "$R"
run moe_decode_tests 120 python3 -m pytest -q -p no:cacheprovider tests/test_moe_decode_triton.py tests/test_moe_router_triton.py -k "gpu or cuda"
run gemv 100 python3 benchmarks/gemv.py --out "$R" --budget-s 60
run launch_floor 60 python3 benchmarks/launch_floor.py --out "$R"
run penalties_gpu_tests 120 python3 -m pytest -q -p no:cacheprovider tests/test_penalties.py -k gpu
run e2e_decode 300 python3 benchmarks/e2e_decode.py --out "$R" --budget-s 280 --baselines cublas moe-launches --repeat-default
run long_context 210 python3 benchmarks/long_context.py --out "$R"
run long_decode 300 python3 benchmarks/long_decode.py --out "$R"
run dflash_bench_code 90 python3 -m longflash.entrypoints.cli bench latency --compare-spec --batch-size 1 16 --input-len 64 --output-len 128 --prompt-kind code --max-num-seqs 16 --kv-cache-memory 8GiB --output-json "$R/dflash_bench_code.json"
run dflash_bench_prose 90 python3 -m longflash.entrypoints.cli bench latency --compare-spec --batch-size 1 16 --input-len 64 --output-len 128 --prompt-kind prose --max-num-seqs 16 --kv-cache-memory 8GiB --output-json "$R/dflash_bench_prose.json"
run bench_serve 120 python3 -m longflash.entrypoints.cli bench serve --num-prompts 64 --max-concurrency 16 --input-len 64 --output-len 128 --prompt-kind code --max-num-seqs 16 --kv-cache-memory 8GiB --output-json "$R/bench_serve.json"
cp "$R"/device.txt "$OUT/" 2>/dev/null
rm -rf "$R"; ls -la "$OUT"
