#!/usr/bin/env bash
# The fast-path session on one H200: decode latency sweeps (graphs, eager, the reference kernels
# as the baseline, all in this run) and profiles of a batch-1 step. Outputs under $OUT.
set -x
export PYTHONUNBUFFERED=1
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl && export PYTHONPATH=/tmp/site:$PWD
B="--batch-size 1 16 64 --input-len 128 --output-len 64 --dtype bfloat16"
python3 -m lamina.entrypoints.cli bench latency $B --output-json $OUT/latency_graphs.json --plot $OUT/latency_graphs.png 2>&1 | tail -6
python3 benchmarks/profile_decode.py --batch 1 --out $OUT/profile_b1_graphs.json 2>&1 | head -30
python3 -m lamina.entrypoints.cli bench latency $B --enforce-eager --output-json $OUT/latency_eager.json 2>&1 | tail -6
LAMINA_KERNELS=reference python3 -m lamina.entrypoints.cli bench latency --batch-size 1 64 --input-len 128 --output-len 32 --dtype bfloat16 --enforce-eager --output-json $OUT/latency_reference.json 2>&1 | tail -6
python3 -m lamina.entrypoints.cli bench latency --batch-size 16 64 --input-len 1024 --output-len 256 --dtype bfloat16 --output-json $OUT/latency_1024.json 2>&1 | tail -6
