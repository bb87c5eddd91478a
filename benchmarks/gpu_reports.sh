#!/usr/bin/env bash
# One H200 run (device tool): the GPU tests, then issue 12's offline-throughput and prefill reports
# on the Qwen3.5-35B-A3B text shape (all 40 layers, bf16, dummy weights).
#   bash benchmarks/gpu_reports.sh            (writes under $OUT)
set -uo pipefail
OUT=${OUT:-/tmp/lamina-gpu-reports}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1
LAMINA="python3 -m lamina.entrypoints.cli"

timeout 240 python3 -m pytest -q -p no:cacheprovider tests/test_triton_kernels.py tests/test_gpu_engine.py \
  tests/test_batch_invariance.py tests/test_demo_model.py::test_gpu_bf16_accuracy_and_mtp_k2 \
  -k "not qsa_selection_is_per and not greedy_and_seeded" 2>&1 | tail -15 | tee "$OUT/gpu_tests.log"

# Offline throughput: 512 prompts x (1024 in / 256 out), max_num_seqs 128.
timeout 200 $LAMINA bench throughput --num-prompts 512 --input-len 1024 --output-len 256 --max-num-seqs 128 \
  --output-json "$OUT/throughput_512x1024x256_h200.json" 2>&1 | grep -v "^Loading" | tail -6

# Prefill of one 8192-token prompt (TTFT; 2 output tokens), chunks of 8192 tokens.
timeout 120 $LAMINA bench latency --batch-size 1 --input-len 8192 --output-len 2 --max-num-batched-tokens 8192 \
  --output-json "$OUT/prefill_8k_h200.json" 2>&1 | grep -v "^Loading" | tail -6
