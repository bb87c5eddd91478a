#!/usr/bin/env bash
# The fast path on one H200 (all figures of docs/PERFORMANCE.md come from one run of this):
# GPU tests, decode latency (graphs; eager on the same kernels; the reference kernels as the old
# baseline; transformers at batch 1), concurrency 16/64 at 1024 in / 256 out, a batch-1 profile.
set -x
export PYTHONUNBUFFERED=1
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl && export PYTHONPATH=/tmp/site:$PWD
python3 -m pytest -q -p no:cacheprovider -m gpu tests/test_triton_kernels.py tests/test_gpu_engine.py tests/test_batch_invariance.py 2>&1 | tail -4
python3 -m pytest -q -p no:cacheprovider tests/test_triton_kernels.py 2>&1 | tail -2
L="python3 -m lamina.entrypoints.cli bench latency --dtype bfloat16"
$L --batch-size 1 16 64 --input-len 128 --output-len 64 --output-json $OUT/latency_graphs.json --plot $OUT/latency_graphs.png 2>&1 | tail -5
python3 benchmarks/profile_decode.py --batch 1 --out $OUT/profile_b1.json > $OUT/profile_b1.txt 2>&1
python3 -c "
import json; d=json.load(open('$OUT/profile_b1.json'))
print({k: d[k] for k in ('wall_ms_per_step','gpu_kernel_ms_per_step','kernels_per_step')})
for k in d['top_kernels'][:15]: print(round(k['us_per_step'],1), k['calls_per_step'], k['name'][:80])"
$L --batch-size 16 64 --input-len 1024 --output-len 256 --output-json $OUT/latency_1024.json 2>&1 | tail -4
$L --batch-size 1 16 64 --input-len 128 --output-len 64 --enforce-eager --output-json $OUT/latency_eager.json 2>&1 | tail -5
LAMINA_KERNELS=reference $L --batch-size 1 64 --input-len 128 --output-len 32 --enforce-eager --output-json $OUT/latency_reference.json 2>&1 | tail -4
python3 benchmarks/transformers_decode.py --batch 1 --layers 40 --out $OUT/transformers_b1.json 2>&1 | tail -3
