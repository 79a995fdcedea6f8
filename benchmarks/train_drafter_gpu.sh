#!/usr/bin/env bash
# Train the default model's DFlash drafter in ONE device call (one H200, <= 540 s including model load).
#   on the device, from the repo root, with .data/ carried (python -m longflash.training.data builds it):
#     bash benchmarks/train_drafter_gpu.sh
#   reuse an earlier run's regenerated tokens instead of regenerating (then .data/ is not needed):
#     bash benchmarks/train_drafter_gpu.sh --regen-from DIR/regen
#   CPU check of every stage at tiny sizes:  bash benchmarks/train_drafter_gpu.sh --smoke
# Writes $OUT/dflash/ (8 files, the most a device call brings back): drafter/{config.json,model.safetensors},
# dflash_train_report.json, train_dflash.log, regen/{code_train.npz,prose_train.npz,val.npz,meta.json}.
# Extra arguments go to python -m longflash.training.train_dflash (e.g. --layers 3 --time-budget-s 300).
set -euo pipefail
export PYTHONUNBUFFERED=1 PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH}
D=${OUT:-/tmp/longflash_out}/dflash
mkdir -p "$D"
python3 -c "import torch; print('torch', torch.__version__, 'cuda', torch.cuda.is_available() and torch.cuda.get_device_name(0))"
# --time-budget-s is the python run's own wall budget (after imports); the timeout is a hard stop.
timeout 560 python3 -m longflash.training.train_dflash --target longflash/default_model --data .data --out "$D" \
  --time-budget-s 480 "$@"
ls -la "$D" "$D/drafter" "$D/regen" 2>/dev/null || true
