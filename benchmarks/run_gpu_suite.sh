#!/usr/bin/env bash
# One device call for all GPU benchmarks; results land in $OUT/results.tar.gz (+ suite.log).
# Usage on the device machine: bash benchmarks/run_gpu_suite.sh
set -u
export PYTHONUNBUFFERED=1 PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH}
R=$OUT/results; mkdir -p "$R"
{
  echo "commit $(git rev-parse HEAD 2>/dev/null || echo unknown)"; nvidia-smi --query-gpu=name,driver_version --format=csv,noheader
  python3 -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__)"
} > "$R/device.txt" 2>&1
run() { name=$1; shift; echo "=== $name: $*"; start=$(date +%s); timeout "$@" > "$R/$name.log" 2>&1; rc=$?; echo "=== $name rc=$rc $(( $(date +%s) - start ))s"; tail -n 25 "$R/$name.log"; }
run kv_cache_ops 110 python3 benchmarks/kv_cache_ops.py --out "$R"
run mxfp8_staged 120 python3 benchmarks/mxfp8_staged.py --out "$R"
run attn_res_harness 110 python3 benchmarks/attn_res_harness.py --out "$R"
run mxfp4_moe 110 python3 benchmarks/mxfp4_moe.py --out "$R" --no-sweep
run generate_cuda 60 python3 -m longflash.entrypoints.cli generate --prompt "def fibonacci(n):" --max-tokens 32
cp "$R"/*.log "$R"/device.txt "$OUT/" 2>/dev/null
tar czf "$OUT/results.tar.gz" -C "$OUT" results
rm -rf "$R"; ls -la "$OUT"
