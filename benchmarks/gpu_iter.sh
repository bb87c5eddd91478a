#!/usr/bin/env bash
# One iteration on the H200: kernel tests on CUDA, decode-GEMV tile tuning against the paths they
# replace, batch-1/16/64 latency (graphs) with the MoE decode GEMV on (default) and off (LAMINA_MOE_GEMV=0: grouped GEMM), a batch-1 profile.
#   bash benchmarks/gpu_iter.sh     (device tool; results under $OUT)
set -x
export PYTHONUNBUFFERED=1
# wheels carried in .whl/ (e.g. fla-core, newer transformers), when there are any
if compgen -G ".whl/*.whl" > /dev/null; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl
fi
export PYTHONPATH=/tmp/site:$PWD
python3 -m pytest -q -p no:cacheprovider tests/test_triton_kernels.py -x 2>&1 | tail -4
nvidia-smi --query-gpu=name,memory.used --format=csv
timeout 170 python3 benchmarks/tune_gemv.py --only moe --out $OUT/tune_gemv.json 2>&1 | grep -v "^skip" | python3 -c "
import sys, json
for line in sys.stdin:
    try: d = json.loads(line)
    except Exception: print(line.rstrip()[:300]); continue
    d.pop('top5', None); print(json.dumps(d)[:400])"
L="python3 -m lamina.entrypoints.cli bench latency --dtype bfloat16 --batch-size 1 16 64 --input-len 128 --output-len 64"
$L --output-json $OUT/latency_graphs.json 2>&1 | tail -5
LAMINA_MOE_GEMV=0 $L --output-json $OUT/latency_graphs_grouped_moe.json 2>&1 | tail -5
python3 benchmarks/profile_decode.py --batch 1 --out $OUT/profile_b1.json > $OUT/profile_b1.txt 2>&1
python3 -c "
import json; d=json.load(open('$OUT/profile_b1.json'))
print({k: d[k] for k in ('wall_ms_per_step','gpu_kernel_ms_per_step','kernels_per_step')})
for k in d['top_kernels'][:40]: print(round(k['us_per_step'],1), k['calls_per_step'], k['name'][:90])
print('\n'.join(d['host_profile_20_steps'][:30]))"
