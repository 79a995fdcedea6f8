#!/usr/bin/env bash
# The device calls still missing for issue #11 (TP / DCP on 2 and 4 GPUs), one CALL per device call
# (each under 560 s, 10-minute cap); results in $OUT/results.tar.gz, refreshed after every step, + a log
# per step. Usage on the device machine, from the repository root:
#   CALL=x2a bash benchmarks/run_multi_gpu.sh
# Write the commit into COMMIT before the call (`git rev-parse HEAD > COMMIT`): a copied tree without
# .git, or a `git archive` copy inside another checkout, would record the wrong one (multi_gpu.py and
# multi_gpu_speed.py read COMMIT). x2a/x2b need 2 GPUs (on a 4-GPU machine tp 2 takes GPUs 0-1), x4a-x4e 4.
#
# Seconds estimated from the 2-GPU runs (results/multi_gpu_x2: engine start 10-40 s, the 3.3B fp32
# engines 32-42 s each, a 64 x 8K prefill 14-22 s, 64 x 32K 191 s on one GPU; tp 4 assumed as tp 2).
# Each python step skips its own units past its --budget-s (recorded, its JSON rewritten after every
# unit); its timeout = that budget + 25-40 s, cut to what is left of BUDGET_S (555 s from the start).
#
# call step (log, out dir)  what                                                       expected s  timeout
# x2a  mla_fp32q_tests      tests/test_triton_mla_decode.py -k fp32_queries (fix 5645b81)       40        80
#      dcp_nccl_gpu_tests   tests/test_dcp_nccl_gpu.py (the killed-worker message, d1fdb4c)     90       130
#      dcp_combine_tests    test_dcp_combine_triton.py -k gpu_real_shapes (one-launch LSE 20        50
#                           combine of 5dc4328, which every DCP run below uses)
#      multi_gpu_x2a        multi_gpu.py --world 2 --dcps 2: dsv3 (tp1 refs, tp2/dcp2 bf16,    285       330
#                           fp32 and fp8 + chunked context: the tp1 fp8 engine failed before
#                           5645b81), capacity (longest prompt dcp 1 + 2, default sizing)
#                                                                      x2a total ~435 (cap 555)  590
# x2b  multi_gpu_speed_x2   speed of tp1 / tp2 dcp1 / tp2 dcp2 at batch 1 x 32K + 64 x 8K, one   150       200
#                           run after the step-channel changes (d1fdb4c, 407adf0)
#      step_channel         step_channel.py: the same-host link on this machine's CPUs          10        45
#      multi_gpu_passkey_x2 passkey -tp 2 -dcp 2 prefix on + off, tp1 reference (on + off)     120       160
#      nccl_smoke_x2        default model tp2/dcp2 vs one GPU, DFlash, killed worker, after     100       130
#                           407adf0 (uniform steps and draft mirrors over the shared-memory link)
#                                                                               x2b total ~380       535
# x4a  mla_fp32q_tests, dcp_combine_tests as in x2a (one GPU each)                          60       130
#      nccl_smoke_x4        default model tp4/dcp4, tp4/dcp1, tp4/dcp2 vs one GPU (bf16, fp32   200       240
#                           logits, 128 fp32 greedy tokens); DFlash, killed worker (tp 2) if left
#      multi_gpu_passkey_x4 passkey -tp 4 -dcp 4 --kv-cache-dtype fp8, prefix on + off, tp1    120       150
#      multi_gpu_fp8_x4     multi_gpu.py --world 4 default_fp8_chunked (tp4/dcp1,2,4)           120       155
#                                                                               x4a total ~500       555
# x4b  multi_gpu_dsv3_x4    multi_gpu.py --world 4 dsv3: tp1 refs, tp4/dcp4 bf16 + fp32 + fp8   370       540
#                           chunked, then tp4/dcp2 and tp4/dcp1 bf16 + fp32 (dcp 1 skipped first)
# x4c  multi_gpu_speed_x4   speed of tp4 dcp1 / dcp2 / dcp4 at batch 1 and 64, both x 32K (the  300       330
#                           issue's ratios; tp1 at 64 x 32K alone took 191 s of prefill: left out)
#      multi_gpu_cap_x4     multi_gpu.py --world 4 capacity: longest prompt at dcp 1, 4, 2      240       300
#                           (262K tokens at dcp 4); DSV3 KV tokens per GPU at 8 GiB, bf16 + fp8
#                                                                               x4c total ~540       555
# x4d  multi_gpu_dsv3_fp8_x4 DSV3 fp8 cache + chunked context at tp4/dcp4 (fp32; its tp1 fp32 +  260       300
#                           fp8 references); the fp32 -tp 4 engine also shows whether its graphs
#                           are now captured (258092f; the log says "capture failed" if not)
#      multi_gpu_speed_x4_b64  batch 64 x 32K at tp4 dcp1 and dcp4 (ratio in one run)          210       240
# x4e  nccl_smoke_x4e       default model tp4/dcp2 vs one GPU; DFlash tp2/dcp2; killed worker   150       170
#      dcp_nccl_gpu_tests   tests/test_dcp_nccl_gpu.py (2 GPUs)                                  90       130
#      multi_gpu_dsv3_fp8_x2  DSV3 fp8 + chunked at tp2/dcp2 (the run that found the fp32-query  200       240
#                           kernel bug at stop 18)
# x2c  (2 GPUs: x4e's runs while no 4-GPU kind is lent)                                   
#      nccl_smoke_x2c       default model tp2/dcp2 vs one GPU; DFlash tp2/dcp2; killed worker   110       130
#      dcp_nccl_gpu_tests   tests/test_dcp_nccl_gpu.py                                           90       130
#      multi_gpu_dsv3_fp8_x2  as in x4e                                                         200       240
#      attn_res_two_phase   benchmarks/attn_res_two_phase.py + its GPU tests (one GPU, #10)       90       120
# x2d  multi_gpu_dsv3_fp8_x2d DSV3 fp8 + chunked at tp2/dcp2 and tp2/dcp1 with the one-GPU bf16     300       330
#                           engine on the same prompt (the fp8 bound's bf16 tolerance, 90dd298)
#      nccl_smoke_x2d       as x2c, budget for DFlash tp2/dcp2 and the killed worker             180       210
# x2e  nccl_smoke_x2e        default model tp2/dcp2 vs one GPU after session 21's model changes   110       130
#      multi_gpu_dsv3_x2e   DSV3 bf16 + fp32 at tp2/dcp2 vs one GPU (the carried residual stream,  200       240
#                           q_a + kv_a in one GEMM, the one-launch MoE combine under NCCL)
# Done at 6ec782b (results/multi_gpu_x4): x4a, x4b, x4c. Left: x4d, then x4e (x2a / x2b run on 4 GPUs too).
set -u
CALL=${CALL:?set CALL to x2a .. x2e or x4a .. x4e}
BUDGET_S=${BUDGET_S:-555}; T0=${T0:-$(date +%s)}
export PYTHONUNBUFFERED=1 PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH}
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
R=$OUT/results; mkdir -p "$R"
{
  echo "call $CALL commit $(cat COMMIT 2>/dev/null || git rev-parse HEAD 2>/dev/null || echo unknown)"
  nvidia-smi --query-gpu=name,driver_version --format=csv,noheader; nvidia-smi topo -m
  python3 -c "import torch; print('torch', torch.__version__, torch.cuda.device_count(), torch.cuda.nccl.version())"
} > "$R/device.txt" 2>&1
run() {   # run NAME TIMEOUT_S CMD...: the timeout cut to what is left of BUDGET_S; skipped under 60 s left
  name=$1; t=$2; shift 2
  left=$(( BUDGET_S - $(date +%s) + T0 ))
  if [ "$left" -lt 60 ]; then echo "=== $name skipped (budget: $left s left)"; return; fi
  [ "$t" -gt "$left" ] && t=$left
  echo "=== $name (timeout $t s): $*"; start=$(date +%s)
  timeout -k 10 "$t" "$@" > "$R/$name.log" 2>&1; rc=$?
  echo "=== $name rc=$rc $(( $(date +%s) - start ))s"; tail -n 25 "$R/$name.log"
  tar czf "$OUT/results.tar.gz" -C "$OUT" results  # refreshed after every step: a later timeout loses nothing
}
MG="python3 benchmarks/multi_gpu.py"
SPEED="python3 benchmarks/multi_gpu_speed.py"
SMOKE="python3 benchmarks/nccl_smoke.py"
PYTEST="python3 -m pytest -q -p no:cacheprovider"
case $CALL in
  x2a)
    run mla_fp32q_tests 80 $PYTEST tests/test_triton_mla_decode.py -k fp32_queries
    run dcp_nccl_gpu_tests 130 $PYTEST tests/test_dcp_nccl_gpu.py
    run dcp_combine_tests 50 $PYTEST tests/test_dcp_combine_triton.py -k gpu_real_shapes
    run multi_gpu_x2a 330 $MG --out "$R/multi_gpu_x2a" --world 2 --dcps 2 --sections dsv3,capacity --budget-s 300 ;;
  x2b)
    run multi_gpu_speed_x2 200 $SPEED --out "$R/multi_gpu_speed_x2" --configs 1x1,2x1,2x2 --batches 1,64:8192 \
      --budget-s 170
    run step_channel 45 python3 benchmarks/step_channel.py --out "$R/step_channel"
    run multi_gpu_passkey_x2 160 $MG --out "$R/multi_gpu_passkey_x2" --world 2 --sections passkey --budget-s 135
    run nccl_smoke_x2 130 $SMOKE --out "$R/nccl_smoke_x2" --configs 2x2 --budget-s 110 ;;
  x4a)
    run mla_fp32q_tests 80 $PYTEST tests/test_triton_mla_decode.py -k fp32_queries
    run dcp_combine_tests 50 $PYTEST tests/test_dcp_combine_triton.py -k gpu_real_shapes
    run nccl_smoke_x4 240 $SMOKE --out "$R/nccl_smoke_x4" --configs 4x4,4x1,4x2 --budget-s 200
    run multi_gpu_passkey_x4 150 $MG --out "$R/multi_gpu_passkey_x4" --world 4 --sections passkey --budget-s 125
    run multi_gpu_fp8_x4 155 $MG --out "$R/multi_gpu_fp8_x4" --world 4 --sections default_fp8_chunked --budget-s 130 ;;
  x4b)
    run multi_gpu_dsv3_x4 540 $MG --out "$R/multi_gpu_dsv3_x4" --world 4 --sections dsv3 --budget-s 500 ;;
  x4c)
    run multi_gpu_speed_x4 330 $SPEED --out "$R/multi_gpu_speed_x4" --configs 4x1,4x2,4x4 --batches 1,64 \
      --budget-s 300
    run multi_gpu_cap_x4 300 $MG --out "$R/multi_gpu_cap_x4" --world 4 --sections capacity --budget-s 275 ;;
  x4d)
    run multi_gpu_dsv3_fp8_x4 300 $MG --out "$R/multi_gpu_dsv3_fp8_x4" --world 4 --dcps 4 --sections dsv3 \
      --dsv3-kinds fp8 --budget-s 270
    run multi_gpu_speed_x4_b64 240 $SPEED --out "$R/multi_gpu_speed_x4_b64" --configs 4x1,4x4 --batches 64 \
      --budget-s 230 ;;
  x4e)
    run nccl_smoke_x4e 170 $SMOKE --out "$R/nccl_smoke_x4e" --configs 4x2 --budget-s 150
    run dcp_nccl_gpu_tests 130 $PYTEST tests/test_dcp_nccl_gpu.py
    run multi_gpu_dsv3_fp8_x2 240 $MG --out "$R/multi_gpu_dsv3_fp8_x2" --world 2 --dcps 2 --sections dsv3 \
      --dsv3-kinds fp8 --budget-s 220 ;;
  x2e)  # session 21's model changes under NCCL (residual carried into the norms, q_a + kv_a GEMM, MoE combine)
    run nccl_smoke_x2e 130 $SMOKE --out "$R/nccl_smoke_x2e" --configs 2x2 --budget-s 110
    run multi_gpu_dsv3_x2e 240 $MG --out "$R/multi_gpu_dsv3_x2e" --world 2 --dcps 2 --sections dsv3 \
      --dsv3-kinds bf16,fp32 --budget-s 215 ;;
  x2c)
    run nccl_smoke_x2c 130 $SMOKE --out "$R/nccl_smoke_x2c" --configs 2x2 --budget-s 110
    run dcp_nccl_gpu_tests 130 $PYTEST tests/test_dcp_nccl_gpu.py
    run multi_gpu_dsv3_fp8_x2 240 $MG --out "$R/multi_gpu_dsv3_fp8_x2" --world 2 --dcps 2 --sections dsv3 \
      --dsv3-kinds fp8 --budget-s 220
    run attn_res_two_phase 80 python3 benchmarks/attn_res_two_phase.py --out "$R"
    run attn_res_two_phase_tests 40 $PYTEST tests/test_attn_res_two_phase.py -k gpu ;;
  x2d)
    run multi_gpu_dsv3_fp8_x2d 330 $MG --out "$R/multi_gpu_dsv3_fp8_x2d" --world 2 --dcps 2,1 --sections dsv3 \
      --dsv3-kinds fp8 --budget-s 310
    run nccl_smoke_x2d 210 $SMOKE --out "$R/nccl_smoke_x2d" --configs 2x2 --budget-s 190 ;;
  *) echo "unknown CALL=$CALL (x2a .. x2d, x4a .. x4e)"; exit 2 ;;
esac
cp "$R"/device.txt "$OUT/" 2>/dev/null
rm -rf "$R"; ls -la "$OUT"
