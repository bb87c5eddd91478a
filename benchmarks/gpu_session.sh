#!/usr/bin/env bash
# One device run (H200) of this session's checks and figures; results under $OUT.
#   bash benchmarks/gpu_session.sh [tests|latency|async|kernels|router|prefill|profile|profile64|gputests|mtp|serve|
#                                   validate|first|compare|gemvtune|moetune|gemvab|pdl|reports|qwen4gpu|routeab|tp2graphs|profiles|demomtp|prefilltune|prefillcheck|prefillfinal|serveoffline|ttft8k|thrsteps|thrtrace|thrprofile|sdpashapes|varlenattn|prefillkernels|prefillprofile|gputests8|gputests9|varlenab|chunked16k|convfinal|varlentiles|gputests10|b1ab|boundary|gputests11|moesweep|b1|profile16k|trace16k|steps16k|l2pf|alignab|alignab2|preload|prefillfig|gemvpre|gputests12|gemvnorm|warps13|ab13|router13|gputests13|gdn13|chain13|kernelsall|stream14|fma14|fma14tests|gemvfma14|fma14b|ab15|ab15b|rows15|tests15|gemvrows16|gemvrows16b|ab16|outproj16|sharedpre16|profilenopdl|downacc17|fmarows17|final17|mtp18|commit18|draft18|commitbench18|final18|mtprounds|timeline19|launch19|gpuall19|gputests19|host20|mtpasync21|mtpasync22|fill23|tests23|s24|compare25|seeded25|s26|s26b|s27a|s27b|s27s|s28a|s28c|s28g|s28m|s28t|s29|ttftab|s30|thr30|s31|s31b|s31c|s31t|s32|s32b|s32c|s32d|s32e|s32f|s32g|s33|s33b|s33c|s33d|s34|s35|s36|s36b|s36c|s36d|s37|s37b|s38|s38n|s39|s39b|s40a|s40b|s40c|s40d|s41v|s41w|s41p|s41q|s42p|s42s|s42f|s43a|s43b|s43c|s43d|s44t|s44a|s44b|s45q|s45s|s45m|s45b|s45g|s45k|s46a|s46b|s46c ...]
#   (default: latency profile prefill tests)
# Wheels carried in .whl/ (fla-core, einops, uvicorn and its deps when the image lacks them) go to /tmp/site.
set -x
export PYTHONUNBUFFERED=1
if compgen -G ".whl/*.whl" > /dev/null; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target /tmp/site .whl/*.whl
fi
export PYTHONPATH=/tmp/site:$PWD
python3 -c "import torch, triton, transformers; print(torch.__version__, triton.__version__, transformers.__version__)"
python3 -c "from lamina.kernels.fla_prefill import fla_import_error as e; print('fla:', e() or 'ok')"
PARTS=${*:-latency profile prefill tests}
L="python3 -m lamina.entrypoints.cli bench latency --dtype bfloat16"
# merge_latency NAME: the latency records /tmp/NAME*.json into $OUT/NAME.json, one line per record printed
merge_latency() {
  python3 -c "
import json, glob
out = {f.split('/')[-1][:-5]: json.load(open(f)) for f in sorted(glob.glob('/tmp/$1*.json'))}
json.dump(out, open('$OUT/$1.json', 'w'), indent=1)
for k, v in out.items():
    for r in (v if isinstance(v, list) else [v]): print(k, round(r.get('tpot_ms'), 3), round(r.get('output_tok_per_s'), 1), round(r.get('hbm_roofline_fraction'), 4))"
}
# merge_throughput NAME OUTFILE: the throughput records /tmp/NAME*.json into $OUT/OUTFILE.json, one line each
merge_throughput() {
  python3 -c "
import json, glob
out = {f.split('/')[-1][:-5]: json.load(open(f)) for f in sorted(glob.glob('/tmp/$1*.json'))}
json.dump(out, open('$OUT/$2.json', 'w'), indent=1)
for k, v in out.items(): print(k, v[0]['max_num_seqs'], round(v[0]['output_tok_per_s']), round(v[0]['total_tok_per_s']))"
}
# ttft8k_fp8_ab NAME: an 8,192-token prompt's TTFT, bf16 then FP8 experts, twice, one process each, into $OUT/NAME.json
ttft8k_fp8_ab() {
  local i=0 q
  for q in none fp8 none fp8; do i=$((i+1))
    timeout 120 $L --batch-size 1 --input-len 8192 --output-len 2 --max-num-batched-tokens 8192 --quantization $q \
      --output-json /tmp/$1_${i}_$q.json 2>&1 | grep "^| 1 "
  done
  merge_latency $1 > /dev/null
}
# ab_b1 NAME ROUNDS: batch-1 latency of .baseline then this tree, alternating, ROUNDS times, into $OUT/NAME.json
ab_b1() {
  for i in $(seq $2); do
    (cd .baseline && PYTHONPATH=/tmp/site:$PWD LAMINA_GDN_PREFILL=reference timeout 60 $L --batch-size 1 --input-len 128 \
      --output-len 64 --output-json /tmp/$1_base_$i.json 2>&1 | tail -1)
    LAMINA_GDN_PREFILL=reference timeout 60 $L --batch-size 1 --input-len 128 --output-len 64 \
      --output-json /tmp/$1_new_$i.json 2>&1 | tail -1
  done
  merge_latency $1
}
exec 3>&1
for part in $PARTS; do
  exec > >(tee -a $OUT/$part.log >&3) 2>&1  # each part's output lands in $OUT even if the run is cut short
  case $part in
    tests)
      timeout ${TESTS_TIMEOUT:-150} python3 -m pytest -q -p no:cacheprovider -x --durations=8 -m gpu tests/test_gdn_prefill.py tests/test_gpu_engine.py tests/test_triton_kernels.py 2>&1 | tail -40 ;;
    latency)  # 0.95: on an 80 GB H100 the memory plan (session 30) holds at most 60 requests' states at 0.9
      LAMINA_GDN_PREFILL=reference timeout 150 $L --batch-size 1 16 64 --input-len 128 --output-len 64 \
        --gpu-memory-utilization 0.95 --output-json $OUT/latency_graphs.json 2>&1 | tail -6
      LAMINA_GDN_PREFILL=reference LAMINA_MOE_GEMV=0 timeout 50 $L --batch-size 1 --input-len 128 --output-len 64 --output-json $OUT/latency_graphs_grouped_moe.json 2>&1 | tail -3 ;;
    prefill)
      timeout 90 python3 benchmarks/bench_gdn_prefill.py --output-json $OUT/gdn_prefill.json 2>&1 | tail -12
      for p in reference fla; do
        LAMINA_GDN_PREFILL=$p timeout 70 $L --batch-size 1 --input-len 8192 --output-len 2 --max-num-batched-tokens 8192 \
          --output-json $OUT/prefill_8k_$p.json 2>&1 | tail -3
      done ;;
    async)  # asynchronous scheduling on / off in the same run; concurrency 16 / 64 at 1024 in, 256 out
      LAMINA_GDN_PREFILL=reference timeout 150 $L --batch-size 1 16 64 --input-len 128 --output-len 64 --output-json $OUT/latency_async.json 2>&1 | tail -6
      LAMINA_GDN_PREFILL=reference timeout 120 $L --batch-size 1 16 64 --input-len 128 --output-len 64 --no-async-scheduling --output-json $OUT/latency_sync.json 2>&1 | tail -6
      LAMINA_GDN_PREFILL=reference timeout 150 $L --batch-size 16 64 --input-len 1024 --output-len 256 --output-json $OUT/latency_1024.json 2>&1 | tail -5 ;;
    profile64)
      LAMINA_GDN_PREFILL=reference timeout 150 python3 benchmarks/profile_decode.py --batch 64 --out $OUT/profile_b64.json > $OUT/profile_b64.txt 2>&1
      python3 -c "
import json; d=json.load(open('$OUT/profile_b64.json'))
print({k: d[k] for k in ('wall_ms_per_step','gpu_kernel_ms_per_step','kernels_per_step')})
for k in d['top_kernels'][:16]: print(round(k['us_per_step'],1), k['calls_per_step'], k['name'][:80])" ;;
    kernels)  # the fused router and the MoE GEMV sweep (L2-cold), with their GPU tests
      timeout 150 python3 -m pytest -q -p no:cacheprovider -m gpu tests/test_triton_router.py tests/test_triton_kernels.py tests/test_gpu_engine.py 2>&1 | tail -8
      timeout 60 python3 benchmarks/bench_router.py --out $OUT/bench_router.json 2>&1 | tail -8
      timeout 150 python3 benchmarks/tune_gemv.py --only moe --out $OUT/tune_gemv_moe.json 2>&1 | tail -30 ;;
    router)  # decode with the fused router (default) and with the two launches, same run
      LAMINA_GDN_PREFILL=reference timeout 150 $L --batch-size 1 16 64 --input-len 128 --output-len 64 --output-json $OUT/latency_router.json 2>&1 | tail -6
      LAMINA_GDN_PREFILL=reference LAMINA_FUSED_ROUTER=0 timeout 60 $L --batch-size 1 --input-len 128 --output-len 64 --output-json $OUT/latency_no_router.json 2>&1 | tail -3 ;;
    gputests)  # every GPU-marked test of the kernels, graphs, fla prefill and MTP verification
      timeout ${TESTS_TIMEOUT:-200} python3 -m pytest -q -p no:cacheprovider --durations=5 -m gpu tests/test_gdn_prefill.py \
        tests/test_triton_verify_kernels.py tests/test_mtp_triton.py tests/test_gpu_engine.py tests/test_triton_kernels.py 2>&1 | tail -30 ;;
    mtp)  # MTP K=1..3 step costs at batch 1, verify graphs vs eager
      for mode in graphs eager; do
        flag=$([ $mode = eager ] && echo --enforce-eager)
        timeout 80 python3 benchmarks/bench_mtp.py --layers 40 --new-tokens 64 --batches 1 $flag --out $OUT/mtp_${mode}_b1.json 2>&1 | tail -8
      done ;;
    validate)  # the GPU-only paths not yet run on a GPU: Qwen4-Exp QSA decode graphs, engine warm-up, kernels
      LAMINA_QSA_DECODE=1 timeout 150 python3 -m pytest -q -p no:cacheprovider -m gpu tests/test_qwen4_graphs.py \
        tests/test_triton_kernels.py tests/test_triton_router.py tests/test_async_scheduling.py 2>&1 | tail -15 ;;
    first)  # TTFT of a fresh engine's first request, warm-up off / on, empty Triton caches, then a restart
      timeout 300 python3 benchmarks/first_request.py --out $OUT/first_request.json 2>&1 | tail -6 ;;
    restart)  # warm-up on: a cold cache, then a restart on the cache it left (fla's autotuning on disk)
      timeout 200 python3 benchmarks/first_request.py --skip-off --out $OUT/first_request_restart.json 2>&1 | tail -6 ;;
    compare)  # batch 1 against transformers' generate (with fla-core) in the same process run
      LAMINA_GDN_PREFILL=reference timeout 200 $L --batch-size 1 --input-len 128 --output-len 32 --compare transformers \
        --output-json $OUT/compare_transformers_b1.json 2>&1 | tail -6 ;;
    gemvtune)  # the split-K dense GEMV against cuBLAS (L2-cold), the decode linears' shapes
      timeout 240 python3 benchmarks/tune_gemv.py --only linear --out $OUT/tune_gemv_linear.json 2>&1 | grep -v "^skip" | tail -12 ;;
    moetune)  # grouped-GEMM fused MoE tiles at 16 and 64 tokens
      timeout 300 python3 benchmarks/tune_moe.py --batches 16,64 --out $OUT/tune_moe.json 2>&1 | grep -v "^skip" | tail -4 ;;
    gemvab)  # decode with lamina's GEMV for the dense decode linears, and with cuBLAS, same run
      for g in 1 0; do
        LAMINA_TRITON_GEMV=$g LAMINA_GDN_PREFILL=reference timeout 150 $L --batch-size 1 16 64 --input-len 128 --output-len 64 \
          --output-json $OUT/latency_gemv$g.json 2>&1 | tail -5
      done ;;
    newtests)  # GPU tests of this session's kernels: split-K GEMV, split attention, fused GDN decode, align, Qwen4 graphs
      LAMINA_QSA_DECODE=1 timeout ${TESTS_TIMEOUT:-240} python3 -m pytest -q -p no:cacheprovider -m gpu --durations=5 \
        tests/test_triton_gdn_decode.py tests/test_triton_kernels.py tests/test_triton_router.py tests/test_qwen4_graphs.py \
        tests/test_gpu_engine.py tests/test_batch_invariance.py 2>&1 | tail -25 ;;
    gdnbench)  # fused delta-net decode against the three launches, CUDA graphs of 30 layers
      timeout 90 python3 benchmarks/bench_gdn_decode.py --sweep --out $OUT/bench_gdn_decode.json 2>&1 | tail -12 ;;
    alignbench)
      timeout 60 python3 benchmarks/bench_align.py --out $OUT/bench_align.json 2>&1 | tail -8 ;;
    q4tests)  # Qwen4-Exp decode graphs (QSA fixed-shape decode, now the default) against eager and fp32
      timeout 150 python3 -m pytest -q -p no:cacheprovider -m gpu tests/test_qwen4_graphs.py tests/test_gpu_engine.py -k "qwen4 or graphs" 2>&1 | tail -8 ;;
    final)  # decode at 128 / 64 and at 1024 / 256 with this session's defaults
      LAMINA_GDN_PREFILL=reference timeout 150 $L --batch-size 1 16 64 --input-len 128 --output-len 64 \
        --output-json $OUT/latency_final.json --plot $OUT/latency_final.png 2>&1 | tail -5
      LAMINA_GDN_PREFILL=reference timeout 150 $L --batch-size 16 64 --input-len 1024 --output-len 256 \
        --output-json $OUT/latency_1024_final.json 2>&1 | tail -4 ;;
    pdl)  # programmatic dependent launch on / off in the same run (decode at 128 / 64), the b1 profile with it, GPU tests
      for p in 1 0; do
        LAMINA_PDL=$p LAMINA_GDN_PREFILL=reference timeout 130 $L --batch-size 1 16 64 --input-len 128 --output-len 64 \
          --output-json $OUT/latency_pdl$p.json 2>&1 | tail -5
      done
      LAMINA_GDN_PREFILL=reference timeout 100 python3 benchmarks/profile_decode.py --batch 1 --out $OUT/profile_b1_pdl.json > $OUT/profile_b1_pdl.txt 2>&1
      python3 -c "
import json; d=json.load(open('$OUT/profile_b1_pdl.json'))
print({k: d[k] for k in ('wall_ms_per_step','gpu_kernel_ms_per_step','kernels_per_step')})
for k in d['top_kernels'][:14]: print(round(k['us_per_step'],1), k['calls_per_step'], k['name'][:80])"
      timeout ${TESTS_TIMEOUT:-200} python3 -m pytest -q -p no:cacheprovider -m gpu --durations=5 tests/test_pdl.py \
        tests/test_triton_kernels.py tests/test_gpu_engine.py tests/test_triton_gdn_decode.py tests/test_batch_invariance.py \
        tests/test_qwen4_graphs.py 2>&1 | tail -25 ;;
    reports)  # offline throughput 512 x (1024 / 256), the 8k prefill (fla), MTP K=1..3 at batch 1 (graphs)
      timeout 200 python3 -m lamina.entrypoints.cli bench throughput --dtype bfloat16 --num-prompts 512 --input-len 1024 \
        --output-len 256 --max-num-seqs 128 --output-json $OUT/throughput_512.json 2>&1 | tail -4
      LAMINA_GDN_PREFILL=fla timeout 80 $L --batch-size 1 --input-len 8192 --output-len 2 --max-num-batched-tokens 8192 \
        --output-json $OUT/prefill_8k_fla.json 2>&1 | tail -3
      timeout 110 python3 benchmarks/bench_mtp.py --layers 40 --new-tokens 64 --batches 1 --out $OUT/mtp_graphs_b1.json 2>&1 | tail -8 ;;
    qwen4gpu)  # Qwen4-Exp at real width (4 layers) with its ~95 GiB PLE table on the GPU: decode graphs, batch 1 and 16
      timeout 200 python3 benchmarks/qwen4_gpu_check.py --placement gpu --skip-tiny --out $OUT/qwen4_gpu_table.json 2>&1 | tail -30 ;;
    routeab)  # the router GEMV's routing epilogue on / off in the same run (decode at 128 / 64), then GPU tests
      for r in 1 0; do
        LAMINA_GEMV_ROUTE=$r LAMINA_GDN_PREFILL=reference timeout 130 $L --batch-size 1 16 64 --input-len 128 --output-len 64 \
          --output-json $OUT/latency_gemv_route$r.json 2>&1 | tail -5
      done
      timeout ${TESTS_TIMEOUT:-200} python3 -m pytest -q -p no:cacheprovider -m gpu --durations=5 tests/test_pdl.py \
        tests/test_triton_kernels.py tests/test_triton_router.py tests/test_gpu_engine.py tests/test_batch_invariance.py \
        tests/test_qwen4_graphs.py 2>&1 | tail -25 ;;
    tp2graphs)  # needs nvidia-h200-x2: TP2 with CUDA graphs on every rank (NCCL captured) against one GPU
      timeout 300 python3 -m pytest -q -p no:cacheprovider -m gpu tests/test_multirank_graphs.py 2>&1 | tail -8 ;;
    profiles)  # where the 8k prefill goes (fla), and the b1 decode step split by kernel with PDL off (overlap-free)
      LAMINA_GDN_PREFILL=fla timeout 150 python3 benchmarks/profile_decode.py --prefill-len 8192 --steps 2 --out $OUT/profile_prefill_8k.json > $OUT/profile_prefill_8k.txt 2>&1
      LAMINA_PDL=0 LAMINA_GDN_PREFILL=reference timeout 100 python3 benchmarks/profile_decode.py --batch 1 --out $OUT/profile_b1_nopdl.json > $OUT/profile_b1_nopdl.txt 2>&1
      for f in profile_prefill_8k profile_b1_nopdl; do python3 -c "
import json; d=json.load(open('$OUT/$f.json'))
print('$f', {k: d.get(k) for k in ('wall_ms_per_prefill','wall_ms_per_step','gpu_kernel_ms_per_step','kernels_per_step')})
for k in d['top_kernels'][:26]: print(round(k['us_per_step'],1), k['calls_per_step'], k['name'][:90])"; done ;;
    prefilltune)  # grouped fused-MoE tiles for prefill chunks (1024 / 8192 tokens), SDPA's mask vs is_causal at 8k
      timeout 120 python3 benchmarks/bench_prefill_attention.py --out $OUT/bench_prefill_attention.json 2>&1 | tail -3
      timeout 420 python3 benchmarks/tune_moe.py --prefill --out $OUT/tune_moe_prefill.json 2>&1 | grep -v "^skip" | tail -3 ;;
    prefillcheck)  # the prefill tiles' boundaries, the 8k prefill and its profile on the new defaults, GPU tests
      timeout 200 python3 benchmarks/tune_moe.py --prefill --batches 128,256,2048,4096 --out $OUT/tune_moe_prefill_sizes.json 2>&1 | grep -v "^skip" | cut -c1-400
      LAMINA_GDN_PREFILL=fla timeout 80 $L --batch-size 1 --input-len 8192 --output-len 2 --max-num-batched-tokens 8192 \
        --output-json $OUT/prefill_8k_fla.json 2>&1 | tail -3
      LAMINA_GDN_PREFILL=fla timeout 150 python3 benchmarks/profile_decode.py --prefill-len 8192 --steps 2 --out $OUT/profile_prefill_8k.json > $OUT/profile_prefill_8k.txt 2>&1
      python3 -c "
import json; d=json.load(open('$OUT/profile_prefill_8k.json'))
print({k: d.get(k) for k in ('wall_ms_per_prefill','gpu_kernel_ms_per_step','kernels_per_step')})
for k in d['top_kernels'][:20]: print(round(k['us_per_step'],1), k['calls_per_step'], k['name'][:90])"
      timeout ${TESTS_TIMEOUT:-200} python3 -m pytest -q -p no:cacheprovider -m gpu --durations=5 tests/test_triton_kernels.py \
        tests/test_gpu_engine.py tests/test_batch_invariance.py tests/test_gdn_prefill.py 2>&1 | tail -15 ;;
    prefillfinal)  # the 8k prefill on the new defaults, GPU tests of the prefill tiles and the engine, offline throughput
      LAMINA_GDN_PREFILL=fla timeout 150 $L --batch-size 1 --input-len 8192 --output-len 2 --max-num-batched-tokens 8192 \
        --output-json $OUT/prefill_8k_fla.json 2>&1 | tail -3
      timeout ${TESTS_TIMEOUT:-220} python3 -m pytest -q -p no:cacheprovider -m gpu --durations=5 tests/test_triton_kernels.py \
        tests/test_gpu_engine.py tests/test_batch_invariance.py 2>&1 | tail -12
      timeout 150 python3 -m lamina.entrypoints.cli bench throughput --dtype bfloat16 --num-prompts 512 --input-len 1024 \
        --output-len 256 --max-num-seqs 128 --output-json $OUT/throughput_512.json 2>&1 | tail -4 ;;
    demomtp)  # the trained demo model's bf16 GPU tests (MTP included), cut off at 150 s in session 6
      timeout ${TESTS_TIMEOUT:-300} python3 -m pytest -q -p no:cacheprovider -m gpu --durations=8 tests/test_demo_model.py 2>&1 | tail -15 ;;
    serve)  # the server at c1 / c16 / c64 (engine-statistics lines every 2 s in $OUT/server.log)
      PROMPTS_C64=64 timeout 240 bash benchmarks/gpu_serve.sh 2>&1 | tail -25
      grep "engine: prompt" $OUT/server.log | tail -40 ;;
    ttft8k)  # time to first token of one 8k prompt on a warmed-up engine (fla delta rule)
      LAMINA_GDN_PREFILL=fla timeout 150 $L --batch-size 1 --input-len 8192 --output-len 2 --max-num-batched-tokens 8192 \
        --output-json $OUT/prefill_8k_fla.json 2>&1 | tail -3 ;;
    thrsteps)  # c64's workload offline, every engine step timed (prompt-bearing vs decode steps, the slowest)
      timeout 150 python3 benchmarks/throughput_steps.py --num-prompts 64 --input-len 1024 --output-len 256 \
        --max-num-seqs 64 --max-model-len 2048 --out $OUT/throughput_steps.json 2>&1 | tail -24 ;;
    thrtrace)  # the same from an empty Triton cache, listing the kernels each step compiles
      timeout 280 python3 benchmarks/throughput_steps.py --trace-compiles --num-prompts 64 --input-len 1024 --output-len 256 \
        --max-num-seqs 64 --max-model-len 2048 --out $OUT/throughput_steps_trace.json 2>&1 | tail -30 | cut -c1-1500 ;;
    thrprofile)  # the first 10 steps of that run (its prompt phase) under cProfile: where the slow prompt steps wait
      timeout 200 python3 benchmarks/throughput_steps.py --cprofile 10 --num-prompts 64 --input-len 1024 --output-len 256 \
        --max-num-seqs 64 --max-model-len 2048 > /tmp/thrprofile.txt 2>&1
      grep -A45 "Ordered by: cumulative" /tmp/thrprofile.txt | cut -c1-180; grep -A30 "Ordered by: internal" /tmp/thrprofile.txt | cut -c1-180
      grep "^slowest\|^first" /tmp/thrprofile.txt | cut -c1-600 ;;
    sdpashapes)  # SDPA's first call at new prompt lengths per backend (cuDNN builds a plan per shape), causal and masked
      timeout 150 python3 benchmarks/bench_sdpa_shapes.py --out $OUT/bench_sdpa_shapes.json 2>&1 | tail -40 ;;
    sdpagqa)  # the same with 2 KV heads and enable_gqa (paged_attention's call): which backends take it, at what cost
      timeout 100 python3 benchmarks/bench_sdpa_shapes.py --gqa --lens 997,1001,2039,8191 --backends default,efficient,flash --out $OUT/bench_sdpa_shapes_gqa.json 2>&1 | tail -30 ;;
    varlenattn)  # prefill / mixed-step attention: SDPA per request group against the varlen Triton kernel, first call and repeat
      timeout 150 python3 benchmarks/bench_varlen_attention.py --out $OUT/bench_varlen_attention.json 2>&1 | tail -8
      timeout 150 python3 -m pytest -q -p no:cacheprovider -m gpu tests/test_kernels.py tests/test_triton_kernels.py -k "attention" 2>&1 | tail -4 ;;
    prefillkernels)  # gated RMSNorm rows per program and conv prefill tiles at 8k tokens, against the copy rate
      timeout 120 python3 benchmarks/bench_prefill_kernels.py --out $OUT/bench_prefill_kernels.json 2>&1 | tail -40 ;;
    prefillprofile)  # where the 8k prefill goes (fla), kernel by kernel
      LAMINA_GDN_PREFILL=fla timeout 150 python3 benchmarks/profile_decode.py --prefill-len 8192 --steps 2 --out $OUT/profile_prefill_8k.json > /tmp/profile_prefill_8k.txt 2>&1
      python3 -c "
import json; d=json.load(open('$OUT/profile_prefill_8k.json'))
print({k: d.get(k) for k in ('wall_ms_per_prefill','gpu_kernel_ms_per_step','kernels_per_step')})
for k in d['top_kernels'][:24]: print(round(k['us_per_step'],1), k['calls_per_step'], k['name'][:90])" ;;
    gputests8)  # GPU tests of the kernels, the engine (warm-up, graphs, async), batch invariance, paged attention
      timeout ${TESTS_TIMEOUT:-240} python3 -m pytest -q -p no:cacheprovider -m gpu --durations=5 tests/test_triton_kernels.py \
        tests/test_gpu_engine.py tests/test_batch_invariance.py tests/test_async_scheduling.py tests/test_triton_gdn_decode.py 2>&1 | tail -15 ;;
    serveoffline)  # c64's workload offline (same engine settings as gpu_serve.sh, no HTTP), to split server from engine
      timeout 150 python3 -m lamina.entrypoints.cli bench throughput --dtype bfloat16 --num-prompts 64 --input-len 1024 \
        --output-len 256 --max-num-seqs 64 --max-model-len 2048 --output-json $OUT/throughput_64_serveshape.json 2>&1 | tail -4 ;;
    gputests9)  # GPU tests of session 8's unrun paths: flash preference, mixed-step groups, conv split, the varlen kernel in bf16
      # (fla's bf16 prefill cases, autotuned from an empty cache, passed earlier sessions and stalled this one's first run: left out)
      timeout ${TESTS_TIMEOUT:-300} python3 -m pytest -v -p no:cacheprovider -m gpu --durations=6 -k "not fla_prefill_matches_reference" \
        tests/test_kernels.py tests/test_request_groups.py tests/test_gdn_prefill.py tests/test_gpu_engine.py tests/test_triton_kernels.py \
        tests/test_batch_invariance.py 2>&1 | grep -v "^$" | tail -32 | cut -c1-200 ;;
    varlenab)  # the varlen Triton prefill attention against SDPA per group in the engine: 8k TTFT and c64's workload, same run
      for a in sdpa triton; do
        LAMINA_PREFILL_ATTENTION=$a LAMINA_GDN_PREFILL=fla timeout 150 $L --batch-size 1 --input-len 8192 --output-len 2 \
          --max-num-batched-tokens 8192 --output-json $OUT/prefill_8k_attn_$a.json 2>&1 | tail -2
        LAMINA_PREFILL_ATTENTION=$a timeout 150 python3 -m lamina.entrypoints.cli bench throughput --dtype bfloat16 --num-prompts 64 \
          --input-len 1024 --output-len 256 --max-num-seqs 64 --max-model-len 2048 --output-json $OUT/throughput_64_attn_$a.json 2>&1 | tail -2
      done ;;
    chunked16k)  # one 16k prompt in 2k chunks (seven continue cached context): varlen kernel against SDPA's masked call
      for a in sdpa triton; do
        LAMINA_PREFILL_ATTENTION=$a LAMINA_GDN_PREFILL=fla timeout 200 $L --batch-size 1 --input-len 16384 --output-len 2 \
          --max-num-batched-tokens 2048 --output-json $OUT/prefill_16k_chunked_attn_$a.json 2>&1 | tail -1
      done ;;
    convfinal)  # the conv prefill's body + edge kernels: GPU tests, the tile sweep of both layouts, the 8k TTFT, offline throughput
      timeout 200 python3 -m pytest -q -p no:cacheprovider -m gpu tests/test_gdn_prefill.py -k "conv or engine" 2>&1 | tail -3
      timeout 200 python3 benchmarks/bench_prefill_kernels.py --out $OUT/bench_prefill_kernels.json > /tmp/prefillkernels.txt 2>&1
      python3 -c "
import json; rs=[r for r in json.load(open('$OUT/bench_prefill_kernels.json')) if r.get('kernel')=='conv_prefill']
for r in sorted([r for r in rs if 'ms' in r], key=lambda r: r['ms'])[:8] + [r for r in rs if (r.get('block_t'),r.get('block_c'),r.get('warps'))==(32,128,4) or 'check' in r or 'error' in r][:6]: print(r)" || tail -5 /tmp/prefillkernels.txt
      LAMINA_GDN_PREFILL=fla timeout 150 $L --batch-size 1 --input-len 8192 --output-len 2 --max-num-batched-tokens 8192 \
        --output-json $OUT/prefill_8k_fla.json 2>&1 | tail -1
      for seqs in 128 256; do
        timeout 150 python3 -m lamina.entrypoints.cli bench throughput --dtype bfloat16 --num-prompts 512 --input-len 1024 \
          --output-len 256 --max-num-seqs $seqs --output-json $OUT/throughput_512_seqs$seqs.json 2>&1 | tail -1
      done ;;
    varlentiles)  # the varlen attention kernel's (BLOCK_M, BLOCK_N, warps, stages) on a fresh 8k prompt and a continued 4k chunk
      timeout 300 python3 benchmarks/bench_varlen_attention.py --sweep --out $OUT/bench_varlen_tiles.json 2>&1 | tail -14 ;;
    gputests10)  # GPU tests of the kernels, the engine and batch invariance (ran on acc4290, whose GEMV / routing changes were reverted)
      timeout ${TESTS_TIMEOUT:-200} python3 -m pytest -q -p no:cacheprovider -m gpu --durations=5 -k "not fla_prefill_matches_reference" \
        tests/test_triton_kernels.py tests/test_pdl.py tests/test_triton_router.py tests/test_gpu_engine.py \
        tests/test_batch_invariance.py 2>&1 | grep -v "^$" | tail -14 | cut -c1-200 ;;
    b1ab)  # batch-1 decode (128 in / 64 out): this tree against an earlier tree in .baseline (git archive, carried), alternating,
      # then this tree with LAMINA_GEMV_GATED_NORM=0 (acc4290's switch; reverted since, ignored by later trees)
      for i in 1 2; do
        dir=/tmp; [ $i = 2 ] && dir=$OUT
        (cd .baseline && PYTHONPATH=/tmp/site:$PWD LAMINA_GDN_PREFILL=reference timeout 90 python3 -m lamina.entrypoints.cli bench latency \
          --dtype bfloat16 --batch-size 1 --input-len 128 --output-len 64 --output-json $dir/latency_b1_base_$i.json 2>&1 | tail -1)
        LAMINA_GDN_PREFILL=reference timeout 90 $L --batch-size 1 --input-len 128 --output-len 64 \
          --output-json $dir/latency_b1_new_$i.json 2>&1 | tail -1
      done
      LAMINA_GEMV_GATED_NORM=0 LAMINA_GDN_PREFILL=reference timeout 90 $L --batch-size 1 --input-len 128 --output-len 64 \
        --output-json $OUT/latency_b1_new_gated_norm_off.json 2>&1 | tail -1 ;;
    boundary)  # what a kernel boundary costs in a CUDA graph (PDL on / off): empty chains, and N slices streamed in N kernels vs one
      timeout 200 python3 benchmarks/bench_kernel_boundary.py --out $OUT/bench_kernel_boundary.json 2>&1 | tail -48 ;;
    gputests11)  # GPU tests with the wide-head varlen tile as default: kernels, request groups, engine, batch invariance
      timeout ${TESTS_TIMEOUT:-300} python3 -m pytest -q -p no:cacheprovider -m gpu --durations=6 -k "not fla_prefill_matches_reference" \
        tests/test_kernels.py tests/test_request_groups.py tests/test_triton_kernels.py tests/test_gpu_engine.py \
        tests/test_batch_invariance.py tests/test_pdl.py 2>&1 | grep -v "^$" | tail -16 | cut -c1-200 ;;
    moesweep)  # the MoE GEMV tiles at 1 / 2 / 4 tokens (L2-cold, graph replays), with the many-program tiles at one token
      timeout 400 python3 benchmarks/tune_gemv.py --only moe --many-programs --out $OUT/tune_gemv_moe_many.json 2>&1 | grep -v "^skip" | tail -8 | cut -c1-1500 ;;
    b1)  # batch-1 decode, 128 in / 64 out
      LAMINA_GDN_PREFILL=reference timeout 90 $L --batch-size 1 --input-len 128 --output-len 64 --output-json $OUT/latency_b1.json 2>&1 | tail -1 ;;
    profile16k)  # where a 16k prompt in 2k chunks goes (fla delta rule): wall against GPU time, kernel by kernel
      LAMINA_GDN_PREFILL=fla timeout 200 python3 benchmarks/profile_decode.py --prefill-len 16384 --chunk 2048 --steps 1 \
        --out $OUT/profile_prefill_16k_chunked.json > /tmp/profile_prefill_16k.txt 2>&1 || tail -20 /tmp/profile_prefill_16k.txt
      python3 -c "
import json; d=json.load(open('$OUT/profile_prefill_16k_chunked.json'))
print({k: d.get(k) for k in ('wall_ms_per_prefill','gpu_kernel_ms_per_step','kernels_per_step')})
for k in d['top_kernels'][:30]: print(round(k['us_per_step'],1), k['calls_per_step'], k['name'][:100])" ;;
    trace16k)  # what the first 16k prompt in 2k chunks compiles after the engine's warm-up (empty Triton cache), step by step
      LAMINA_GDN_PREFILL=fla timeout 300 python3 benchmarks/throughput_steps.py --trace-compiles --no-first-request --num-prompts 1 \
        --input-len 16384 --output-len 2 --max-num-seqs 1 --max-model-len 16400 --max-num-batched-tokens 2048 \
        --out $OUT/trace_16k_chunked.json 2>&1 | tail -12 | cut -c1-1500 ;;
    steps16k)  # bench latency's 16k prompt in 2k chunks (varlen kernel), twice in one process (the first request, then
      # another), with the wall time of each step up to the first token
      LAMINA_GDN_PREFILL=fla timeout 200 $L --batch-size 1 1 --input-len 16384 --output-len 2 --max-num-batched-tokens 2048 \
        --output-json $OUT/prefill_16k_chunked_steps.json 2>&1 | tail -1
      python3 -c "
import json
for r in json.load(open('$OUT/prefill_16k_chunked_steps.json')): print(r['ttft_ms'], r['first_token_steps_ms'], sum(r['first_token_steps_ms']))" ;;
    l2pf)  # L2 prefetch of out_proj's weight before the latency-bound kernels: the microbenchmark (session 12 also ran
      # batch-1 / 16 / 64 decode with LAMINA_L2_PREFETCH=1 / 0 on a tree that wired it into the decode path, removed since)
      timeout 150 python3 benchmarks/bench_l2_prefetch.py --out $OUT/bench_l2_prefetch.json 2>&1 | tail -14 ;;
    alignab)  # the three-launch MoE alignment of prefill chunks (triton_align) against torch's: the kernel bench, then
      # the 16k prompt in 2k chunks twice per process, LAMINA_MOE_ALIGN=triton / torch / triton; GPU tests of the alignment
      timeout 120 python3 benchmarks/bench_align.py --pairs 8192,16384,65536 --block-m 64 --no-v0 --eager \
        --out $OUT/bench_align_prefill.json 2>&1 | tail -4 | cut -c1-600
      for a in triton torch triton; do
        LAMINA_MOE_ALIGN=$a LAMINA_GDN_PREFILL=fla timeout 200 $L --batch-size 1 1 --input-len 16384 --output-len 2 \
          --max-num-batched-tokens 2048 --output-json /tmp/prefill16k_align_$a.json 2>&1 | tail -1
        python3 -c "
import json
for r in json.load(open('/tmp/prefill16k_align_$a.json')): print('$a', r['ttft_ms'], [round(x, 1) for x in r['first_token_steps_ms']])"
        cp /tmp/prefill16k_align_$a.json /tmp/prefill16k_align_${a}_$(date +%s).json
      done
      python3 -c "
import json, glob
json.dump({f.split('/')[-1][:-5]: json.load(open(f)) for f in sorted(glob.glob('/tmp/prefill16k_align_*_*.json'))},
          open('$OUT/prefill16k_align.json', 'w'), indent=1)"
      timeout ${TESTS_TIMEOUT:-120} python3 -m pytest -q -p no:cacheprovider -m gpu -k "align" tests/test_triton_kernels.py 2>&1 | tail -4 ;;
    alignab2)  # the blocked alignment with its histogram count: the kernel bench and GPU tests, the 16k prompt in 2k chunks
      # with LAMINA_MOE_ALIGN=torch / triton alternating (twice), offline throughput, the 16k prompt profiled
      timeout 120 python3 benchmarks/bench_align.py --pairs 8192,16384,65536 --block-m 64 --no-v0 --eager \
        --out $OUT/bench_align_prefill.json 2>&1 | tail -3 | cut -c1-600
      timeout 120 python3 -m pytest -q -p no:cacheprovider -m gpu -k "align" tests/test_triton_kernels.py 2>&1 | tail -2
      for a in torch triton torch triton; do
        LAMINA_MOE_ALIGN=$a LAMINA_GDN_PREFILL=fla timeout 200 $L --batch-size 1 1 --input-len 16384 --output-len 2 \
          --max-num-batched-tokens 2048 --output-json /tmp/p16k_$a.json 2>&1 | tail -1
        python3 -c "
import json
for r in json.load(open('/tmp/p16k_$a.json')): print('$a', round(r['ttft_ms'], 1), [round(x, 1) for x in r['first_token_steps_ms']])"
        cp /tmp/p16k_$a.json /tmp/prefill16k_align_$(date +%s)_$a.json
      done
      python3 -c "
import json, glob
json.dump({f.split('/')[-1][:-5]: json.load(open(f)) for f in sorted(glob.glob('/tmp/prefill16k_align_*_*.json'))},
          open('$OUT/prefill16k_align.json', 'w'), indent=1)" ;;
    prefillfig)  # offline throughput 512 x (1024 / 256) at 256 sequences, and the 16k prompt in 2k chunks profiled
      timeout 150 python3 -m lamina.entrypoints.cli bench throughput --dtype bfloat16 --num-prompts 512 --input-len 1024 \
        --output-len 256 --max-num-seqs 256 --output-json $OUT/throughput_512_seqs256.json 2>&1 | tail -1
      LAMINA_GDN_PREFILL=fla timeout 200 python3 benchmarks/profile_decode.py --prefill-len 16384 --chunk 2048 --steps 1 \
        --out $OUT/profile_prefill_16k_chunked.json > /tmp/profile_prefill_16k.txt 2>&1 || tail -20 /tmp/profile_prefill_16k.txt
      python3 -c "
import json; d=json.load(open('$OUT/profile_prefill_16k_chunked.json'))
print({k: d.get(k) for k in ('wall_ms_per_prefill','gpu_kernel_ms_per_step','kernels_per_step')})
for k in sorted(d['top_kernels'], key=lambda r: -r['calls_per_step'])[:30]: print(k['calls_per_step'], round(k['us_per_step'],1), k['name'][:100])" ;;
    preload)  # (session 12, on 4a649b8: both switches were removed after this run, which found them slower)
      # weights read before the PDL wait: the MoE down GEMV (LAMINA_MOE_DOWN_PRELOAD=0: the pipelined kernel; 32 / 64:
      # the preloaded kernel's tile) and the split-K GEMV (LAMINA_GEMV_PRELOAD: blocks), batch-1 decode alternating
      # (moe:gemv = 0:1 today's defaults), then GPU tests of the GEMVs, PDL and the engine with both on
      for i in 1 2; do for p in 0:1 32:1 64:1 0:4 32:4; do
        LAMINA_MOE_DOWN_PRELOAD=${p%:*} LAMINA_GEMV_PRELOAD=${p#*:} LAMINA_GDN_PREFILL=reference timeout 90 $L --batch-size 1 \
          --input-len 128 --output-len 64 --output-json /tmp/latency_preload_${p%:*}_${p#*:}_b1_$i.json 2>&1 | tail -1
      done; done
      merge_latency latency_preload
      LAMINA_MOE_DOWN_PRELOAD=32 LAMINA_GEMV_PRELOAD=4 timeout ${TESTS_TIMEOUT:-200} python3 -m pytest -q -p no:cacheprovider -m gpu \
        --durations=4 -k "gemv or moe or graph or pdl" tests/test_triton_kernels.py tests/test_pdl.py tests/test_gpu_engine.py 2>&1 \
        | grep -v "^$" | tail -8 | cut -c1-200 ;;
    gemvpre)  # (session 12: the switch was removed after this run, which found 2 and 4 slower)
      # the split-K GEMV's weight blocks read before the PDL wait (LAMINA_GEMV_PRELOAD=1 today / 2 / 4), batch-1 decode
      # alternating, then the GEMV and PDL GPU tests at 4
      for i in 1 2; do for p in 1 4 2; do
        LAMINA_GEMV_PRELOAD=$p LAMINA_GDN_PREFILL=reference timeout 90 $L --batch-size 1 --input-len 128 --output-len 64 \
          --output-json /tmp/latency_gemvpre_${p}_b1_$i.json 2>&1 | tail -1
      done; done
      merge_latency latency_gemvpre
      LAMINA_GEMV_PRELOAD=4 timeout ${TESTS_TIMEOUT:-100} python3 -m pytest -q -p no:cacheprovider -m gpu -k "gemv or pdl" \
        tests/test_triton_kernels.py tests/test_pdl.py 2>&1 | grep -v "^$" | tail -4 | cut -c1-200 ;;
    gputests12)  # not yet run: the blocked alignment's GPU tests at EP ranks and 8 / 1,024 local experts, with the engine's
      timeout ${TESTS_TIMEOUT:-300} python3 -m pytest -q -p no:cacheprovider -m gpu --durations=5 -k "align or engine or graph" \
        tests/test_triton_kernels.py tests/test_gpu_engine.py tests/test_batch_invariance.py 2>&1 | grep -v "^$" | tail -10 | cut -c1-200 ;;
    gemvnorm)  # ran on a6956aa (bench_gemv_norm.py removed since): the residual add + RMSNorm in the consuming GEMV's prologue
      timeout 120 python3 benchmarks/bench_gemv_norm.py --out $OUT/bench_gemv_norm.json 2>&1 | tail -8 | cut -c1-400 ;;
    warps13)  # warps per program of the small decode kernels (microbenchmark, batch 1)
      timeout 150 python3 benchmarks/tune_decode_warps.py --out $OUT/tune_decode_warps.json 2>&1 | tail -8 | cut -c1-400 ;;
    ab13)  # batch 1 / 64 decode (128 in / 64 out): this tree against the tree in .baseline (git archive, carried), alternating
      for i in 1 2; do
        (cd .baseline && PYTHONPATH=/tmp/site:$PWD LAMINA_GDN_PREFILL=reference timeout 120 python3 -m lamina.entrypoints.cli bench latency \
          --dtype bfloat16 --batch-size 1 64 --input-len 128 --output-len 64 --output-json /tmp/ab13_base_$i.json 2>&1 | tail -1)
        LAMINA_GDN_PREFILL=reference timeout 120 $L --batch-size 1 64 --input-len 128 --output-len 64 \
          --output-json /tmp/ab13_new_$i.json 2>&1 | tail -1
      done
      merge_latency ab13 ;;
    router13)  # the router both ways (microbenchmark), then batch 1: .baseline, this tree, this tree with LAMINA_GEMV_ROUTE=1, alternating
      timeout 100 python3 benchmarks/tune_decode_warps.py --only router_gemv_then_route,router_gemv_route_epilogue \
        --out $OUT/tune_router_warps.json 2>&1 | tail -3 | cut -c1-400
      for i in 1 2; do
        (cd .baseline && PYTHONPATH=/tmp/site:$PWD LAMINA_GDN_PREFILL=reference timeout 90 python3 -m lamina.entrypoints.cli bench latency \
          --dtype bfloat16 --batch-size 1 --input-len 128 --output-len 64 --output-json /tmp/router13_base_$i.json 2>&1 | tail -1)
        LAMINA_GDN_PREFILL=reference timeout 90 $L --batch-size 1 --input-len 128 --output-len 64 --output-json /tmp/router13_new_$i.json 2>&1 | tail -1
        LAMINA_GEMV_ROUTE=1 LAMINA_GDN_PREFILL=reference timeout 90 $L --batch-size 1 --input-len 128 --output-len 64 \
          --output-json /tmp/router13_new_gemv_route_$i.json 2>&1 | tail -1
      done
      merge_latency router13 ;;
    gputests13)  # the GPU tests of the kernels changed this session (routing, attention, warps) and the engine's graphs
      timeout ${TESTS_TIMEOUT:-240} python3 -m pytest -q -p no:cacheprovider -m gpu --durations=5 tests/test_triton_kernels.py \
        tests/test_gpu_engine.py tests/test_batch_invariance.py tests/test_pdl.py 2>&1 | grep -v "^$" | tail -8 | cut -c1-200 ;;
    gdn13)  # ran on b4f1555 (conv_delta_rule_decode removed since): the conv fused into the delta rule: microbenchmark, batch 1 / 16 / 64 with LAMINA_FUSED_GDN_DECODE=0 and conv (the default)
      # alternating, its GPU tests and the engine's, then the batch-1 step split by kernel (PDL off, so kernel times add up)
      timeout 90 python3 benchmarks/bench_gdn_decode.py --sweep --out $OUT/bench_gdn_decode.json 2>&1 | tail -3 | cut -c1-700
      for i in 1 2; do
        LAMINA_FUSED_GDN_DECODE=0 LAMINA_GDN_PREFILL=reference timeout 120 $L --batch-size 1 16 64 --input-len 128 --output-len 64 \
          --output-json /tmp/gdn13_three_$i.json 2>&1 | tail -1
        LAMINA_GDN_PREFILL=reference timeout 120 $L --batch-size 1 16 64 --input-len 128 --output-len 64 \
          --output-json /tmp/gdn13_conv_$i.json 2>&1 | tail -1
      done
      merge_latency gdn13
      timeout ${TESTS_TIMEOUT:-200} python3 -m pytest -q -p no:cacheprovider -m gpu tests/test_triton_gdn_decode.py \
        tests/test_gpu_engine.py tests/test_batch_invariance.py 2>&1 | grep -v "^$" | tail -4 | cut -c1-200
      LAMINA_PDL=0 LAMINA_GDN_PREFILL=reference timeout 100 python3 benchmarks/profile_decode.py --batch 1 --out $OUT/profile_b1_nopdl.json \
        > $OUT/profile_b1_nopdl.txt 2>&1
      python3 -c "
import json; d=json.load(open('$OUT/profile_b1_nopdl.json'))
print({k: d[k] for k in ('wall_ms_per_step','gpu_kernel_ms_per_step','kernels_per_step')})
for k in d['top_kernels'][:14]: print(round(k['us_per_step'],1), k['calls_per_step'], k['name'][:60])" ;;
    chain13)  # (ran in session 14) router and out_proj GEMV tiles swept in their decode chain
      timeout 150 python3 benchmarks/tune_gemv_chain.py --out $OUT/tune_gemv_chain.json 2>&1 | tail -2 | cut -c1-600 ;;
    stream14)  # how fast a batch-1 GEMV streams by how many programs share it; the MoE down kernel as one program per 16-row tile
      timeout 300 python3 benchmarks/bench_stream_rows.py --out $OUT/bench_stream_rows.json 2>&1 | tail -14 | cut -c1-1500 ;;
    fma14)  # the same work split as plain-load (no tl.dot) GEMVs over more shapes, against lamina's split-K GEMV;
      # the MoE GEMV's fma kernels: tiles, then batch 1 with LAMINA_MOE_GEMV_FMA=0 / 1 alternating, GPU tests with them on
      timeout 200 python3 benchmarks/bench_stream_rows.py --only-fma --out $OUT/bench_stream_rows_fma.json 2>&1 | tail -30 | cut -c1-1500
      for i in 1 2; do for f in 00 10 11; do  # LAMINA_MOE_GEMV_FMA, LAMINA_GEMV_FMA
        LAMINA_MOE_GEMV_FMA=${f:0:1} LAMINA_GEMV_FMA=${f:1:1} LAMINA_GDN_PREFILL=reference timeout 70 $L --batch-size 1 \
          --input-len 128 --output-len 64 --output-json /tmp/latency_fma14_${f}_b1_$i.json 2>&1 | tail -1
      done; done
      merge_latency latency_fma14 ;;
    fma14tests)  # GPU tests with both fma switches on
      LAMINA_MOE_GEMV_FMA=1 LAMINA_GEMV_FMA=1 timeout ${TESTS_TIMEOUT:-200} python3 -m pytest -q -p no:cacheprovider -x \
        -k "moe or gemv or graph or pdl or bf16" tests/test_triton_kernels.py tests/test_pdl.py tests/test_gpu_engine.py 2>&1 \
        | grep -v "^$" | tail -6 | cut -c1-200 ;;
    gemvfma14)  # (run 3 of session 14, on ffc9073: FMA tiles of 4 features a program, 1 at <= 512 rows) batch 1 with LAMINA_GEMV_FMA=0 / 1 alternating, then GPU tests with it on
      for i in 1 2; do for f in 0 1; do
        LAMINA_GEMV_FMA=$f LAMINA_GDN_PREFILL=reference timeout 70 $L --batch-size 1 --input-len 128 --output-len 64 \
          --output-json $OUT/latency_gemvfma14_${f}_b1_$i.json 2>&1 | tail -1
      done; done
      LAMINA_GEMV_FMA=1 timeout 260 python3 -m pytest -q -p no:cacheprovider -x -k "gemv or graph or pdl or bf16 or engine" \
        tests/test_triton_kernels.py tests/test_pdl.py tests/test_gpu_engine.py tests/test_batch_invariance.py 2>&1 \
        | grep -v "^$" | tail -6 | cut -c1-300 ;;
    fma14b)  # (run 4 of session 14) batch 1: split-K GEMV + dot MoE, FMA GEMV (this tree's tiles) + dot MoE, split-K GEMV + FMA MoE
      for f in 00 10 01; do  # LAMINA_GEMV_FMA, LAMINA_MOE_GEMV_FMA
        LAMINA_GEMV_FMA=${f:0:1} LAMINA_MOE_GEMV_FMA=${f:1:1} LAMINA_GDN_PREFILL=reference timeout 70 $L --batch-size 1 \
          --input-len 128 --output-len 64 --output-json $OUT/latency_fma14b_gemv${f:0:1}_moe${f:1:1}_b1.json 2>&1 | tail -1
      done ;;
    kernelsall)  # ran in session 14 (124 passed): every test of the kernel files on the GPU, not only the gpu-marked ones (e.g. gemv_route
      # against the routing kernel at float32 rounding, which CI runs under the interpreter only)
      timeout ${TESTS_TIMEOUT:-400} python3 -m pytest -q -p no:cacheprovider tests/test_triton_kernels.py tests/test_triton_router.py \
        tests/test_triton_gdn_decode.py tests/test_pdl.py 2>&1 | grep -v "^$" | tail -8 | cut -c1-200 ;;
    ab15)  # (session 15) batch 1 / 2 / 4 with LAMINA_GEMV_FMA=0 / 1 alternating; batch 1 with the MoE FMA kernels on top;
      # MTP K=1..3 step costs with LAMINA_GEMV_FMA=0 / 1
      for i in 1 2; do for f in 0 1; do
        LAMINA_GEMV_FMA=$f LAMINA_GDN_PREFILL=reference timeout 100 $L --batch-size 1 2 4 --input-len 128 --output-len 64 \
          --output-json /tmp/ab15_gemv${f}_$i.json 2>&1 | tail -1
      done
        LAMINA_MOE_GEMV_FMA=1 LAMINA_GDN_PREFILL=reference timeout 70 $L --batch-size 1 --input-len 128 --output-len 64 \
          --output-json /tmp/ab15_gemv1_moefma_$i.json 2>&1 | tail -1
      done
      merge_latency ab15
      for f in 0 1; do
        LAMINA_GEMV_FMA=$f timeout 100 python3 benchmarks/bench_mtp.py --layers 40 --new-tokens 64 --batches 1 \
          --out $OUT/mtp15_gemv$f.json 2>&1 | tail -5 | cut -c1-300
      done ;;
    ab15b)  # (session 15) batch 1 / 2 / 4: split-K GEMV, the FMA GEMV with one weight load for all rows, the same with the
      # first 512 / 2,048 input features' weights read before the PDL wait, alternating; then the MoE FMA kernels on
      # top, and MTP K=1..3 step costs on the FMA GEMV
      for i in 1 2; do for v in 0:0 1:0 1:512 1:2048; do  # LAMINA_GEMV_FMA:LAMINA_GEMV_FMA_PRELOAD
        LAMINA_GEMV_FMA=${v%:*} LAMINA_GEMV_FMA_PRELOAD=${v#*:} LAMINA_GDN_PREFILL=reference timeout 100 $L --batch-size 1 2 4 \
          --input-len 128 --output-len 64 --output-json /tmp/ab15b_gemv${v%:*}_pre${v#*:}_$i.json 2>&1 | tail -1
      done; done
      LAMINA_MOE_GEMV_FMA=1 LAMINA_GDN_PREFILL=reference timeout 100 $L --batch-size 1 2 4 --input-len 128 --output-len 64 \
        --output-json /tmp/ab15b_gemv1_pre0_moefma.json 2>&1 | tail -1
      merge_latency ab15b
      timeout 100 python3 benchmarks/bench_mtp.py --layers 40 --new-tokens 64 --batches 1 \
        --out $OUT/mtp15b.json 2>&1 | tail -5 | cut -c1-300 ;;
    rows15)  # (session 15) batch 1-4 decode: the split-K GEMV everywhere (LAMINA_GEMV_FMA=0) against the default (FMA at
      # 1-2 rows, split-K at 3-4), alternating; the GEMV GPU tests; MTP K=1..3 step costs on the default
      timeout 60 python3 -m pytest -q -x -p no:cacheprovider tests/test_triton_kernels.py -k "gemv" 2>&1 | tail -2
      for i in $(seq ${ROUNDS:-2}); do for f in 0 1; do
        LAMINA_GEMV_FMA=$f LAMINA_GDN_PREFILL=reference timeout 100 $L --batch-size 1 2 3 4 --input-len 128 --output-len 64 \
          --output-json $OUT/rows15_gemv${f}_$i.json 2>&1 | tail -1
      done; done
      cp $OUT/rows15_*.json /tmp/ && merge_latency rows15
      timeout 100 python3 benchmarks/bench_mtp.py --layers 40 --new-tokens 64 --batches 1 \
        --out $OUT/mtp15_rows.json 2>&1 | tail -5 | cut -c1-250 ;;
    gemvrows16)  # (written in session 15, not yet run) the dense decode GEMV at 3 and 4 rows: default (split-K) against
      # FMA tiles of 1-16 features a program (benchmarks/bench_gemv_rows.py), then batch 1 / 4 with the MoE FMA kernels on
      # and off on today's dense GEMV, alternating
      timeout 300 python3 benchmarks/bench_gemv_rows.py --rows 3,4 --out $OUT/bench_gemv_rows.json 2>&1 | tail -10 | cut -c1-400
      for i in 1 2; do for m in 0 1; do
        LAMINA_MOE_GEMV_FMA=$m LAMINA_GDN_PREFILL=reference timeout 90 $L --batch-size 1 4 --input-len 128 --output-len 64 \
          --output-json /tmp/moefma16_moe${m}_$i.json 2>&1 | tail -1
      done; done
      merge_latency moefma16 ;;
    tests15)  # (session 15) every test of the kernel files on the GPU, then the gpu-marked engine, graph and batch-invariance tests
      timeout ${TESTS_TIMEOUT:-300} python3 -m pytest -q -p no:cacheprovider tests/test_triton_kernels.py tests/test_triton_router.py \
        tests/test_triton_gdn_decode.py tests/test_pdl.py 2>&1 | grep -v "^$" | tail -5 | cut -c1-200
      timeout ${TESTS_TIMEOUT:-240} python3 -m pytest -q -p no:cacheprovider -m gpu --durations=5 tests/test_gpu_engine.py \
        tests/test_batch_invariance.py 2>&1 | grep -v "^$" | tail -8 | cut -c1-200 ;;
    gemvrows16b)  # (session 16) the router and out_proj GEMVs at 1-2 rows: today's tiles against FMA tiles (is one tile
      # at 1-4 rows as fast?), then the batch-1 profile of this tree
      timeout 150 python3 benchmarks/bench_gemv_rows.py --rows 1,2 --shapes router,out_proj --out $OUT/bench_gemv_rows12.json 2>&1 | tail -4 | cut -c1-600 ;;
    ab16)  # (session 16) batch 1 / 2 / 4 decode: the tree in .baseline (git archive of the session's start, carried), this
      # tree with the MoE FMA kernels off (the dense GEMV tiles alone), this tree (MoE FMA for one token), alternating
      for i in $(seq ${ROUNDS:-2}); do
        (cd .baseline && PYTHONPATH=/tmp/site:$PWD LAMINA_GDN_PREFILL=reference timeout 100 $L --batch-size 1 2 4 --input-len 128 \
          --output-len 64 --output-json /tmp/ab16_base_$i.json 2>&1 | tail -1)
        LAMINA_MOE_GEMV_FMA=0 LAMINA_GDN_PREFILL=reference timeout 100 $L --batch-size 1 2 4 --input-len 128 --output-len 64 \
          --output-json /tmp/ab16_new_moedot_$i.json 2>&1 | tail -1
        LAMINA_GDN_PREFILL=reference timeout 100 $L --batch-size 1 2 4 --input-len 128 --output-len 64 \
          --output-json /tmp/ab16_new_$i.json 2>&1 | tail -1
      done
      merge_latency ab16 ;;
    outproj16)  # (session 16) batch 1 decode: this tree against .baseline2 (this tree with session 15's one-row out_proj
      # tile: 1 feature a program, preload 512), alternating
      for i in $(seq ${ROUNDS:-3}); do
        (cd .baseline2 && PYTHONPATH=/tmp/site:$PWD LAMINA_GDN_PREFILL=reference timeout 60 $L --batch-size 1 --input-len 128 \
          --output-len 64 --output-json /tmp/outproj16_oldtile_$i.json 2>&1 | tail -1)
        LAMINA_GDN_PREFILL=reference timeout 60 $L --batch-size 1 --input-len 128 --output-len 64 \
          --output-json /tmp/outproj16_new_$i.json 2>&1 | tail -1
      done
      merge_latency outproj16 ;;
    sharedpre16)  # (ran in session 16 on a change since reverted: slower) the MoE FMA kernels reading the shared expert's
      # weights before the PDL wait (its gate/up rows first in the grid): their GPU tests, batch 1 against .baseline
      # (9a31bf7) alternating, the engine's GPU tests
      timeout 60 python3 -m pytest -q -x -p no:cacheprovider tests/test_triton_kernels.py -k "moe" 2>&1 | tail -1
      ab_b1 sharedpre16 ${ROUNDS:-2}
      timeout 150 python3 -m pytest -q -p no:cacheprovider -m gpu tests/test_gpu_engine.py tests/test_batch_invariance.py 2>&1 | tail -1 ;;
    downacc17)  # the MoE FMA down kernel with one accumulator over the slots (no per-slot reduction between their
      # loads): its GPU tests, batch 1 against .baseline (HEAD) alternating, its own time without PDL, the engine's GPU tests
      timeout 60 python3 -m pytest -q -x -p no:cacheprovider tests/test_triton_kernels.py -k "moe" 2>&1 | tail -1
      ab_b1 downacc17 ${ROUNDS:-3}
      LAMINA_PDL=0 LAMINA_GDN_PREFILL=reference timeout 100 python3 benchmarks/profile_decode.py --batch 1 \
        --out $OUT/profile_b1_pdl0_downacc17.json > $OUT/profile_b1_pdl0_downacc17.txt 2>&1
      python3 -c "
import json; d=json.load(open('$OUT/profile_b1_pdl0_downacc17.json'))
print({k: d[k] for k in ('wall_ms_per_step','gpu_kernel_ms_per_step','kernels_per_step')})
for k in d['top_kernels'][:6]: print(round(k['us_per_step'],1), k['calls_per_step'], k['name'][:80])"
      timeout 150 python3 -m pytest -q -p no:cacheprovider -m gpu tests/test_gpu_engine.py tests/test_batch_invariance.py 2>&1 | tail -1 ;;
    fmarows17)  # the MoE FMA kernels (one-accumulator down) at 2-4 tokens: LAMINA_MOE_GEMV_FMA=1 against the default
      # (tl.dot kernels from 2 tokens) alternating; the MoE kernel GPU tests in full; batch 1 against transformers
      timeout 240 python3 -m pytest -q -p no:cacheprovider tests/test_triton_kernels.py -k "moe" 2>&1 | tail -1
      for i in $(seq ${ROUNDS:-2}); do
        for b in 2 3 4; do
          LAMINA_GDN_PREFILL=reference timeout 60 $L --batch-size $b --input-len 128 --output-len 64 \
            --output-json /tmp/fmarows17_b${b}_default_$i.json 2>&1 | tail -1
          LAMINA_MOE_GEMV_FMA=1 LAMINA_GDN_PREFILL=reference timeout 60 $L --batch-size $b --input-len 128 --output-len 64 \
            --output-json /tmp/fmarows17_b${b}_fma_$i.json 2>&1 | tail -1
        done
      done
      merge_latency fmarows17
      LAMINA_GDN_PREFILL=reference timeout 200 $L --batch-size 1 --input-len 128 --output-len 32 --compare transformers \
        --output-json $OUT/compare_transformers_b1_session17.json 2>&1 | tail -3 ;;
    final17)  # the MoE FMA kernels at every decode token count (the default since session 17): batch 1-4 latency,
      # the engine's GPU tests (graphs against eager, bf16 against fp32, batch invariance), the PDL chain test
      for b in 1 2 4 1; do
        LAMINA_GDN_PREFILL=reference timeout 60 $L --batch-size $b --input-len 128 --output-len 64 \
          --output-json /tmp/final17_b${b}_$RANDOM.json 2>&1 | tail -1
      done
      merge_latency final17
      timeout 200 python3 -m pytest -q -p no:cacheprovider -m gpu tests/test_gpu_engine.py tests/test_batch_invariance.py \
        tests/test_pdl.py 2>&1 | tail -1 ;;
    timeline19)  # batch-1 steps on the device's timeline (bench_mtp --timeline): plain decode, MTP k = 0 and k = 1,
      # with PDL off, then on; per step: wall, device busy / idle, the largest idle gaps and the host labels they waited on
      for pdl in 0 1; do
        LAMINA_PDL=$pdl timeout 240 python3 benchmarks/bench_mtp.py --layers 40 --new-tokens 32 --batches 1 --max-k 1 \
          --profile-dir /tmp/tl$pdl --timeline --out /tmp/tl_rows$pdl.json > /tmp/tl$pdl.log 2>&1
        grep -v '^{"mode' /tmp/tl$pdl.log | grep -v "^USDT\|^after releasing" | tail -45 | cut -c1-330
      done
      python3 -c "
import json, glob
out = {f.split('/')[-2] + '_' + f.split('/')[-1].split('.')[0]: json.load(open(f)) for f in sorted(glob.glob('/tmp/tl[01]/*.timeline.json'))}
out['rows'] = {p: json.load(open(f'/tmp/tl_rows{p}.json'))['rows'] for p in '01' if glob.glob(f'/tmp/tl_rows{p}.json')}
json.dump(out, open('$OUT/timeline19.json', 'w'), indent=1)" ;;
    launch19)  # host cost of CUDA graph replays (cudaGraphLaunch) by what the graph holds, and of the engine's batch-1
      # decode and MTP verification graphs (40 layers)
      timeout 200 python3 benchmarks/bench_graph_launch.py --engine-layers 40 --nodes ${LAUNCH_NODES:-1,100,500,1000} --out $OUT/bench_graph_launch.json 2>&1 \
        | grep "^{\|Error" | cut -c1-300 ;;
    gputests19)  # this session's MTP prologue changes (state rows, capture, commit) and the engine's graphs on the GPU
      timeout 150 python3 -m pytest -q -p no:cacheprovider tests/test_triton_state_rows.py tests/test_mtp_states.py \
        tests/test_mtp_triton.py tests/test_triton_verify_kernels.py 2>&1 | tail -2
      timeout ${TESTS_TIMEOUT:-200} python3 -m pytest -q -p no:cacheprovider -m gpu --durations=6 tests/test_gpu_engine.py \
        tests/test_batch_invariance.py tests/test_pdl.py tests/test_qwen4_graphs.py tests/test_triton_gdn_decode.py \
        tests/test_triton_router.py 2>&1 | grep -v "^$" | tail -12 | cut -c1-200 ;;
    gpuall19)  # every GPU-marked test file (test_multirank_graphs skips on one GPU; the server modules need openai, absent there)
      timeout ${TESTS_TIMEOUT:-420} python3 -m pytest -q -p no:cacheprovider -m gpu --continue-on-collection-errors --durations=8 tests/ 2>&1 \
        | grep -v "^$" | tail -25 | cut -c1-220 ;;
    host20)  # (written in session 20, not yet run) session 20's host-path changes on the GPU: .baseline (carried: git
      # archive of e4548f2's lamina/) against this tree, alternating: MTP K = 0 / 1 at batch 1 and 8 (bench_mtp), and
      # plain decode latency at batch 1 / 64 / 256
      for i in $(seq ${ROUNDS:-2}); do
        for tree in base new; do
          root=$PWD; [ $tree = base ] && root=$PWD/.baseline
          PYTHONPATH=/tmp/site:$root timeout 150 python3 benchmarks/bench_mtp.py --layers 40 --new-tokens 64 --batches 1,8 \
            --max-k 1 --out /tmp/host20_mtp_${tree}_$i.json > /tmp/host20_mtp_${tree}_$i.log 2>&1 || tail -5 /tmp/host20_mtp_${tree}_$i.log
          (cd $root && PYTHONPATH=/tmp/site:$root LAMINA_GDN_PREFILL=reference timeout 150 $L --batch-size 1 64 256 \
            --input-len 128 --output-len 64 --output-json /tmp/host20_lat_${tree}_$i.json 2>&1 | tail -1)
        done
      done
      python3 -c "
import json, glob
out = {f.split('/')[-1][:-5]: json.load(open(f)) for f in sorted(glob.glob('/tmp/host20_*.json'))}
json.dump(out, open('$OUT/host20.json', 'w'), indent=1)
for k, v in out.items():
    rows = v['rows'] if isinstance(v, dict) and 'rows' in v else (v if isinstance(v, list) else [v])
    for r in rows: print(k, r.get('batch', r.get('batch_size')), r.get('mode'), r.get('k'), r.get('median_step_ms', r.get('tpot_ms')))" ;;
    mtpasync21)  # (written in session 21, not yet run) MTP with asynchronous scheduling against without, in one process
      # (bench_mtp --with-async: modes alternating over 2 rounds, async steps timed without a device sync), then its
      # GPU tests (real CUDA graphs: tokens equal to the synchronous run's and plain decoding's)
      timeout 420 python3 benchmarks/bench_mtp.py --layers 40 --new-tokens 64 --batches 1,8 --max-k 3 --rounds 2 \
        --with-async --out $OUT/mtp_async.json > /tmp/mtp_async.log 2>&1 || tail -25 /tmp/mtp_async.log | cut -c1-300
      python3 -c "
import json; d=json.load(open('$OUT/mtp_async.json'))
for r in d['rows']: print(r['batch'], r['mode'], r['k'], round(r['median_step_ms'], 3), r.get('identical_to_plain'), r.get('added_ms_vs_k0'))"
      timeout 150 python3 -m pytest -q -p no:cacheprovider tests/test_mtp_async.py tests/test_triton_state_rows.py 2>&1 | tail -3 ;;
    tests23)  # session 23 in one call: the tests of what sessions 20-23 changed on the GPU (every test of the MTP
      # planned-ahead files, compiled rather than interpreted; the GPU-marked engine, demo-model and MTP tests)
      timeout ${TESTS_TIMEOUT:-260} python3 -m pytest -q -p no:cacheprovider tests/test_triton_pending_fill.py tests/test_mtp_async.py \
        tests/test_triton_state_rows.py tests/test_async_scheduling.py 2>&1 | grep -v "^$" | tail -6 | cut -c1-220
      timeout ${TESTS_TIMEOUT:-260} python3 -m pytest -q -p no:cacheprovider -m gpu --durations=5 tests/test_gpu_engine.py \
        tests/test_demo_model.py tests/test_batch_invariance.py tests/test_mtp_triton.py 2>&1 | grep -v "^$" | tail -14 | cut -c1-220 ;;
    seeded25)  # session 25: seeded noise (a hash of seed, output index, token id; torch reference and session 26's
      # Triton kernel) against the global RNG and the per-row generator loop it replaced, the sampler seeded or not,
      # a host-sync check, the kernel's tests on the GPU; then the GPU tests
      timeout 240 python3 benchmarks/bench_seeded_noise.py --out $OUT/seeded_noise.json 2>&1 | tail -40 | cut -c1-300
      timeout 120 python3 -m pytest -q -p no:cacheprovider tests/test_triton_sampler_kernels.py 2>&1 | grep -v "^$" | tail -6 | cut -c1-220
      timeout ${TESTS_TIMEOUT:-420} python3 -m pytest -q -p no:cacheprovider -m gpu --continue-on-collection-errors \
        --durations=8 tests/ 2>&1 | grep -v "^$" | tail -25 | cut -c1-220 ;;
    s28a)  # session 28: the varlen attention kernel's launch order (longest query block first, against each head's
      # blocks from the first) at fresh 8k / 8 x 1k / continued / mixed steps; an 8k prompt's and eight 1k prompts' TTFT
      # with fresh prompts on SDPA's causal rule or on the varlen kernel (LAMINA_FRESH_PROMPT_ATTENTION), alternating
      timeout 150 python3 benchmarks/bench_varlen_attention.py --out $OUT/bench_varlen_attention.json 2>&1 | tail -8 \
        | cut -c1-400
      for i in 1 2; do for m in sdpa varlen; do
        LAMINA_FRESH_PROMPT_ATTENTION=$m timeout 70 $L --batch-size 1 --input-len 8192 --output-len 2 \
          --max-num-batched-tokens 8192 --output-json $OUT/s28_prefill8k_${m}_$i.json > /tmp/s28_p.log 2>&1
        LAMINA_FRESH_PROMPT_ATTENTION=$m timeout 70 $L --batch-size 8 --input-len 1024 --output-len 2 \
          --max-num-batched-tokens 8192 --output-json $OUT/s28_prefill8x1k_${m}_$i.json >> /tmp/s28_p.log 2>&1
        python3 -c "
import json
for n in ('8k', '8x1k'):
    r = json.load(open('$OUT/s28_prefill' + n + '_${m}_$i.json')); r = r[0] if isinstance(r, list) else r
    print('$m', n, r['ttft_ms'])" || tail -3 /tmp/s28_p.log
      done; done ;;
    s28m)  # session 28 in one call: the prefill MoE's parts in x's dtype, weighted in the slot sum (this tree) against
      # float32 weighted parts (.baseline: git archive of 0f836e3's lamina/ and this bench script), kernels then an 8k
      # prompt's TTFT alternating; the varlen attention's launch order; fresh prompts on the varlen kernel (8k, 8 x 1k)
      for tree in base new; do
        root=$PWD; [ $tree = base ] && root=$PWD/.baseline
        (cd $root && PYTHONPATH=/tmp/site:$root timeout 120 python3 benchmarks/bench_moe_prefill.py --quick \
          --tokens 1024,8192 --out $OUT/moe_parts_$tree.json 2>&1 | grep -E "tokens|default|grouped" | cut -c1-200)
      done
      for i in 1 2; do for tree in base new; do
        root=$PWD; [ $tree = base ] && root=$PWD/.baseline
        (cd $root && PYTHONPATH=/tmp/site:$root timeout 60 $L --batch-size 1 --input-len 8192 --output-len 2 \
          --max-num-batched-tokens 8192 --output-json $OUT/s28_ttft8k_${tree}_$i.json > /tmp/s28_t.log 2>&1)
        python3 -c "import json; r=json.load(open('$OUT/s28_ttft8k_${tree}_$i.json')); r=r[0] if isinstance(r, list) else r; print('$tree 8k', r['ttft_ms'])" \
          || tail -3 /tmp/s28_t.log
      done; done
      timeout 100 python3 benchmarks/bench_varlen_attention.py --out $OUT/bench_varlen_attention.json 2>&1 | tail -6 \
        | cut -c1-420
      for m in varlen sdpa; do
        LAMINA_FRESH_PROMPT_ATTENTION=$m timeout 60 $L --batch-size 1 --input-len 8192 --output-len 2 \
          --max-num-batched-tokens 8192 --output-json $OUT/s28_fresh8k_$m.json > /tmp/s28_p.log 2>&1
        LAMINA_FRESH_PROMPT_ATTENTION=$m timeout 60 $L --batch-size 8 --input-len 1024 --output-len 2 \
          --max-num-batched-tokens 8192 --output-json $OUT/s28_fresh8x1k_$m.json >> /tmp/s28_p.log 2>&1
        python3 -c "
import json
for n in ('8k', '8x1k'):
    r = json.load(open('$OUT/s28_fresh' + n + '_$m.json')); r = r[0] if isinstance(r, list) else r
    print('fresh on $m', n, r['ttft_ms'])" || tail -3 /tmp/s28_p.log
      done ;;
    s28g)  # session 28, short: this session's kernels on the GPU (every test of test_triton_kernels compiled, the
      # request-group plans and attention paths), then the engine's GPU tests (graphs against eager, bf16 against fp32
      # CPU for every family, batch invariance)
      timeout ${TESTS_TIMEOUT:-200} python3 -m pytest -q -p no:cacheprovider tests/test_triton_kernels.py \
        tests/test_request_groups.py 2>&1 | grep -v "^$" | tail -6 | cut -c1-220
      timeout ${TESTS_TIMEOUT:-200} python3 -m pytest -q -p no:cacheprovider -m gpu --durations=5 tests/test_gpu_engine.py \
        tests/test_batch_invariance.py tests/test_sampler.py 2>&1 | grep -v "^$" | tail -10 | cut -c1-220 ;;
    s28c)  # session 28 in one short call: the prefill MoE's parts against .baseline's (bench_moe_prefill --quick at 8k
      # from each tree, an 8k prompt's TTFT from each), the varlen attention's launch order, then part s28g's tests
      for tree in base new; do
        root=$PWD; [ $tree = base ] && root=$PWD/.baseline
        (cd $root && PYTHONPATH=/tmp/site:$root timeout 75 python3 benchmarks/bench_moe_prefill.py --quick \
          --tokens 8192 --out $OUT/moe_parts_$tree.json 2>&1 | grep -E "tokens|default|grouped" | cut -c1-200)
        (cd $root && PYTHONPATH=/tmp/site:$root timeout 50 $L --batch-size 1 --input-len 8192 --output-len 2 \
          --max-num-batched-tokens 8192 --output-json $OUT/s28_ttft8k_$tree.json > /tmp/s28_t.log 2>&1)
        python3 -c "import json; r=json.load(open('$OUT/s28_ttft8k_$tree.json')); r=r[0] if isinstance(r, list) else r; print('$tree 8k', r['ttft_ms'])" \
          || tail -3 /tmp/s28_t.log
      done
      timeout 60 python3 benchmarks/bench_varlen_attention.py --out $OUT/bench_varlen_attention.json 2>&1 | tail -6 \
        | cut -c1-420
      TESTS_TIMEOUT=130 bash $0 s28g ;;
    s29)  # session 29 in one call: the GPU tests that cover the engine's default paths first (bf16 against fp32 CPU
      # for every family, graphs against eager, MTP and Qwen4 graphs, fla prefill in the engine, the real-width MoE
      # and prefill attention), one line per test in $OUT/s29_tests.log; then an 8k prompt's and eight 1k prompts'
      # TTFT with fresh prompts on the varlen kernel or on SDPA's causal rule, alternating
      timeout ${TESTS_TIMEOUT:-280} python3 -m pytest -v -p no:cacheprovider -m gpu --timeout=150 \
        tests/test_gpu_engine.py tests/test_gdn_prefill.py::test_engine_greedy_with_fla_prefill tests/test_mtp_triton.py \
        tests/test_qwen4_graphs.py tests/test_sampler.py tests/test_batch_invariance.py \
        tests/test_triton_kernels.py tests/test_kernels.py > $OUT/s29_tests.log 2>&1
      grep -E "PASSED|FAILED|ERROR|passed|failed" $OUT/s29_tests.log | sed 's/ *\[ *[0-9]*%\]//' | cut -c1-150
      for i in $(seq ${S29_ROUNDS:-2}); do for m in varlen sdpa; do
        LAMINA_FRESH_PROMPT_ATTENTION=$m timeout 90 $L --batch-size 1 --input-len 8192 --output-len 2 \
          --max-num-batched-tokens 8192 --output-json /tmp/s29_ttft8k_${m}_$i.json > /tmp/s29_p.log 2>&1
        LAMINA_FRESH_PROMPT_ATTENTION=$m timeout 60 $L --batch-size 8 --input-len 1024 --output-len 2 \
          --max-num-batched-tokens 8192 --output-json /tmp/s29_ttft8x1k_${m}_$i.json >> /tmp/s29_p.log 2>&1
        python3 -c "
import json
for n in ('8k', '8x1k'):
    r = json.load(open('/tmp/s29_ttft' + n + '_${m}_$i.json')); r = r[0] if isinstance(r, list) else r
    print('$m', n, round(r['ttft_ms'], 2))" || tail -3 /tmp/s29_p.log
      done; done
      python3 -c "
import json, glob
json.dump({f.split('/')[-1][:-5]: json.load(open(f)) for f in sorted(glob.glob('/tmp/s29_ttft*.json'))},
          open('$OUT/s29_ttft.json', 'w'), indent=1)" ;;
    ttftab)  # fresh prompts on the varlen kernel against SDPA's causal rule, TTFT in one process, rounds alternating
      # (bench_ttft_ab.py: one model load, the attention layers' attribute switched between rounds)
      timeout ${AB_TIMEOUT:-300} python3 benchmarks/bench_ttft_ab.py --attr fresh_prompt_varlen --values True,False \
        --batch-size 1,8 --input-len 8192,1024 --rounds ${AB_ROUNDS:-8} --out $OUT/ttft_ab_fresh_varlen.json 2>&1 \
        | grep -v Warning | tail -4 ;;
    s31)  # next session, one call: the memory plan's lowered default on this GPU (memory_peak with the engine's default
      # max_num_seqs: no out-of-memory, the peaks inside the headroom), offline throughput at the default, the
      # memory plan's and MTP's GPU tests; then on two GPUs the TP2 / PP2 graphs, on an H200 batch 1 against transformers
      timeout 200 python3 benchmarks/memory_peak.py --max-num-seqs 0 --out $OUT/memory_peak_default.json 2>&1 \
        | grep -v Warn | tail -26 | cut -c1-400
      timeout 150 python3 -m lamina.entrypoints.cli bench throughput --dtype bfloat16 --num-prompts 512 --input-len 1024 \
        --output-len 256 --output-json $OUT/throughput_512x1024x256_default.json 2>&1 | grep -v Warn | tail -4
      timeout 240 python3 -m pytest -q -p no:cacheprovider -m gpu tests/test_gpu_engine.py tests/test_mtp_triton.py \
        tests/test_qwen4_graphs.py 2>&1 | tail -4  # the start-up path since session 30's memory plan
      if [ "$(python3 -c 'import torch; print(torch.cuda.device_count())')" -ge 2 ]; then bash $0 tp2graphs; fi
      if python3 -c "import torch, sys; sys.exit('H200' not in torch.cuda.get_device_name())"; then bash $0 compare25; fi ;;
    s33)  # next session, one call: the FP8 grouped kernels' dequantize-before-dot form (fp8_scale_b 1, session 32's
      # last change, compiled on no GPU yet) under its tests, its prefill against bf16 and the default form, an 8k
      # prompt's TTFT bf16 / FP8 (fla warmed by a first run), then on two GPUs the TP2 / PP2 graphs, on an H200
      # batch 1 against transformers
      timeout 120 python3 -m pytest -q -p no:cacheprovider tests/test_triton_fp8_moe.py 2>&1 | tail -2
      timeout 150 python3 -m pytest -q -p no:cacheprovider -m gpu tests/test_fp8_experts.py 2>&1 | tail -2
      timeout 120 python3 benchmarks/bench_moe_prefill_fp8.py --out $OUT/bench_moe_prefill_fp8.json 2>&1 | grep -v Warn | tail -2
      for q in none none fp8 none fp8; do
        timeout 120 $L --batch-size 1 --input-len 8192 --output-len 2 --max-num-batched-tokens 8192 --quantization $q \
          --output-json /tmp/ttft8k_$q.json 2>&1 | grep "^| 1 "
      done
      if [ "$(python3 -c 'import torch; print(torch.cuda.device_count())')" -ge 2 ]; then bash $0 tp2graphs; fi
      if python3 -c "import torch, sys; sys.exit('H200' not in torch.cuda.get_device_name())"; then bash $0 compare25; fi ;;
    s33b)  # session 33: the FP8 grouped kernels' default flipped to the dequantize-before-dot form: its tests compiled,
      # the engine's FP8 GPU test, the forms at decode and prefill sizes, the prefill tiles swept for them (at
      # 8675752 the swapped-operand form too), an 8k prompt's TTFT bf16 / FP8 alternating, then
      # FP8 latency at batch 16 / 64 (their decode tiles are grouped too; batch 1 runs the GEMVs), .baseline (the old
      # form) against this tree, alternating, two rounds
      timeout 120 python3 -m pytest -q -p no:cacheprovider tests/test_triton_fp8_moe.py 2>&1 | tail -2
      timeout 150 python3 -m pytest -q -p no:cacheprovider -m gpu tests/test_fp8_experts.py 2>&1 | tail -2
      timeout 240 python3 benchmarks/bench_moe_prefill_fp8.py --tokens 16,64,2048,8192 --sweep \
        --out $OUT/bench_moe_prefill_fp8_sweep.json 2>&1 | grep -v Warn | tail -4 | cut -c1-3000
      ttft8k_fp8_ab ttft8kb
      for i in 1 2; do
        (cd .baseline && PYTHONPATH=/tmp/site:$PWD LAMINA_GDN_PREFILL=reference timeout 80 $L --batch-size 16 64 \
          --input-len 128 --output-len 64 --quantization fp8 --output-json /tmp/fp8form_base_$i.json 2>&1 | tail -1)
        LAMINA_GDN_PREFILL=reference timeout 80 $L --batch-size 16 64 --input-len 128 --output-len 64 --quantization fp8 \
          --output-json /tmp/fp8form_new_$i.json 2>&1 | tail -1
      done
      merge_latency fp8form ;;
    s33c)  # session 33: the FP8 prefill tiles (from part s33b's sweep): the kernel tests compiled, both forms against
      # bf16 at 2,048 / 8,192 tokens, an 8k prompt's TTFT bf16 / FP8 alternating
      timeout 100 python3 -m pytest -q -p no:cacheprovider tests/test_triton_fp8_moe.py 2>&1 | tail -2
      timeout 100 python3 benchmarks/bench_moe_prefill_fp8.py --out $OUT/bench_moe_prefill_fp8_tiles.json 2>&1 \
        | grep -v Warn | tail -2 | cut -c1-800
      ttft8k_fp8_ab ttft8kc ;;
    s34)  # session 34: the grouped MoE tiles fitted to the GPU's shared memory (its GPU test: a real refusal),
      # the Triton kernel tests on the GPU, then part s33c (FP8 prefill tiles end to end)
      timeout 150 python3 -m pytest -q -p no:cacheprovider -m gpu tests/test_tile_fit.py tests/test_triton_kernels.py \
        tests/test_fp8_experts.py 2>&1 | tail -3
      bash $0 s33c ;;
    s37b)  # part s37's rest: the online quantizer's scales divided by a tensor (bits = the CPU's), the kernel
      # tests the 120 s limit cut (real-width MoE, the FP8 KV kernels)
      timeout 100 python3 -m pytest -v -p no:cacheprovider -m gpu tests/test_fp8_online.py > $OUT/s37b_online.txt 2>&1
      tail -3 $OUT/s37b_online.txt
      timeout 150 python3 -m pytest -v -p no:cacheprovider tests/test_fp8_kv_cache_kernels.py tests/test_triton_kernels.py \
        -k "fp8_caches or writers or stored_values or real_width" > $OUT/s37b_kernels.txt 2>&1
      tail -3 $OUT/s37b_kernels.txt ;;
    s41v)  # session 41: verification attention in row tiles of <= 32 rows (every row = plain decode bit for bit).
      # The new tree is .baseline (git archive HEAD, carried) with this session's files laid over it, so that other
      # uncommitted work in the checkout does not ride along. Its GPU tests (rows equal the one-token kernel: GROUP 8
      # at Q = 2 / 4 / 5, GROUP 16 at Q = 3 / 4, bf16 / FP8 caches; then the decode / verify kernels against the
      # reference), the kernel timed against .baseline at GROUP 8 and 16, the per-kernel profile of an MTP K = 2 step
      N=/tmp/s41new; rm -rf $N && cp -r .baseline $N
      cp lamina/kernels/triton_decode.py $N/lamina/kernels/ && cp tests/test_triton_verify_kernels.py $N/tests/
      cp benchmarks/bench_verify_attention.py benchmarks/profile_decode.py $N/benchmarks/
      (cd $N && export PYTHONPATH=/tmp/site:$N
       timeout 90 python3 -m pytest -v -p no:cacheprovider -m gpu tests/test_triton_verify_kernels.py > $OUT/s41_verify_tests.txt 2>&1
       timeout 80 python3 -m pytest -v -p no:cacheprovider tests/test_triton_verify_kernels.py tests/test_fp8_kv_cache_kernels.py \
         tests/test_triton_kernels.py -m "not gpu" -k "paged_decode or paged_verify or one_token or decode_prefill_and_verify" \
         >> $OUT/s41_verify_tests.txt 2>&1)
      grep -E "FAILED|ERROR|passed|failed" $OUT/s41_verify_tests.txt | tail -12
      for g in "g8 --queries 1 2 4 5" "g16 --queries 1 3 4 --q-heads 32"; do for tree in new base; do
        d=$N; [ $tree = base ] && d=$PWD/.baseline
        (cd $d && PYTHONPATH=/tmp/site timeout 80 python3 $N/benchmarks/bench_verify_attention.py --batch 1 16 --context 4096 \
          16384 ${g#* } --label $tree --out $OUT/verify_attention_${g%% *}_${tree}_s41.json 2>&1 | grep -c "'us'")
      done; done
      python3 -c "
import json
for g in ('g8', 'g16'):
    base, new = (json.load(open(f'$OUT/verify_attention_{g}_{t}_s41.json'))['rows'] for t in ('base', 'new'))
    key = lambda r: (r['batch'], r['context'], r['queries'], r['cache'][-6:])
    b = {key(r): r.get('us', r.get('error', '')[:60]) for r in base}
    for r in new: print(g, *key(r), b.get(key(r)), r.get('us', r.get('error', '')[:60]))"
      (cd $N && PYTHONPATH=/tmp/site:$N LAMINA_GDN_PREFILL=reference timeout 170 python3 benchmarks/profile_decode.py \
        --context 16384 --speculative-tokens 2 --gpu-memory-utilization 0.95 --out $OUT/profile_mtp2_16k_s41.json \
        > /tmp/s41_profile.txt 2>&1 || tail -20 /tmp/s41_profile.txt)
      python3 -c "
import json; d=json.load(open('$OUT/profile_mtp2_16k_s41.json'))
print({k: d.get(k) for k in ('wall_ms_per_step','gpu_kernel_ms_per_step','kernels_per_step','cuda_graphs')})
for k in d['top_kernels'][:24]: print(round(k['us_per_step'],1), k['calls_per_step'], k['name'][:100])" ;;
    s41w)  # (historical: "batched" and --row-split were removed in session 42, 57-97x slower; needs fabf7ec's tree or older)
      # session 41, second call: past 32 query rows, ROW_SPLIT "programs" (row-tile programs) against "batched"
      # (one program, batched dots: mma.sync, the keys read once), in the tree of part s41v (.baseline + this
      # session's files): rows equal to the one-token kernel both ways (GPU, bf16 / FP8), then the kernel timed both
      # ways and in .baseline (one 2D dot, wgmma from 64 rows) at GROUP 8, Q = 5 and GROUP 16, Q = 3 / 4
      N=/tmp/s41new; rm -rf $N && cp -r .baseline $N
      cp lamina/kernels/triton_decode.py $N/lamina/kernels/ && cp tests/test_triton_verify_kernels.py $N/tests/
      cp benchmarks/bench_verify_attention.py benchmarks/profile_decode.py $N/benchmarks/
      (cd $N && export PYTHONPATH=/tmp/site:$N
       timeout 100 python3 -m pytest -v -p no:cacheprovider -m gpu tests/test_triton_verify_kernels.py \
         -k "equals_decode_rows and (programs or batched)" > $OUT/s41w_tests.txt 2>&1
       timeout 25 python3 -m pytest -v -p no:cacheprovider tests/test_triton_verify_kernels.py -k past_one_row_tile \
         >> $OUT/s41w_tests.txt 2>&1)
      grep -E "FAILED|ERROR|passed|failed" $OUT/s41w_tests.txt | tail -12
      for g in "g8 --queries 5" "g16 --queries 3 4 --q-heads 32"; do for tree in new base; do
        d=$N; r="--row-split programs batched"; [ $tree = base ] && d=$PWD/.baseline && r=
        (cd $d && PYTHONPATH=/tmp/site timeout 45 python3 $N/benchmarks/bench_verify_attention.py --batch 1 16 --context 4096 \
          16384 ${g#* } $r --label $tree --out $OUT/verify_attention_split_${g%% *}_${tree}_s41.json 2>&1 | grep -c "'us'")
      done; done
      python3 -c "
import json
for g in ('g8', 'g16'):
    base, new = (json.load(open(f'$OUT/verify_attention_split_{g}_{t}_s41.json'))['rows'] for t in ('base', 'new'))
    key = lambda r: (r['batch'], r['context'], r['queries'], r['cache'][-6:])
    b = {key(r): r.get('us', r.get('error', '')[:60]) for r in base}
    for r in new: print(g, *key(r), r.get('row_split'), b.get(key(r)), r.get('us', r.get('error', '')[:60]))" ;;
    s40a)  # session 40: MTP verification attention on the split decode kernel: its GPU tests (rows equal the one-token
      # kernel bit for bit, bf16 / FP8 caches), timed against the tree before (.baseline, d678534^: one program per
      # (request, KV head), 32 keys a block), then the engine's GPU tests (graphs, MTP) on the retuned attention
      timeout 90 python3 -m pytest -v -p no:cacheprovider tests/test_triton_verify_kernels.py tests/test_fp8_kv_cache_kernels.py \
        > $OUT/s40_verify_tests.txt 2>&1
      grep -E "FAILED|ERROR|passed|failed" $OUT/s40_verify_tests.txt | tail -8
      timeout 100 python3 benchmarks/bench_verify_attention.py --label new --out $OUT/bench_verify_attention_new.json \
        2>&1 | tail -40 | cut -c1-220
      (cd .baseline && PYTHONPATH=/tmp/site timeout 100 python3 ../benchmarks/bench_verify_attention.py --label base \
        --out $OUT/bench_verify_attention_base.json 2>&1 | tail -40 | cut -c1-220)
      timeout 200 python3 -m pytest -v -p no:cacheprovider -m gpu tests/test_gpu_engine.py tests/test_batch_invariance.py \
        tests/test_mtp_triton.py > $OUT/s40_engine.txt 2>&1
      grep -E "FAILED|ERROR|passed|failed" $OUT/s40_engine.txt | tail -8 ;;
    s40b)  # MTP K = 2 (dummy weights: drafts rejected, a step's cost) at 16k context, batch 1, the tree before (.baseline,
      # d678534^) and this tree; the FP8 KV kernels' tests; decode at 4k (batch 1 / 32) and 16k (batch 1) over bf16 and
      # FP8 KV caches, the two trees alternating, one process each
      for tree in base new; do
        d=.; [ $tree = base ] && d=.baseline
        (cd $d && PYTHONPATH=/tmp/site:$PWD LAMINA_GDN_PREFILL=reference timeout 90 python3 -m lamina.entrypoints.cli bench \
          latency --dtype bfloat16 --batch-size 1 --input-len 16384 --output-len 32 --hf-overrides '{"mtp_num_hidden_layers": 1}' \
          --speculative-config '{"method": "mtp", "num_speculative_tokens": 2}' --gpu-memory-utilization 0.95 \
          --output-json /tmp/s40mtp_16384_$tree.json 2>&1 | grep "^| [0-9]")
      done
      merge_latency s40mtp
      timeout 100 python3 -m pytest -q -p no:cacheprovider tests/test_fp8_kv_cache_kernels.py 2>&1 | tail -2
      for ctx in 4096:1,32 16384:1; do for kv in auto fp8; do for tree in base new; do
        d=.; [ $tree = base ] && d=.baseline
        (cd $d && PYTHONPATH=/tmp/site:$PWD LAMINA_GDN_PREFILL=reference timeout 80 python3 -m lamina.entrypoints.cli bench \
          latency --dtype bfloat16 --batch-size $(echo ${ctx#*:} | tr , " ") --input-len ${ctx%:*} --output-len 32 \
          --kv-cache-dtype $kv --gpu-memory-utilization 0.95 --output-json /tmp/s40kv_${ctx%:*}_${kv}_$tree.json 2>&1 \
          | grep "^| [0-9]")
      done; done; done
      merge_latency s40kv ;;
    s40c)  # the Q-row attention's launch parameters for verification (4 queries, bf16 / FP8 caches), then MTP K = 1..3
      # step costs at batch 1 on the new path (bench_mtp.py, 40 layers, graphs)
      timeout 150 python3 benchmarks/bench_verify_attention.py --batch 1 16 --context 4096 16384 --queries 4 \
        --block-n 32 64 --stages 0 1 2 3 --label sweep --out $OUT/bench_verify_attention_sweep.json 2>&1 | tail -64 | cut -c1-200
      timeout 120 python3 benchmarks/bench_mtp.py --layers 40 --new-tokens 64 --batches 1 --out $OUT/mtp_graphs_b1.json \
        2>&1 | tail -10 | cut -c1-300 ;;
    s40d)  # this session's sampler change (unseeded noise from the engine's own generator, not torch's global RNG)
      # and MTP verification on the split kernel: the GPU tests of the sampler, the engine, batch invariance, MTP
      timeout 280 python3 -m pytest -v -p no:cacheprovider -m gpu tests/test_generation_defaults.py tests/test_sampler.py \
        tests/test_triton_sampler_kernels.py tests/test_gpu_engine.py tests/test_batch_invariance.py tests/test_mtp_triton.py \
        > $OUT/s40d_tests.txt 2>&1
      grep -E "FAILED|ERROR|passed|failed" $OUT/s40d_tests.txt | tail -12 ;;
    s39)  # session 38's owed run in one call: the sampler kernels' tests, the search cut against the sort (top-p alone
      # and top-k 1000, more search points), the engine's GPU tests and batch invariance, decode attention bf16 / FP8 KV
      timeout 60 python3 -m pytest -v -p no:cacheprovider tests/test_triton_sampler_kernels.py > $OUT/s39_sampler.txt 2>&1
      tail -3 $OUT/s39_sampler.txt
      timeout 200 python3 benchmarks/bench_nucleus_cut.py --widths 128 --blocks 1024 2048 4096 --sections 4 8 16 --warps 4 8 \
        --top-ks 0 1000 --out $OUT/bench_nucleus_cut.json > $OUT/s39_nucleus.txt 2>&1
      cut -c1-400 $OUT/s39_nucleus.txt | tail -17
      timeout 150 python3 -m pytest -v -p no:cacheprovider -m gpu tests/test_gpu_engine.py tests/test_batch_invariance.py \
        > $OUT/s39_engine.txt 2>&1
      grep -E "FAILED|ERROR|passed|failed" $OUT/s39_engine.txt | tail -8
      timeout 90 python3 benchmarks/bench_decode_attention_kv.py --block-n 32 64 --warps 8 --stages 0 2 --splits 16 \
        --out $OUT/bench_decode_attention_kv.json > $OUT/s39_attention.txt 2>&1
      grep "^best" $OUT/s39_attention.txt || tail -5 $OUT/s39_attention.txt ;;
    s39b)  # part s39 cut to a low device budget: the sampler tests, the search cut against the sort, the engine's GPU tests
      timeout 60 python3 -m pytest -v -p no:cacheprovider tests/test_triton_sampler_kernels.py > $OUT/s39_sampler.txt 2>&1
      tail -3 $OUT/s39_sampler.txt
      timeout 130 python3 benchmarks/bench_nucleus_cut.py --widths 128 --blocks 2048 4096 --sections 8 16 --warps 4 8 \
        --top-ks 0 1000 --out $OUT/bench_nucleus_cut.json > $OUT/s39_nucleus.txt 2>&1
      cut -c1-400 $OUT/s39_nucleus.txt | tail -17
      timeout 130 python3 -m pytest -v -p no:cacheprovider -m gpu tests/test_gpu_engine.py tests/test_batch_invariance.py \
        > $OUT/s39_engine.txt 2>&1
      grep -E "FAILED|ERROR|passed|failed" $OUT/s39_engine.txt | tail -8 ;;
    s38n)  # session 37, part s38 cut to what a short call allows: the sampler tests and the nucleus cut against the sort
      timeout 45 python3 -m pytest -q -p no:cacheprovider tests/test_triton_sampler_kernels.py > $OUT/s38n_sampler.txt 2>&1
      tail -3 $OUT/s38n_sampler.txt
      timeout 120 python3 benchmarks/bench_nucleus_cut.py --widths 128 --blocks 2048 --sections 1 8 --warps 4 8 --top-ks 0 1000 \
        --batch 1 64 256 --out $OUT/bench_nucleus_cut.json 2>&1 | tail -6 ;;
    s38)  # session 37: sampler kernels' tests (FP_FUSION explicit, the nucleus cut), the nucleus cut against the
      # sort, decode attention over bf16 / FP8 caches by launch parameters; then the other kernel tests
      timeout 50 python3 -m pytest -v -p no:cacheprovider tests/test_triton_sampler_kernels.py > $OUT/s38_sampler.txt 2>&1
      tail -3 $OUT/s38_sampler.txt
      timeout 150 python3 benchmarks/bench_nucleus_cut.py ${S38_NUCLEUS:---blocks 1024 4096 --sections 1 8 --warps 4 8 --top-ks 0 1000} \
        --out $OUT/bench_nucleus_cut.json > $OUT/s38_nucleus.txt 2>&1
      cat $OUT/s38_nucleus.txt | tail -17
      timeout 90 python3 benchmarks/bench_decode_attention_kv.py ${S38_ARGS:---block-n 32 64 --warps 8 --stages 0 2 --splits 16} \
        --out $OUT/bench_decode_attention_kv.json > $OUT/s38_attention.txt 2>&1
      grep "^best" $OUT/s38_attention.txt || tail -5 $OUT/s38_attention.txt ;;
    s37)  # session 36: session 35's GPU fixes (slot-sum FMA bits, q/k prep FP8 store on bf16, byte-wise FP8
      # gathers) and the FP8 KV engine test, then FP8 against model-dtype KV decode at 4k context (S37_ROUNDS="1 2": twice)
      timeout 120 python3 -m pytest -v -p no:cacheprovider tests/test_triton_kernels.py tests/test_fp8_kv_cache_kernels.py \
        -k "sum_slots or unweighted or fp8_caches or writers or moe" > $OUT/s37_kernels.txt 2>&1
      tail -3 $OUT/s37_kernels.txt
      timeout 150 python3 -m pytest -v -p no:cacheprovider -m gpu tests/test_gpu_engine.py tests/test_fp8_online.py \
        -k "fp8 or graph_decode or gpu" > $OUT/s37_engine.txt 2>&1
      tail -3 $OUT/s37_engine.txt
      python3 benchmarks/time_online_fp8.py | tee $OUT/s37_quantize.txt
      for i in ${S37_ROUNDS:-1}; do for kv in auto fp8; do
        LAMINA_GDN_PREFILL=reference timeout 70 $L --batch-size 1 32 --input-len 4096 --output-len 32 --kv-cache-dtype $kv \
          --gpu-memory-utilization 0.95 --output-json /tmp/s37kv_${i}_${kv}.json > /tmp/s37_$kv.txt 2>&1
        grep -E "^\| (1|32) " /tmp/s37_$kv.txt || tail -4 /tmp/s37_$kv.txt
      done; done
      merge_latency s37kv ;;
    s36d)  # part s36c cut to what a short call allows: its tests, and the FP8 KV engine once (bf16, graphs)
      timeout 90 python3 -m pytest -q -p no:cacheprovider tests/test_triton_kernels.py tests/test_fp8_kv_cache_kernels.py \
        -k "sum_slots or unweighted or fp8_caches or writers" > $OUT/s36d_tests.txt 2>&1
      tail -3 $OUT/s36d_tests.txt
      LAMINA_GDN_PREFILL=reference timeout 60 $L --batch-size 32 --input-len 4096 --output-len 32 --kv-cache-dtype fp8 \
        --gpu-memory-utilization 0.95 --output-json $OUT/s36d_fp8kv.json > /tmp/s36d_fp8.txt 2>&1
      grep -E "^\| 32 " /tmp/s36d_fp8.txt || tail -4 /tmp/s36d_fp8.txt ;;
    s36c)  # session 35: part s36b's two fixes on the GPU: the slot sum's FMA kept (bits equal to the id-free
      # sum) and the q/k prep kernel's FP8 store on a bf16 model; the FP8 KV cache's decode cost against auto
      timeout 90 python3 -m pytest -q -p no:cacheprovider tests/test_triton_kernels.py tests/test_fp8_kv_cache_kernels.py \
        -k "sum_slots or unweighted or fp8_caches or writers" > $OUT/s36c_tests.txt 2>&1
      tail -3 $OUT/s36c_tests.txt
      for kv in auto fp8; do
        LAMINA_GDN_PREFILL=reference timeout 60 $L --batch-size 32 --input-len 4096 --output-len 32 --kv-cache-dtype $kv \
          --gpu-memory-utilization 0.95 --output-json /tmp/s36ckv_${kv}.json > /tmp/s36c_$kv.txt 2>&1
        grep -E "^\| (1|32) " /tmp/s36c_$kv.txt || tail -4 /tmp/s36c_$kv.txt
      done
      merge_latency s36ckv ;;
    s36b)  # session 35: the grouped MoE's slot sum (other ranks' slots skipped by id) compiled, then the FP8 KV
      # cache's decode cost against the model-dtype cache (0.95: 32 requests' states fit an 80 GB card), then
      # the engine's GPU tests
      timeout 150 python3 -m pytest -q -p no:cacheprovider tests/test_triton_kernels.py -k "moe or sum_slots" \
        > $OUT/s36b_moe_tests.txt 2>&1; tail -3 $OUT/s36b_moe_tests.txt
      for kv in auto fp8 auto fp8; do
        LAMINA_GDN_PREFILL=reference timeout 80 $L --batch-size 1 32 --input-len 4096 --output-len 32 --kv-cache-dtype $kv \
          --gpu-memory-utilization 0.95 --output-json /tmp/s36bkv_${kv}_$RANDOM.json > /tmp/s36b_$kv.txt 2>&1
        grep -E "^\| (1|32) " /tmp/s36b_$kv.txt || tail -4 /tmp/s36b_$kv.txt
      done
      merge_latency s36bkv
      timeout ${REST_TIMEOUT:-150} python3 -m pytest -v -p no:cacheprovider -m gpu tests/test_gpu_engine.py \
        > $OUT/s36b_engine_tests.txt 2>&1; grep -E "FAILED|ERROR|passed|failed" $OUT/s36b_engine_tests.txt | tail -8
      grep -c PASSED $OUT/s36b_engine_tests.txt ;;
    s36)  # session 35: part s35's tests with every result streamed to $OUT (a cut run still tells what passed),
      # the FP8 KV cache's kernels compiled (bf16 queries too) and its decode cost against the model-dtype
      # cache in the same run, then the other GPU test files in the time left
      timeout ${TESTS_TIMEOUT:-180} python3 -m pytest -v -p no:cacheprovider -m gpu tests/test_tile_fit.py \
        tests/test_fp8_experts.py tests/test_mtp_triton.py > $OUT/s36_new_tests.txt 2>&1
      grep -E "PASSED|FAILED|ERROR|passed|failed" $OUT/s36_new_tests.txt | tail -20
      timeout 90 python3 -m pytest -v -p no:cacheprovider tests/test_fp8_kv_cache_kernels.py > $OUT/s36_fp8kv_tests.txt 2>&1
      grep -E "PASSED|FAILED|ERROR|passed|failed" $OUT/s36_fp8kv_tests.txt | tail -12
      for kv in auto fp8 auto fp8; do
        LAMINA_GDN_PREFILL=reference timeout 75 $L --batch-size 1 64 --input-len 2048 --output-len 64 --kv-cache-dtype $kv \
          --output-json /tmp/s36kv_${kv}_$RANDOM.json 2>&1 | grep -E "^\| (1|64) "
      done
      merge_latency s36kv
      timeout ${REST_TIMEOUT:-150} python3 -m pytest -v -p no:cacheprovider -m gpu --continue-on-collection-errors tests/ \
        --ignore=tests/test_tile_fit.py --ignore=tests/test_fp8_experts.py --ignore=tests/test_mtp_triton.py \
        > $OUT/s36_other_tests.txt 2>&1
      grep -cE "PASSED" $OUT/s36_other_tests.txt; grep -E "FAILED|ERROR|passed|failed" $OUT/s36_other_tests.txt | tail -20 ;;
    s35)  # next session: session 34's GPU tests not yet seen to pass: the grouped MoE tiles' real shared-memory
      # refusal (deep bf16 pipelines), FP8 experts with the drafter's experts FP8 under MTP, the MTP Triton path
      timeout 400 python3 -m pytest -q -p no:cacheprovider -m gpu tests/test_tile_fit.py tests/test_fp8_experts.py \
        tests/test_mtp_triton.py -rA 2>&1 | grep -E "PASSED|FAILED|ERROR|passed|failed" | tail -20 ;;
    s33d)  # next session: part s32c's offline throughput (512 x 1024 / 256, bf16 then FP8 experts) on the
      # dequantize-before-dot grouped kernels
      bash $0 s32c ;;
    s32b)  # session 32: FP8 experts (block FP8 kept on the Triton MoE kernels): their kernels compiled on CUDA
      # and the engine's GPU test (graphs, against the dequantized twin's reference), then the dummy preset in
      # bf16 and with FP8 experts (--quantization fp8), same process order: batch 1 / 16 / 64 latency
      timeout 150 python3 -m pytest -q -p no:cacheprovider tests/test_triton_fp8_moe.py 2>&1 | tail -3
      timeout 150 python3 -m pytest -q -p no:cacheprovider -m gpu tests/test_fp8_experts.py 2>&1 | tail -3
      for q in none fp8; do
        LAMINA_GDN_PREFILL=reference timeout 120 $L --batch-size 1 16 64 --input-len 128 --output-len 64 \
          --gpu-memory-utilization 0.95 --quantization $q --output-json /tmp/latency_fp8_$q.json 2>&1 | grep -v Warn | tail -5
      done
      merge_latency latency_fp8 ;;
    s32c)  # session 32: offline throughput (512 x 1024 / 256) at the default max_num_seqs, bf16 then FP8
      # experts, and the kernels of a batch-1 FP8 decode step (torch profiler)
      for q in none fp8; do
        timeout 150 python3 -m lamina.entrypoints.cli bench throughput --dtype bfloat16 --num-prompts 512 \
          --input-len 1024 --output-len 256 --quantization $q --output-json /tmp/thr_fp8_$q.json 2>&1 \
          | grep -v Warn | tail -3 | cut -c1-400
      done
      merge_throughput thr_fp8_ throughput_fp8 ;;
    s32d)  # session 32: the FP8 experts' decode GEMV tiles swept (L2-cold, against bf16 in the same run), then
      # the kernels of a batch-1 decode step in bf16 and with FP8 experts (torch profiler)
      timeout 300 python3 benchmarks/tune_moe_fp8.py --out $OUT/tune_moe_fp8.json 2>&1 | grep -v Warn | tail -5 | cut -c1-600
      for q in none fp8; do
        timeout 100 python3 benchmarks/profile_decode.py --batch 1 --quantization $q --out $OUT/profile_b1_$q.json \
          > /dev/null 2>&1
        python3 -c "
import json; d=json.load(open('$OUT/profile_b1_$q.json'))
print('$q', {k: round(d[k], 3) for k in ('wall_ms_per_step','gpu_kernel_ms_per_step','kernels_per_step')})
for k in d['top_kernels'][:8]: print(round(k['us_per_step'],1), k['calls_per_step'], k['name'][:90])"
      done ;;
    s32e)  # session 32: batch 1 / 2 / 4 / 16 / 64 latency, bf16 then FP8 experts on their tuned tiles (up_n 8)
      for q in none fp8; do
        LAMINA_GDN_PREFILL=reference timeout 150 $L --batch-size 1 2 4 16 64 --input-len 128 --output-len 64 \
          --gpu-memory-utilization 0.95 --quantization $q --output-json /tmp/latency_fp8t_$q.json 2>&1 | grep -v Warn | tail -7
      done
      merge_latency latency_fp8t
      timeout 150 python3 -m pytest -q -p no:cacheprovider tests/test_triton_fp8_moe.py 2>&1 | tail -2 ;;
    s32f)  # session 32: FP8 experts' gate/up rows per program, 2 (.baseline) against 8 (this tree), alternating,
      # batch 1 / 2 / 4, three rounds each, one process per run (the preset's dummy weights, --quantization fp8)
      for i in 1 2 3; do
        (cd .baseline && PYTHONPATH=/tmp/site:$PWD LAMINA_GDN_PREFILL=reference timeout 60 $L --batch-size 1 2 4 \
          --input-len 128 --output-len 64 --quantization fp8 --output-json /tmp/fp8rows_base_$i.json 2>&1 | tail -1)
        LAMINA_GDN_PREFILL=reference timeout 60 $L --batch-size 1 2 4 --input-len 128 --output-len 64 --quantization fp8 \
          --output-json /tmp/fp8rows_new_$i.json 2>&1 | tail -1
      done
      merge_latency fp8rows ;;
    s32g)  # session 32: the FP8 tile sweep widened (16 / 32 gate/up rows), the FP8 engine's GPU test on the shipped
      # tiles, then an 8k prompt's TTFT in bf16 and with FP8 experts (the grouped kernels' prefill tiles)
      timeout 200 python3 benchmarks/tune_moe_fp8.py --out $OUT/tune_moe_fp8_wide.json 2>&1 | grep -v Warn | tail -3 | cut -c1-700
      timeout 150 python3 -m pytest -q -p no:cacheprovider -m gpu tests/test_fp8_experts.py 2>&1 | tail -2
      for q in none fp8; do
        timeout 90 $L --batch-size 1 --input-len 8192 --output-len 2 --max-num-batched-tokens 8192 --quantization $q \
          --output-json /tmp/ttft8k_fp8_$q.json 2>&1 | grep -v Warn | tail -1
      done
      python3 -c "
import json, glob
out = {f.split('/')[-1][:-5]: json.load(open(f)) for f in sorted(glob.glob('/tmp/ttft8k_fp8_*.json'))}
json.dump(out, open('$OUT/ttft8k_fp8.json', 'w'), indent=1)
for k, v in out.items(): print(k, round(v[0]['ttft_ms'], 1))" ;;
    s32)  # next session, one call: the GPU tests session 31's last call did not reach (its limit cut it), YaRN's and the
      # bf16 pool's and MTP's, then max_model_len auto on this GPU (a default engine, the preset's 32k length),
      # then on two GPUs the TP2 / PP2 graphs, on an H200 batch 1 against transformers
      timeout 300 python3 -m pytest -q -p no:cacheprovider -m gpu tests/test_triton_kernels.py \
        tests/test_triton_pending_fill.py tests/test_triton_router.py tests/test_triton_verify_kernels.py \
        tests/test_ssm_state_dtype.py tests/test_rope_scaling.py 2>&1 | tail -3
      timeout 120 python3 -m lamina.entrypoints.cli bench latency --dtype bfloat16 --batch-size 1 --input-len 128 \
        --output-len 32 --max-model-len auto --output-json $OUT/latency_auto_len.json 2>&1 | grep -v Warn | tail -4
      if [ "$(python3 -c 'import torch; print(torch.cuda.device_count())')" -ge 2 ]; then bash $0 tp2graphs; fi
      if python3 -c "import torch, sys; sys.exit('H200' not in torch.cuda.get_device_name())"; then bash $0 compare25; fi ;;
    s31t)  # session 31: every GPU-marked test on the session's last tree (one GPU: the two-GPU tests skip)
      timeout ${TESTS_TIMEOUT:-470} python3 -m pytest -q -p no:cacheprovider -m gpu --continue-on-collection-errors \
        --durations=8 --junitxml=$OUT/gpu_tests.xml tests/ 2>&1 | grep -v "^$" | tail -24 | cut -c1-220 ;;
    s31c)  # session 31: the bfloat16 state pool's kernel tests compiled on CUDA, MTP verify graphs on it, the
      # demo model's eval on the GPU with each pool, and the memory plan's peaks at the default with a bf16 pool
      timeout 200 python3 -m pytest -q -p no:cacheprovider tests/test_ssm_state_dtype.py 2>&1 | tail -3
      timeout 200 python3 -m pytest -q -p no:cacheprovider -m gpu tests/test_mtp_triton.py -k verify_graphs 2>&1 | tail -3
      for ssm in auto bfloat16 float16; do
        timeout 100 python3 -m lamina.entrypoints.cli eval demo --mamba-ssm-cache-dtype $ssm \
          --output-json /tmp/eval_demo_$ssm.json 2>&1 | grep "| all\|elapsed"
      done
      python3 benchmarks/eval_compare.py /tmp/eval_demo_auto.json /tmp/eval_demo_bfloat16.json \
        /tmp/eval_demo_float16.json --out $OUT/eval_demo_ssm_dtype_gpu.json
      timeout 200 python3 benchmarks/memory_peak.py --max-num-seqs 0 --mamba-ssm-cache-dtype bfloat16 \
        --out $OUT/memory_peak_default_bf16_state.json 2>&1 | grep -v Warn | tail -26 | cut -c1-400 ;;
    s31b)  # session 31: the recurrent state pool in bfloat16 (--mamba-ssm-cache-dtype): its GPU tests, then batch
      # 1 / 16 / 64 latency and offline throughput at the default max_num_seqs, float32 pool then bfloat16, one call
      timeout 200 python3 -m pytest -q -p no:cacheprovider -m gpu tests/test_ssm_state_dtype.py 2>&1 | tail -4
      for ssm in auto bfloat16; do
        LAMINA_GDN_PREFILL=reference timeout 150 $L --batch-size 1 16 64 --input-len 128 --output-len 64 \
          --gpu-memory-utilization 0.95 --mamba-ssm-cache-dtype $ssm --output-json /tmp/latency_ssm_$ssm.json 2>&1 | tail -5
      done
      merge_latency latency_ssm
      for ssm in auto bfloat16; do
        timeout 150 python3 -m lamina.entrypoints.cli bench throughput --dtype bfloat16 --num-prompts 512 \
          --input-len 1024 --output-len 256 --mamba-ssm-cache-dtype $ssm --output-json /tmp/thr_ssm_$ssm.json 2>&1 \
          | grep -v Warn | tail -4 | cut -c1-400
      done
      merge_throughput thr_ssm_ throughput_ssm_dtype ;;
    thr30)  # session 30: the kernels of a step prefilling eight 1k prompts (first: fla-core autotunes there on a fresh
      # machine), offline throughput (512 x 1024 / 256, 256 sequences), its steps split prompt-bearing / decode, then
      # the kernels of a batch-256 decode step (torch profiler)
      LAMINA_GDN_PREFILL=fla timeout 200 python3 benchmarks/profile_decode.py --prefill-len 1024 --prompts 8 --steps 3 \
        --out $OUT/profile_prefill_8x1k.json 2>&1 | tail -22 | cut -c1-200
      timeout 150 python3 -m lamina.entrypoints.cli bench throughput --dtype bfloat16 --num-prompts 512 --input-len 1024 \
        --output-len 256 --max-num-seqs 256 --output-json $OUT/throughput_512x1024x256.json 2>&1 | tail -3
      timeout 150 python3 benchmarks/throughput_steps.py --num-prompts 512 --input-len 1024 --output-len 256 \
        --max-num-seqs 256 --max-model-len 2048 --out $OUT/throughput_steps_512.json 2>&1 | tail -16 | cut -c1-400
      timeout 120 python3 benchmarks/profile_decode.py --batch 256 --steps 3 --out $OUT/profile_decode_b256.json 2>&1 \
        | tail -22 | cut -c1-200 ;;
    s30)  # next session, one call: session 29's unrun GPU tests (the no-sync prefill guard, the flash timing test
      # warmed at another length, fla's host chunk indices), then the fresh-prompt TTFT A/B in one process (part
      # ttftab), then batch 1 against transformers (part compare25) on an H200 only (on an H100 host 40x is above
      # the roofline)
      timeout ${TESTS_TIMEOUT:-200} python3 -m pytest -v -p no:cacheprovider -m gpu --timeout=150 \
        tests/test_gpu_engine.py::test_prefill_and_mixed_steps_never_sync_the_host \
        "tests/test_kernels.py::test_fresh_prompts_on_cuda_take_flash_and_match_the_mask" \
        tests/test_gdn_prefill.py::test_fla_prefill_with_host_chunk_indices_never_syncs > $OUT/s30_tests.log 2>&1
      grep -E "PASSED|FAILED|ERROR|^E |passed|failed" $OUT/s30_tests.log | sed 's/ *\[ *[0-9]*%\]//' | cut -c1-200
      AB_ROUNDS=${AB_ROUNDS:-16} bash $0 ttftab
      if python3 -c "import torch, sys; sys.exit('H200' not in torch.cuda.get_device_name())"; then bash $0 compare25; fi ;;
    s28t)  # session 28: every GPU-marked test (one GPU: the two-GPU tests skip)
      timeout ${TESTS_TIMEOUT:-540} python3 -m pytest -q -p no:cacheprovider -m gpu --continue-on-collection-errors \
        --durations=10 tests/ 2>&1 | grep -v "^$" | tail -30 | cut -c1-220 ;;
    s27a)  # session 27: the sampler's GPU tests on session 26's last commits; the fused MoE on prefill chunks (kernels,
      # launch order, tiles, cuBLAS on the same FLOPs); the kernels of a step prefilling eight 1k prompts
      timeout 150 python3 -m pytest -q -p no:cacheprovider -m gpu tests/test_sampler.py tests/test_batch_invariance.py \
        tests/test_triton_sampler_kernels.py 2>&1 | grep -v "^$" | tail -3 | cut -c1-220
      timeout 240 python3 benchmarks/bench_moe_prefill.py --out $OUT/bench_moe_prefill.json 2>&1 | tail -70 | cut -c1-300
      timeout 60 python3 -m pytest -q -p no:cacheprovider -m gpu tests/test_triton_kernels.py -k grouped_mm 2>&1 | grep -v "^$" | tail -3
      for i in 1 2; do for m in triton grouped_mm; do  # an 8k prompt's TTFT, the MoE on either, alternating
        LAMINA_MOE_PREFILL=$m timeout 70 $L --batch-size 1 --input-len 8192 --output-len 2 --max-num-batched-tokens 8192 \
          --output-json $OUT/s27_prefill8k_${m}_$i.json > /tmp/s27_p.log 2>&1
        python3 -c "import json; r=json.load(open('$OUT/s27_prefill8k_${m}_$i.json')); r=r[0] if isinstance(r, list) else r; print('$m', r['ttft_ms'])" \
          || tail -3 /tmp/s27_p.log
      done; done
      LAMINA_GDN_PREFILL=fla timeout 150 python3 benchmarks/profile_decode.py --prefill-len 1024 --prompts 8 --steps 3 \
        --out $OUT/profile_prefill_8x1k.json > $OUT/profile_prefill_8x1k.txt 2>&1
      python3 -c "
import json; d=json.load(open('$OUT/profile_prefill_8x1k.json'))
print({k: d[k] for k in ('wall_ms_per_prefill','gpu_kernel_ms_per_step','kernels_per_step')})
for k in d['top_kernels'][:24]: print(round(k['us_per_step'],1), k['calls_per_step'], k['name'][:80])" ;;
    s27s)  # session 27, for a short device budget: the fused MoE on prefill chunks (bench_moe_prefill at 2k / 8k tokens),
      # the grouped-GEMM MoE's GPU tests, an 8k prompt's TTFT with the prefill MoE on either kernel
      timeout 200 python3 benchmarks/bench_moe_prefill.py --tokens 2048,8192 --out $OUT/bench_moe_prefill.json 2>&1 \
        | tail -50 | cut -c1-300
      timeout 90 python3 -m pytest -q -p no:cacheprovider tests/test_triton_kernels.py -k "grouped_mm or combine" 2>&1 \
        | grep -v "^$" | tail -3
      for m in triton grouped_mm; do
        LAMINA_MOE_PREFILL=$m timeout 70 $L --batch-size 1 --input-len 8192 --output-len 2 --max-num-batched-tokens 8192 \
          --output-json $OUT/s27_prefill8k_$m.json > /tmp/s27_p.log 2>&1
        python3 -c "import json; r=json.load(open('$OUT/s27_prefill8k_$m.json')); r=r[0] if isinstance(r, list) else r; print('$m', r['ttft_ms'])" \
          || tail -3 /tmp/s27_p.log
      done ;;
    s27b)  # session 27: offline throughput (512 x 1024 in / 256 out, max_num_seqs 256) with the prefill MoE on the Triton
      # kernels and on torch._grouped_mm; the kernels of a batch-256 decode step
      for m in triton grouped_mm; do
        LAMINA_MOE_PREFILL=$m timeout 120 python3 -m lamina.entrypoints.cli bench throughput --dtype bfloat16 --num-prompts 512 \
          --input-len 1024 --output-len 256 --max-num-seqs 256 --output-json $OUT/throughput_512x1024x256_seqs256_$m.json 2>&1 | tail -2
      done
      LAMINA_GDN_PREFILL=reference timeout 150 python3 benchmarks/profile_decode.py --batch 256 --out $OUT/profile_b256.json \
        > $OUT/profile_b256.txt 2>&1
      python3 -c "
import json; d=json.load(open('$OUT/profile_b256.json'))
print({k: d[k] for k in ('wall_ms_per_step','gpu_kernel_ms_per_step','kernels_per_step')})
for k in d['top_kernels'][:18]: print(round(k['us_per_step'],1), k['calls_per_step'], k['name'][:80])" ;;
    s26)  # session 26: seeded noise, torch reference against the one-launch Triton kernel, the sampler with greedy /
      # temperature / top-p / Qwen3.5's top-k + top-p defaults; the kernel's tests on the GPU (also under TRITON_DEBUG=1)
      timeout 200 python3 benchmarks/bench_seeded_noise.py --out $OUT/seeded_noise.json 2>&1 | tail -70 | cut -c1-300
      timeout 90 python3 -m pytest -q -p no:cacheprovider tests/test_triton_sampler_kernels.py 2>&1 | grep -v "^$" | tail -4 | cut -c1-220
      TRITON_DEBUG=1 timeout 90 python3 -m pytest -q -p no:cacheprovider tests/test_triton_sampler_kernels.py -k reference 2>&1 \
        | grep -v "^$" | tail -3 | cut -c1-220
      timeout 200 python3 -m pytest -q -p no:cacheprovider -m gpu tests/test_sampler.py tests/test_batch_invariance.py \
        tests/test_demo_model.py 2>&1 | grep -v "^$" | tail -4 | cut -c1-220 ;;
    s26b)  # session 26, a short call: the top-k / top-p cut (sort, window as torch ops, window in one Triton launch)
      # in one run, then the window kernel's tests on the GPU
      timeout 120 python3 benchmarks/bench_seeded_noise.py --top-k-only --out $OUT/window_cut_ab.json 2>&1 | tail -12 | cut -c1-300
      timeout 120 python3 -m pytest -q -p no:cacheprovider tests/test_triton_sampler_kernels.py 2>&1 | grep -v "^$" | tail -3
      timeout 150 python3 -m pytest -q -p no:cacheprovider -m gpu tests/test_sampler.py tests/test_batch_invariance.py 2>&1 \
        | grep -v "^$" | tail -3 | cut -c1-220 ;;
    compare25)  # batch 1 against transformers' generate (fla-core) in the same process run, after session 25's fix
      # (the dummy preset's baseline built in bf16, not float32 first; it OOMed on an 80 GB H100 before)
      LAMINA_GDN_PREFILL=reference timeout 240 $L --batch-size 1 --input-len 128 --output-len 32 --compare transformers \
        --output-json $OUT/compare_transformers_b1.json 2>&1 | tail -4 ;;
    s24)  # session 24, for a short device budget: the planned-ahead fill compiled on the GPU (its tests, the engine's
      # planned-ahead tests), then bench_mtp K <= 1 at batch 1 with LAMINA_PENDING_FILL=torch against triton (the default),
      # alternating ROUNDS times in this tree, then the GPU-marked engine and MTP tests
      timeout 60 python3 -m pytest -q -p no:cacheprovider tests/test_triton_pending_fill.py 2>&1 | grep -v "^$" | tail -4 | cut -c1-220
      timeout ${TESTS_TIMEOUT:-150} python3 -m pytest -q -p no:cacheprovider tests/test_mtp_async.py \
        2>&1 | grep -v "^$" | tail -6 | cut -c1-220
      for i in $(seq ${ROUNDS:-1}); do
        for fill in torch triton; do
          LAMINA_PENDING_FILL=$fill timeout ${FILL_TIMEOUT:-90} python3 benchmarks/bench_mtp.py --layers 40 --new-tokens 64 \
            --batches ${FILL_BATCHES:-1} --max-k 1 --rounds 2 --with-async --out $OUT/s24_${fill}_$i.json > /tmp/s24_${fill}_$i.log 2>&1 \
            || tail -5 /tmp/s24_${fill}_$i.log | cut -c1-300
        done
      done
      python3 -c "
import json, glob
for f in sorted(glob.glob('$OUT/s24_*.json')):
    for r in json.load(open(f))['rows']:
        if r['mode'].startswith(('plain', 'mtp')): print(f.split('/')[-1][:-5], r['batch'], r['mode'], r['k'], round(r['median_step_ms'], 3),
                                                           [round(x, 3) for x in r.get('round_medians_ms', [])], r.get('round_overlapped_steps'))"
      timeout ${TESTS_TIMEOUT:-150} python3 -m pytest -q -p no:cacheprovider -m gpu --durations=5 tests/test_gpu_engine.py \
        tests/test_mtp_triton.py tests/test_batch_invariance.py tests/test_demo_model.py 2>&1 | grep -v "^$" | tail -12 | cut -c1-220 ;;
    fill23)  # session 23: a planned-ahead MTP step filled in by one Triton launch (this tree) against the ~15 torch
      # launches of .baseline2 (carried: git archive fdb64a3 lamina), bench_mtp K <= 1 at batch 1 and 8 with and
      # without asynchronous scheduling, trees alternating; then this tree's batch-1 timeline (k = 1 planned ahead)
      for i in $(seq ${ROUNDS:-1}); do
        for tree in base new; do
          root=$PWD; [ $tree = base ] && root=$PWD/.baseline2
          PYTHONPATH=/tmp/site:$root timeout ${FILL_TIMEOUT:-170} python3 benchmarks/bench_mtp.py --layers 40 --new-tokens 64 \
            --batches ${FILL_BATCHES:-1,8} --max-k 1 --rounds 2 --with-async --out $OUT/fill23_${tree}_$i.json > /tmp/fill23_${tree}_$i.log 2>&1 \
            || tail -5 /tmp/fill23_${tree}_$i.log | cut -c1-300
        done
      done
      python3 -c "
import json, glob
for f in sorted(glob.glob('$OUT/fill23_*.json')):
    for r in json.load(open(f))['rows']:
        if r['mode'].startswith(('plain', 'mtp')): print(f.split('/')[-1][:-5], r['batch'], r['mode'], r['k'], round(r['median_step_ms'], 3),
                                                           [round(x, 3) for x in r.get('round_medians_ms', [])], r.get('round_overlapped_steps'))"
      [ "${TIMELINE:-1}" = 1 ] && timeout 150 python3 benchmarks/bench_mtp.py --layers 40 --new-tokens 32 --batches 1 --max-k 1 --with-async \
        --profile-dir $OUT/tl23 --timeline --out /tmp/tl23_rows.json > /tmp/tl23.log 2>&1
      grep -v '^{"mode' /tmp/tl23.log | grep -v "^USDT\|^after releasing" | tail -40 | cut -c1-330
      rm -f $OUT/tl23/*.trace.json ;;
    mtpasync22)  # session 22: session 21's measurement again with 3 rounds and the count of steps that really overlapped
      # (overlapped_steps: launched while the step before was in flight), then batch 1 on the device's timeline: MTP k = 0,
      # k = 1, and k = 1 planned ahead (bench_mtp --timeline --with-async): device busy / idle per step
      timeout 330 python3 benchmarks/bench_mtp.py --layers 40 --new-tokens 64 --batches ${MTP_BATCHES:-1,8} --max-k 3 --rounds 3 \
        --with-async --out $OUT/mtp_async22.json > /tmp/mtp_async22.log 2>&1 || tail -25 /tmp/mtp_async22.log | cut -c1-300
      python3 -c "
import json; d=json.load(open('$OUT/mtp_async22.json'))
for r in d['rows']: print(r['batch'], r['mode'], r['k'], round(r['median_step_ms'], 3), [round(x, 3) for x in r.get('round_medians_ms', [])],
                          r.get('round_overlapped_steps'), r.get('steps_timed'), round(r.get('added_ms_vs_k0') or 0, 3))"
      [ "${TIMELINE:-1}" = 1 ] && timeout 200 python3 benchmarks/bench_mtp.py --layers 40 --new-tokens 32 --batches 1 --max-k 1 --with-async \
        --profile-dir $OUT/tl22 --timeline --out /tmp/tl22_rows.json > /tmp/tl22.log 2>&1
      grep -v '^{"mode' /tmp/tl22.log | grep -v "^USDT\|^after releasing" | tail -60 | cut -c1-330
      rm -f $OUT/tl22/*.trace.json ;;
    mtprounds)  # (written in session 18; its first run, session 19, printed nothing) MTP K = 0..3 at batch 1 and 8, the drafter engine's modes alternating
      # over 3 rounds in one process (bench_mtp --rounds): added_ms_vs_k0 is the in-process figure to compare
      timeout 400 python3 benchmarks/bench_mtp.py --layers 40 --new-tokens 64 --batches 1,8 --max-k 3 --rounds 3 \
        --out $OUT/mtp_rounds.json > /tmp/mtp_rounds.log 2>&1 || tail -25 /tmp/mtp_rounds.log | cut -c1-300
      python3 -c "
import json; d=json.load(open('$OUT/mtp_rounds.json'))
for r in d['rows']: print(r['batch'], r['mode'], r['k'], round(r['median_step_ms'], 3), r.get('round_medians_ms'), r.get('added_ms_vs_k0'))" ;;
    final18)  # this session's final tree: the state commit alone (bench_state_commit), its GPU test, MTP K = 0..3 at batch 1
      timeout 120 python3 benchmarks/bench_state_commit.py --out $OUT/bench_state_commit_final.json 2>&1 | tail -5
      timeout 60 python3 -m pytest -q -p no:cacheprovider tests/test_triton_state_rows.py 2>&1 | tail -1
      timeout 220 python3 benchmarks/bench_mtp.py --layers 40 --new-tokens 64 --batches 1 --max-k 3 \
        --out $OUT/mtp18_final.json > /tmp/mtp18_final.log 2>&1
      python3 -c "
import json; d=json.load(open('$OUT/mtp18_final.json'))
for r in d['rows']: print(r['mode'], r['k'], round(r['median_step_ms'], 3), round(r.get('decode_tok_s', 0), 1), r.get('first_divergence'))" ;;
    commitbench18)  # the state commit alone (bench_state_commit: 60 pools of the 35B-A3B shape, reference against the
      # grouped kernel, batch 1-64), then the kernel's and the MTP GPU tests on the final tree (eager drafts)
      timeout 120 python3 benchmarks/bench_state_commit.py --out $OUT/bench_state_commit.json 2>&1 | tail -5
      timeout 200 python3 -m pytest -q -p no:cacheprovider tests/test_triton_state_rows.py tests/test_mtp_triton.py \
        tests/test_mtp_states.py 2>&1 | tail -3 ;;
    draft18)  # (ran on a6c9656 but with the commit copier's first version; the drafter's graphs were dropped after it: no gain) the MTP drafter's
      # passes replayed from CUDA graphs (LAMINA_DRAFT_GRAPHS=1) against eager drafts (0, today's code): bench_mtp K = 0..3
      # at batch 1; then the MTP and kernel GPU tests
      for g in 0 1; do
        LAMINA_DRAFT_GRAPHS=$g timeout 220 python3 benchmarks/bench_mtp.py --layers 40 --new-tokens 64 --batches 1 \
          --max-k 3 --out $OUT/mtp18_draftgraphs$g.json > /tmp/mtp18_g$g.log 2>&1
        tail -1 /tmp/mtp18_g$g.log | cut -c1-200; python3 -c "
import json; d=json.load(open('$OUT/mtp18_draftgraphs$g.json'))
for r in d['rows']: print('graphs=$g', r['mode'], r['k'], round(r['median_step_ms'], 3), round(r.get('decode_tok_s', 0), 1), r.get('first_divergence'))"
      done
      timeout 200 python3 -m pytest -q -p no:cacheprovider tests/test_triton_state_rows.py tests/test_mtp_triton.py \
        2>&1 | tail -3 ;;
    commit18)  # MTP commits (the accepted position's states into the slots) in one launch per group of like pools,
      # against .baseline's index_copy_ per pool: bench_mtp K = 0..2 at batch 1 (dummy drafts are rejected, so every
      # verification step commits); then the kernel's tests and the MTP GPU tests
      (cd .baseline && PYTHONPATH=/tmp/site:$PWD timeout 200 python3 benchmarks/bench_mtp.py --layers 40 --new-tokens 64 \
        --batches 1 --max-k 2 --out $OUT/mtp18_base.json > /tmp/mtp18_base.log 2>&1)
      timeout 200 python3 benchmarks/bench_mtp.py --layers 40 --new-tokens 64 --batches 1 --max-k 2 \
        --out $OUT/mtp18_new.json > /tmp/mtp18_new.log 2>&1
      for f in base new; do tail -2 /tmp/mtp18_$f.log | cut -c1-200; python3 -c "
import json; d=json.load(open('$OUT/mtp18_$f.json'))
for r in d['rows']: print('$f', r['mode'], r['k'], round(r['median_step_ms'], 3), round(r.get('decode_tok_s', 0), 1))"; done
      timeout 150 python3 -m pytest -q -p no:cacheprovider tests/test_triton_state_rows.py tests/test_mtp_triton.py \
        tests/test_triton_verify_kernels.py 2>&1 | tail -3 ;;
    mtp18)  # (written in session 17, not yet run) MTP K=1..3 at batch 1 in verify graphs, whose 2-4-token verify steps
      # take the FMA MoE kernels since session 17: LAMINA_MOE_GEMV_FMA=0 (the tl.dot kernels there) against the
      # default; then the MTP GPU tests (verify kernels, MTP on the Triton kernels)
      for f in 0 1; do
        LAMINA_MOE_GEMV_FMA=$f timeout 100 python3 benchmarks/bench_mtp.py --layers 40 --new-tokens 64 --batches 1 \
          --out $OUT/mtp18_moefma$f.json 2>&1 | tail -5 | cut -c1-300
      done
      timeout 240 python3 -m pytest -q -p no:cacheprovider -m gpu tests/test_triton_verify_kernels.py tests/test_mtp_triton.py \
        2>&1 | tail -3 ;;
    profilenopdl)  # (written in session 16, run in session 17) the batch-1 profile with PDL off (LAMINA_PDL=0): each kernel's
      # own time, without the wait for its producer that PDL's early start counts in (then the same with PDL, for the wall)
      for pdl in 0 1; do
        LAMINA_PDL=$pdl LAMINA_GDN_PREFILL=reference timeout 150 python3 benchmarks/profile_decode.py --batch 1 \
          --out $OUT/profile_b1_pdl$pdl.json > $OUT/profile_b1_pdl$pdl.txt 2>&1
        python3 -c "
import json; d=json.load(open('$OUT/profile_b1_pdl$pdl.json'))
print('PDL $pdl', {k: d[k] for k in ('wall_ms_per_step','gpu_kernel_ms_per_step','kernels_per_step')})
for k in d['top_kernels'][:14]: print(round(k['us_per_step'],1), k['calls_per_step'], k['name'][:80])"
      done ;;
    profile)
      LAMINA_GDN_PREFILL=reference timeout 150 python3 benchmarks/profile_decode.py --batch 1 --out $OUT/profile_b1.json > $OUT/profile_b1.txt 2>&1
      python3 -c "
import json; d=json.load(open('$OUT/profile_b1.json'))
print({k: d[k] for k in ('wall_ms_per_step','gpu_kernel_ms_per_step','kernels_per_step')})
for k in d['top_kernels'][:22]: print(round(k['us_per_step'],1), k['calls_per_step'], k['name'][:80])" ;;
    s41p)  # session 41: prefix caching on the GPU (a prompt again from its kept prefix repeats its first run bit for
      # bit, with and without MTP), its TTFT on the 40-layer preset (new / same / next turn, on vs off, one process),
      # then the engine's GPU tests on this code
      timeout 150 python3 -m pytest -q -p no:cacheprovider -m gpu tests/test_prefix_caching.py 2>&1 | tail -3
      timeout 200 python3 benchmarks/bench_prefix_cache.py --input-len 2048,8192 --rounds 3 \
        --out $OUT/prefix_cache_s41.json 2>&1 | grep -E "^input|Error|error" | tail -4
      timeout 230 python3 -m pytest -q -p no:cacheprovider -m gpu tests/test_gpu_engine.py tests/test_batch_invariance.py \
        tests/test_mtp_triton.py tests/test_generation_defaults.py 2>&1 | tail -3 ;;
    s42p)  # session 42: where a short prompt's eager step goes: a prefill of 16 / 128 / 2048 tokens profiled (kernels,
      # CUDA runtime calls and syncs a step, the host's cProfile), unprofiled wall
      for n in 16 128 2048; do
        timeout 100 python3 benchmarks/profile_decode.py --prefill-len $n --steps 2 --out $OUT/profile_prefill_${n}_s42.json \
          > $OUT/profile_prefill_${n}_s42.txt 2>&1
        python3 -c "
import json; d=json.load(open('$OUT/profile_prefill_${n}_s42.json'))
print($n, {k: round(d[k], 2) for k in ('wall_ms_per_prefill', 'wall_ms_per_prefill_profiled', 'gpu_kernel_ms_per_step', 'kernels_per_step')})
print(' ', {k: round(v, 1) for k, v in d['runtime_calls_per_prefill'].items()})" || tail -5 $OUT/profile_prefill_${n}_s42.txt
      done ;;
    s42s)  # session 42: the delta rule of short chunks token by token (triton_gdn_varlen): its GPU tests, short prompts'
      # TTFT and a mixed step against fla in one process, the 16-token prefill profiled with it, the engine's GPU tests
      timeout 100 python3 -m pytest -q -p no:cacheprovider -m gpu tests/test_triton_gdn_varlen.py > $OUT/s42s_tests.txt 2>&1
      tail -2 $OUT/s42s_tests.txt; grep -E "^E  " $OUT/s42s_tests.txt | head -6
      timeout 150 python3 benchmarks/bench_short_prefill.py --input-len 16,32,64,128,256 --rounds 4 \
        --out $OUT/short_prefill_s42.json 2>&1 | grep -E "^input|Error|error" | tail -8
      timeout 100 python3 benchmarks/profile_decode.py --prefill-len 16 --steps 2 --out $OUT/profile_prefill_16_short_s42.json \
        > /tmp/p16.txt 2>&1
      python3 -c "
import json; d=json.load(open('$OUT/profile_prefill_16_short_s42.json'))
print({k: round(d[k], 2) for k in ('wall_ms_per_prefill', 'gpu_kernel_ms_per_step', 'kernels_per_step')})
print({k: round(v, 1) for k, v in d['runtime_calls_per_prefill'].items()})" || tail -5 /tmp/p16.txt
      timeout 150 python3 -m pytest -q -p no:cacheprovider -m gpu tests/test_gpu_engine.py tests/test_batch_invariance.py \
        tests/test_mtp_triton.py tests/test_generation_defaults.py tests/test_prefix_caching.py tests/test_gdn_prefill.py::test_engine_greedy_with_fla_prefill \
        > $OUT/s42s_engine.txt 2>&1; tail -2 $OUT/s42s_engine.txt; grep -E "^(E  |FAILED)" $OUT/s42s_engine.txt | head -12 ;;
    s46c)  # session 46: start-up capture on / off on a warm Triton cache (s45q's first process filled an empty one):
      # 1, 0, 1, one process each, then the MTP prompt-alone TTFT comparison at 7 sequences (2 rounds)
      i=0; for A in 1 0 1; do i=$((i+1))
        LAMINA_MIXED_GRAPHS_AT_START=$A timeout 110 python3 benchmarks/bench_mixed_capture.py \
          --out $OUT/mixed_capture_${i}_at_start${A}_s46.json 2>&1 | tail -1
      done
      timeout 160 python3 benchmarks/bench_short_prefill.py --compare graphs --mtp 2 --max-num-seqs 7 --input-len 16,128 \
        --rounds 2 --out $OUT/mtp_prefill_graphs_s46.json > $OUT/s46c_bench.txt 2>&1; echo "rc $?"
      grep -E "^input|shapes|rror" $OUT/s46c_bench.txt | head -8 ;;
    s46b)  # s46a in less device time: the new test, the MTP and engine GPU tests, MTP K = 2 prompt-alone TTFT (1 round)
      timeout 60 python3 -m pytest -q -p no:cacheprovider tests/test_mixed_graphs.py -k without_drafts \
        > $OUT/s46b_new.txt 2>&1; tail -1 $OUT/s46b_new.txt; grep -E "^(E  |FAILED)" $OUT/s46b_new.txt | head -8
      timeout 150 python3 -m pytest -q -p no:cacheprovider -m gpu tests/test_mtp_triton.py tests/test_gpu_engine.py \
        > $OUT/s46b_engine.txt 2>&1; tail -2 $OUT/s46b_engine.txt; grep -E "^(E  |FAILED)" $OUT/s46b_engine.txt | head -8
      timeout 100 python3 benchmarks/bench_short_prefill.py --compare graphs --mtp 2 --max-num-seqs 7 --input-len 16,128 \
        --rounds 1 --out $OUT/mtp_prefill_graphs_s46.json > $OUT/s46b_bench.txt 2>&1; echo "rc $?"
      grep -E "^input|shapes|rror" $OUT/s46b_bench.txt | head -8 ;;
    s46a)  # session 46: the new MTP test (draft-free decodes beside prompt chunks) on CUDA, the engine's GPU tests on
      # session 45's code (start-up capture and MTP prefill graphs on by default), MTP K = 2 prompt-alone TTFT graphs vs
      # eager at 7 requests (an MTP engine of the preset fits about 7 on an 80 GB card; the joining steps ride 6 decodes)
      timeout 60 python3 -m pytest -q -p no:cacheprovider tests/test_mixed_graphs.py -k without_drafts \
        > $OUT/s46a_new.txt 2>&1; tail -1 $OUT/s46a_new.txt; grep -E "^(E  |FAILED)" $OUT/s46a_new.txt | head -8
      timeout 250 python3 -m pytest -q -p no:cacheprovider -m gpu tests/test_gpu_engine.py tests/test_mtp_triton.py \
        tests/test_qwen4_graphs.py tests/test_batch_invariance.py tests/test_prefix_caching.py \
        > $OUT/s46a_engine.txt 2>&1; tail -2 $OUT/s46a_engine.txt; grep -E "^(E  |FAILED)" $OUT/s46a_engine.txt | head -8
      timeout 130 python3 benchmarks/bench_short_prefill.py --compare graphs --mtp 2 --max-num-seqs 7 --input-len 16,128 \
        --rounds 2 --out $OUT/mtp_prefill_graphs_s46.json > $OUT/s46a_bench.txt 2>&1; echo "rc $?"
      grep -E "^input|shapes|rror" $OUT/s46a_bench.txt | head -8 ;;
    s45q)  # s45s and s45m in less device time, the tests first: the graphs' and capture sizes' tests on CUDA (the MTP
      # prefill-graph test included), start-up capture off / on, MTP K = 2 prompt-alone TTFT graphs vs eager
      timeout 150 python3 -m pytest -q -p no:cacheprovider tests/test_mixed_graphs.py tests/test_capture_sizes.py \
        > $OUT/s45q_tests.txt 2>&1; tail -2 $OUT/s45q_tests.txt; grep -E "^(E  |FAILED)" $OUT/s45q_tests.txt | head -8
      for A in 0 1; do
        LAMINA_MIXED_GRAPHS_AT_START=$A timeout 110 python3 benchmarks/bench_mixed_capture.py \
          --out $OUT/mixed_capture_at_start${A}_s45.json 2>&1 | tail -1
      done
      timeout 130 python3 benchmarks/bench_short_prefill.py --compare graphs --mtp 2 --input-len 16,128 --rounds 2 \
        --out $OUT/mtp_prefill_graphs_s45.json > $OUT/s45q_bench.txt 2>&1; echo "rc $?"; grep -E "^input|shapes|rror" $OUT/s45q_bench.txt | head -6 ;;
    s45s)  # session 45: every prefill / mixed graph captured at start-up (LAMINA_MIXED_GRAPHS_AT_START) against each
      # when first met: start-up time, shapes captured mid-run, slowest steps of a serving-like run; then the graphs' and
      # capture sizes' tests on CUDA (the verify graphs' state rows under capture sizes, the start-up capture)
      for A in 0 1; do
        LAMINA_MIXED_GRAPHS_AT_START=$A timeout 150 python3 benchmarks/bench_mixed_capture.py \
          --out $OUT/mixed_capture_at_start${A}_s45.json 2>&1 | tail -1
      done
      timeout 200 python3 -m pytest -q -p no:cacheprovider tests/test_mixed_graphs.py tests/test_capture_sizes.py \
        > $OUT/s45s_tests.txt 2>&1; tail -2 $OUT/s45s_tests.txt; grep -E "^(E  |FAILED)" $OUT/s45s_tests.txt | head -8 ;;
    s45m)  # session 45: an MTP engine's prompt-alone steps on the prefill graphs (hidden states kept, drafter eager):
      # TTFT graphs vs eager at K = 2 (joining steps hold drafts: eager both ways); MTP GPU tests with the graphs on
      timeout 200 python3 benchmarks/bench_short_prefill.py --compare graphs --mtp 2 --input-len 16,128,256 --rounds 2 \
        --out $OUT/mtp_prefill_graphs_s45.json > $OUT/s45m_bench.txt 2>&1; echo "rc $?"; grep -E "^input|shapes|rror" $OUT/s45m_bench.txt | head -6
      timeout 200 python3 -m pytest -q -p no:cacheprovider -m gpu tests/test_mtp_triton.py tests/test_gpu_engine.py \
        > $OUT/s45m_tests.txt 2>&1; tail -2 $OUT/s45m_tests.txt; grep -E "^(E  |FAILED)" $OUT/s45m_tests.txt | head -8 ;;
    s45b)  # s44b's TTFT / joining-step comparison, which ran past its 110 s limit there: the step-following short limit
      # (LAMINA_GDN_SHORT_PREFILL_ALONE) off / on at 300 and 512 tokens, one process, alternating
      timeout 330 python3 benchmarks/bench_short_prefill.py --compare alone --input-len 512,300 --rounds 2 \
        --out $OUT/short_alone_s45.json > $OUT/s45b_bench.txt 2>&1; echo "rc $?"; grep -E "^input|shapes|rror" $OUT/s45b_bench.txt | head -6 ;;
    s45g)  # session 45: the graphs' and the engine's GPU tests on session 44's final code (capture sizes, mixed /
      # verify / decode graphs, MTP, Qwen4-Exp graphs, batch invariance, prefix caching)
      timeout 280 python3 -m pytest -q -p no:cacheprovider -m gpu tests/test_mixed_graphs.py tests/test_gpu_engine.py \
        tests/test_mtp_triton.py tests/test_qwen4_graphs.py tests/test_batch_invariance.py tests/test_prefix_caching.py \
        > $OUT/s45g_engine.txt 2>&1; tail -2 $OUT/s45g_engine.txt; grep -E "^(E  |FAILED)" $OUT/s45g_engine.txt | head -8
      timeout 120 python3 -m pytest -q -p no:cacheprovider tests/test_capture_sizes.py \
        > $OUT/s45g_sizes.txt 2>&1; tail -2 $OUT/s45g_sizes.txt; grep -E "^(E  |FAILED)" $OUT/s45g_sizes.txt | head -8 ;;
    s45k)  # session 45: every other GPU-marked test (the kernels against their references) on the final code
      # (the server tests' modules do not import on the device machine: no uvicorn / openai; none is GPU-marked)
      timeout 520 python3 -m pytest -q -p no:cacheprovider -m gpu tests --continue-on-collection-errors --deselect tests/test_multirank_graphs.py \
        --ignore tests/test_mixed_graphs.py --ignore tests/test_gpu_engine.py --ignore tests/test_mtp_triton.py \
        --ignore tests/test_qwen4_graphs.py --ignore tests/test_batch_invariance.py --ignore tests/test_prefix_caching.py \
        > $OUT/s45k_kernels.txt 2>&1; tail -2 $OUT/s45k_kernels.txt; grep -E "^(E  |FAILED)" $OUT/s45k_kernels.txt | head -12 ;;
    s44b)  # s44a in less device time: TTFT / joining step at 512 tokens (1 round), throughput off / on (1 round), the rule's
      # test and the short-chunk kernels' GPU tests
      timeout 110 python3 benchmarks/bench_short_prefill.py --compare alone --input-len 512 --rounds 1 \
        --out $OUT/short_alone_s44.json 2>&1 | grep -E "^input|rror" | head -4
      T="python3 -m lamina.entrypoints.cli bench throughput --dtype bfloat16 --num-prompts 192 --input-len 512 --output-len 32 --max-num-seqs 48"
      for A in 0 512; do
        LAMINA_GDN_SHORT_PREFILL_ALONE=$A timeout 80 $T --output-json /tmp/s44b_thr_alone${A}.json 2>&1 | tail -1
      done
      merge_throughput s44b_thr throughput_alone_ab_s44
      timeout 90 python3 -m pytest -q -p no:cacheprovider tests/test_triton_gdn_varlen.py \
        > $OUT/s44b_tests.txt 2>&1; tail -2 $OUT/s44b_tests.txt; grep -E "^(E  |FAILED)" $OUT/s44b_tests.txt | head -8 ;;
    s44a)  # session 44: the short-chunk delta rule's longer limit in small steps (LAMINA_GDN_SHORT_PREFILL_ALONE):
      # TTFT and the joining step at 300 / 512 tokens against the fixed 256 limit (one process, alternating), offline
      # throughput of 512-token prompts with it off / on (alternating, one process each), its tests on CUDA
      timeout 150 python3 benchmarks/bench_short_prefill.py --compare alone --input-len 300,512 --rounds 2 \
        --out $OUT/short_alone_s44.json 2>&1 | grep -E "^input|rror" | head -6
      T="python3 -m lamina.entrypoints.cli bench throughput --dtype bfloat16 --num-prompts 192 --input-len 512 --output-len 32 --max-num-seqs 48"
      for i in 1 2; do for A in 0 512; do
        LAMINA_GDN_SHORT_PREFILL_ALONE=$A timeout 100 $T --output-json /tmp/s44a_thr_alone${A}_$i.json 2>&1 | tail -1
      done; done
      merge_throughput s44a_thr throughput_alone_ab_s44
      timeout 120 python3 -m pytest -q -p no:cacheprovider tests/test_triton_gdn_varlen.py tests/test_gdn_prefill.py -m gpu \
        > $OUT/s44a_tests.txt 2>&1; tail -2 $OUT/s44a_tests.txt; grep -E "^(E  |FAILED)" $OUT/s44a_tests.txt | head -8
      timeout 60 python3 -m pytest -q -p no:cacheprovider tests/test_triton_gdn_varlen.py -k small_steps \
        > $OUT/s44a_rule.txt 2>&1; tail -1 $OUT/s44a_rule.txt ;;
    s44t)  # session 43's unrun checks on the final code: the graphs' GPU tests (mixed, engine) and the short-chunk delta
      # rule at real width (its new 512-token case); session 44's capture sizes with graphs captured
      timeout 150 python3 -m pytest -q -p no:cacheprovider tests/test_mixed_graphs.py tests/test_gpu_engine.py -m gpu \
        > $OUT/s44t_tests.txt 2>&1; tail -2 $OUT/s44t_tests.txt; grep -E "^(E  |FAILED)" $OUT/s44t_tests.txt | head -8
      timeout 100 python3 -m pytest -q -p no:cacheprovider tests/test_triton_gdn_varlen.py -m gpu -k real_width \
        > $OUT/s44t_width.txt 2>&1; tail -2 $OUT/s44t_width.txt; grep -E "^(E  |FAILED)" $OUT/s44t_width.txt | head -8
      timeout 100 python3 -m pytest -q -p no:cacheprovider tests/test_capture_sizes.py \
        > $OUT/s44t_sizes.txt 2>&1; tail -2 $OUT/s44t_sizes.txt; grep -E "^(E  |FAILED)" $OUT/s44t_sizes.txt | head -8 ;;
    s43d)  # session 43's upload fix: batch-1 decode at 256 sequences and a 262k max_model_len (the real model's context,
      # laid over the preset's 32k; 256 table rows of 16,384 entries: 16.8 MB a step before the fix), FP8 experts so
      # that 256 states fit an 80 GB card too; .baseline (git archive 8ef4a90: whole-buffer uploads) against this
      # tree, alternating, one process each
      C="--batch-size 1 --input-len 128 --output-len 64 --max-num-seqs 256 --max-model-len 262144 --quantization fp8"
      for i in 1 2; do
        (cd .baseline && PYTHONPATH=/tmp/site:$PWD timeout 120 $L $C --hf-overrides '{"max_position_embeddings": 262144}' \
          --output-json /tmp/s43d_base_$i.json 2>&1 | tail -1)
        timeout 120 $L $C --hf-overrides '{"max_position_embeddings": 262144}' --output-json /tmp/s43d_new_$i.json 2>&1 | tail -1
      done
      merge_latency s43d ;;
    s43c)  # session 43: chunks of 512 / 1,024 tokens: the short-chunk delta rule in graphs against eager, and fla against
      # the short path eagerly (the baseline), each in one process, 2 rounds
      LAMINA_GDN_SHORT_PREFILL=1024 LAMINA_MIXED_GRAPHS=1024 timeout 130 python3 benchmarks/bench_short_prefill.py \
        --compare graphs --input-len 512,1024 --rounds 2 --out $OUT/mixed_graphs_long_s43.json 2>&1 | grep -E "^input|shapes|rror" | head -6
      timeout 100 python3 benchmarks/bench_short_prefill.py --input-len 512,1024 --rounds 2 \
        --out $OUT/short_prefill_long_s43.json 2>&1 | grep -E "^input|rror" | head -6 ;;
    s43b)  # session 43, last call: the mixed graphs' tests (a failed capture falling back too) on the final code, and
      # their capture time
      timeout 200 python3 -m pytest -q -p no:cacheprovider tests/test_mixed_graphs.py > $OUT/s43b_tests.txt 2>&1
      tail -2 $OUT/s43b_tests.txt; grep -E "^(E  |FAILED)" $OUT/s43b_tests.txt | head -12
      timeout 150 python3 benchmarks/bench_short_prefill.py --compare graphs --input-len 16,128 --rounds 2 \
        --out $OUT/mixed_graphs_capture_s43.json 2>&1 | grep -E "^input|shapes|Error|error" | head -8 ;;
    s43a)  # session 43: the prefill / mixed steps' CUDA graphs: their GPU tests, TTFT and the mixed step against eager
      # (same process, rounds alternating), bench latency's TTFT, a 16-token prefill's profile
      timeout 150 python3 -m pytest -q -p no:cacheprovider -m gpu tests/test_mixed_graphs.py > $OUT/s43a_tests.txt 2>&1
      tail -2 $OUT/s43a_tests.txt; grep -E "^(E  |FAILED)" $OUT/s43a_tests.txt | head -12
      timeout 200 python3 benchmarks/bench_short_prefill.py --compare graphs --input-len 16,128,256 --rounds 3 \
        --out $OUT/mixed_graphs_s43.json 2>&1 | grep -E "^input|Error|error" | head -8
      timeout 90 $L --batch-size 1 --input-len 128 --output-len 32 --output-json $OUT/latency_b1_in128_graphs_s43.json 2>&1 | tail -2
      timeout 90 python3 benchmarks/profile_decode.py --prefill-len 16 --steps 2 --out $OUT/profile_prefill_16_graphs_s43.json > /dev/null 2>&1
      python3 -c "
import json; d=json.load(open('$OUT/profile_prefill_16_graphs_s43.json'))
print({k: d[k] for k in ('wall_ms_per_prefill','gpu_kernel_ms_per_step','kernels_per_step')})" ;;
    s42f)  # session 42, last call: the verification attention without the batched split (its GPU tests), the short-chunk
      # delta rule's, the engine's (graphs, MTP)
      timeout 170 python3 -m pytest -q -p no:cacheprovider -m gpu tests/test_triton_verify_kernels.py tests/test_triton_gdn_varlen.py \
        > $OUT/s42f_kernels.txt 2>&1; tail -2 $OUT/s42f_kernels.txt; grep -E "^(E  |FAILED)" $OUT/s42f_kernels.txt | head -8
      timeout 100 python3 -m pytest -q -p no:cacheprovider -m gpu tests/test_gpu_engine.py tests/test_mtp_triton.py \
        > $OUT/s42f_engine.txt 2>&1; tail -2 $OUT/s42f_engine.txt; grep -E "^(E  |FAILED)" $OUT/s42f_engine.txt | head -8 ;;
    s41q)  # s41p in less device time: the prefix-caching GPU tests, its TTFT at 2k / 8k (2 rounds), the engine's GPU tests
      timeout 120 python3 -m pytest -q -p no:cacheprovider -m gpu tests/test_prefix_caching.py > $OUT/s41q_prefix_tests.txt 2>&1
      tail -3 $OUT/s41q_prefix_tests.txt; grep -E "^E  " $OUT/s41q_prefix_tests.txt | head -8
      timeout 120 python3 benchmarks/bench_prefix_cache.py --input-len 2048,8192 --rounds 2 \
        --out $OUT/prefix_cache_s41.json 2>&1 | grep -E "^input|Error|error" | tail -4
      timeout 100 python3 -m pytest -q -p no:cacheprovider -m gpu tests/test_gpu_engine.py tests/test_batch_invariance.py \
        tests/test_mtp_triton.py tests/test_generation_defaults.py > $OUT/s41q_engine_tests.txt 2>&1; tail -2 $OUT/s41q_engine_tests.txt ;;
  esac
done
