#!/usr/bin/env bash
# First GPU check of the fast path: kernel tests on CUDA, a 4-layer latency smoke run.
set -x
export PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name,memory.total --format=csv
python3 -c "import torch, triton, transformers; print(torch.__version__, triton.__version__, transformers.__version__)"
python3 -m pytest -q -p no:cacheprovider tests/test_triton_kernels.py tests/test_batch_invariance.py -k "not qsa_selection_is_per and not greedy_and_seeded" -x 2>&1 | tail -25
python3 -m lamina.entrypoints.cli bench latency --num-layers 4 --batch-size 1 8 --input-len 64 --output-len 16 --dtype bfloat16 2>&1 | tail -8
python3 -m lamina.entrypoints.cli bench latency --num-layers 4 --batch-size 1 8 --input-len 64 --output-len 16 --dtype bfloat16 --enforce-eager 2>&1 | tail -8
