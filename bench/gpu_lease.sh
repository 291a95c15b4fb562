#!/usr/bin/env bash
# Everything this project checks on a CUDA machine, in one command that fits a short lease (under 10 minutes on an
# H200, TOTAL_S): the GPU tests (tests/test_gpu.py: every axis value off SDPA's math kernel and equal to the CPU, no
# synchronizing call between logging steps, TF32 recorded, a killed run resumed exactly), the throughput benchmark
# against Hugging Face at the issue's sizes (5M, 20M; 110M does not fit the lease beside the rest), a
# two-trial `study sweep` (its worker hands the trials their GPU; Tiny Shakespeare), and the Multi30k recipe under
# the training budget the remaining time allows (at most M30_BUDGET_S seconds: the recipe's own 25 minutes are far
# more than a GPU needs for its ~4,300 CPU steps). Results and one log go to $OUT (default bench/results/gpu-<date>/).
#
#   DATA=../shared/data bash bench/gpu_lease.sh
#
# STAGES picks a part of it for a shorter lease (default all four: "tests throughput sweep multi30k").
# DATA must hold multi30k/ and tinyshakespeare/. Where optuna is not installed, WHEELS names a folder of its wheels
# (installed under /tmp for the sweep only). Each stage has its own time limit, so a slow stage costs its own numbers.
set -u
cd "$(dirname "$0")/.."
OUT=${OUT:-bench/results/gpu-$(date +%F)}
mkdir -p "$OUT"
PY=${PYTHON:-python3}
DATA=${DATA:-../shared/data}
TOTAL_S=${TOTAL_S:-560}
M30_BUDGET_S=${M30_BUDGET_S:-150}
STAGES=" ${STAGES:-tests throughput sweep multi30k} "
want() { [[ "$STAGES" == *" $1 "* ]]; }
export PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1 HF_DATASETS_OFFLINE=1 STUDY_GPU_RECORD="$OUT"

sweep() {  # a two-point sweep through a real worker; $1: the launcher
  local dir=/tmp/gpu-sweep-$1
  mkdir -p "$dir"
  cat > "$dir/spec.yaml" <<EOF
name: gpu-sweep-smoke
base: $PWD/experiments/shakespeare_char_gpt2.yaml
set: {train.max_steps: 200, train.eval_every: 100, train.eval_batches: 4, train.progress_bar: false}
design: grid
axes:
  model.norm: [layernorm, rmsnorm]
seeds: [0]
objective: {metric: valid_loss}
workers: 1
EOF
  PYTHONPATH="$PWD:/tmp/site" timeout 100 $PY -m study.cli sweep "$dir/spec.yaml" --data-dir "$DATA" \
    --results "$dir/results" --launcher "$1" && cp "$dir/results/gpu-sweep-smoke/results.csv" "$OUT/sweep-results.csv" \
    && cp "$(find "$dir/results/runs" -name env.json | head -1)" "$OUT/sweep-trial-env.json"
}

{
  nvidia-smi --query-gpu=name,memory.total,driver_version,clocks.max.sm --format=csv
  $PY -c "import torch, lightning, transformers, tokenizers, sacrebleu; print('torch', torch.__version__, 'cuda', \
torch.version.cuda, 'lightning', lightning.__version__, 'transformers', transformers.__version__)"
  if want tests; then
    echo "== tests/test_gpu.py [${SECONDS}s]"
    timeout 200 $PY -m pytest -q -p no:cacheprovider -rfE tests/test_gpu.py
  fi
  if want throughput; then
    echo "== bench/throughput.py --device cuda [${SECONDS}s]"
    timeout 180 $PY bench/throughput.py --device cuda --sizes 5M,20M --out "$OUT/throughput.json"
  fi
  if want sweep; then
    echo "== study sweep, 2 trials [${SECONDS}s]"
    if [ -n "${WHEELS:-}" ]; then
      $PY -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target /tmp/site "$WHEELS"/*.whl
    fi
    sweep fork || { echo "== the forking launcher failed; spawn [${SECONDS}s]"; sweep spawn; } \
      || cp "$(find /tmp/gpu-sweep-*/results/runs -name trial.log | head -1)" "$OUT/sweep-trial.log"
  fi
  want multi30k || { echo "== done [${SECONDS}s]"; exit 0; }
  left=$((TOTAL_S - SECONDS))
  budget=$((left - 100 < M30_BUDGET_S ? left - 100 : M30_BUDGET_S))
  echo "== Multi30k recipe, ${budget} s training budget [${SECONDS}s]"
  if [ "$budget" -ge 30 ]; then
    timeout $((budget + 95)) $PY bench/record_run.py experiments/multi30k_de_en.yaml --data-dir "$DATA" \
      --label multi30k-de-en-gpu --set train.progress_bar=false --set train.num_workers=2 \
      --set train.max_time_s="$budget" --set "task.test_sets=[test_2016_flickr]" \
      && cp bench/results/run-multi30k-de-en-gpu.json "$OUT/"
  fi
  echo "== done [${SECONDS}s]"
} 2>&1 | tee "$OUT/lease-log.txt"  # the name the committed leases (bench/results/gpu-*) use
