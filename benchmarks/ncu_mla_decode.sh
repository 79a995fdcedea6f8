#!/usr/bin/env bash
# Nsight Compute profiles of the MLA decode kernel's stage 1 at B 16 x 32K (issue 10, benchmark 5):
# fp8 default (V reload, fp16 dots), fp8 version 3 (convert once), bf16 default (CASES="dtype:config ..."
# overrides; BATCH / CTX override the shape). One device call:
#   bash benchmarks/ncu_mla_decode.sh        (writes $OUT/ncu/*.ncu-rep, *.details.txt, *.source.csv)
# --clock-control none: the device README asks to leave the clocks alone.
set -u
NCU=$(command -v ncu || ls /opt/nvidia/nsight-compute/*/ncu 2>/dev/null | head -1)
D=$OUT/ncu; mkdir -p "$D"
export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH}
CASES=${CASES:-"fp8:default fp8:cvt bf16:default"}
for case in $CASES; do
  set -- ${case/:/ }; name=${1}_$2_b${BATCH:-16}_c${CTX:-32768}
  timeout 150 "$NCU" --clock-control none --set full --import-source no -k regex:stage1 \
    --launch-skip 2 --launch-count 1 -f -o "$D/$name" \
    python3 benchmarks/ncu_mla_decode.py --dtype "$1" --config "$2" --batch "${BATCH:-16}" --ctx "${CTX:-32768}" > "$D/$name.log" 2>&1
  echo "=== $name rc=$?"; tail -3 "$D/$name.log"
  "$NCU" -i "$D/$name.ncu-rep" --page details > "$D/$name.details.txt" 2>&1
  "$NCU" -i "$D/$name.ncu-rep" --page source --csv --print-source sass > "$D/$name.source.csv" 2>&1
  grep -E "Duration|Memory Throughput|DRAM Throughput|Compute \(SM\) Throughput|Issue Slots Busy|Achieved Occupancy|No Eligible|Registers Per" "$D/$name.details.txt" | head -12
done
