#!/usr/bin/env bash
# `lamina bench serve` on one H200 (issue 12 item 3): a `lamina serve --preset` of the Qwen3.5-35B-A3B
# text shape (all 40 layers, bf16, dummy weights, no tokenizer: token-id prompts) measured over HTTP at
# max concurrency 1, 16 and 64, 1024 tokens in / 256 out. About 3 minutes on an H200.
#   bash benchmarks/gpu_serve.sh            (writes under $OUT)
# Writes $OUT/serve_c{1,16,64}.json (the bench records), $OUT/serve.json (all of them),
# $OUT/serve_tables.md (one markdown table) and $OUT/server.log (the server's output).
# Knobs (environment): PYTHON, PORT, PRESET, NUM_LAYERS, DTYPE, SERVER_TIMEOUT (s to wait for /health),
# PROMPTS_C1 / PROMPTS_C16 / PROMPTS_C64 (prompts per run), INPUT_LEN, OUTPUT_LEN. A CPU smoke run:
#   PRESET=qwen3.5-moe-tiny DTYPE=float32 INPUT_LEN=16 OUTPUT_LEN=8 bash benchmarks/gpu_serve.sh
set -uo pipefail
OUT=${OUT:-/tmp/lamina-gpu-serve}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1
PY=${PYTHON:-python3}
PORT=${PORT:-8123}
PRESET=${PRESET:-qwen3.5-35b-a3b}
DTYPE=${DTYPE:-bfloat16}
SERVER_TIMEOUT=${SERVER_TIMEOUT:-240}
INPUT_LEN=${INPUT_LEN:-1024}
OUTPUT_LEN=${OUTPUT_LEN:-256}
START=$(date +%s)
URL="http://127.0.0.1:$PORT"

# The server's imports. Missing ones: installed from .whl/*.whl when there are wheels (as gpu_final.sh does).
MODULES="fastapi uvicorn pydantic prometheus_client xgrammar httpx numpy"
missing() {
  $PY -c "import importlib.util as u, sys; print(' '.join(m for m in sys.argv[1:] if u.find_spec(m) is None))" $MODULES
}
MISSING=$(missing)
if [ -n "$MISSING" ] && ls .whl/*.whl >/dev/null 2>&1; then
  echo "[gpu_serve] missing: $MISSING; installing .whl/*.whl into /tmp/site"
  $PY -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl
  export PYTHONPATH=/tmp/site:${PYTHONPATH:-}
  MISSING=$(missing)
fi
if [ -n "$MISSING" ]; then
  echo "[gpu_serve] error: python modules needed by lamina serve / bench serve are missing: $MISSING" >&2
  echo "[gpu_serve] install them ($PY -m pip install $MISSING), or put their wheels in .whl/" >&2
  exit 3
fi
export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH}
LAMINA="$PY -m lamina.entrypoints.cli"

# The server: the preset with dummy weights; no tokenizer (implied by --preset).
LAYERS=${NUM_LAYERS:+--num-layers $NUM_LAYERS}
$LAMINA serve --preset "$PRESET" $LAYERS --dtype "$DTYPE" --port "$PORT" --max-model-len 2048 --max-num-seqs 64 \
  --no-access-log --drain-timeout 5 --log-stats-interval ${LOG_STATS_INTERVAL:-2} > "$OUT/server.log" 2>&1 &
SERVER=$!
stop_server() {
  if kill -0 "$SERVER" 2>/dev/null; then
    kill -TERM "$SERVER"
    for _ in $(seq 1 60); do kill -0 "$SERVER" 2>/dev/null || break; sleep 0.5; done
    kill -KILL "$SERVER" 2>/dev/null
  fi
  wait "$SERVER" 2>/dev/null
}
trap stop_server EXIT

echo "[gpu_serve] waiting up to ${SERVER_TIMEOUT}s for $URL/health"
until $PY -c "import httpx, sys; sys.exit(httpx.get('$URL/health', timeout=2).status_code != 200)" 2>/dev/null; do
  if ! kill -0 "$SERVER" 2>/dev/null; then
    echo "[gpu_serve] error: lamina serve exited before it was healthy; the end of $OUT/server.log:" >&2
    tail -30 "$OUT/server.log" >&2
    exit 4
  fi
  if [ $(( $(date +%s) - START )) -gt "$SERVER_TIMEOUT" ]; then
    echo "[gpu_serve] error: lamina serve not healthy after ${SERVER_TIMEOUT}s; the end of $OUT/server.log:" >&2
    tail -30 "$OUT/server.log" >&2
    exit 5
  fi
  sleep 1
done
echo "[gpu_serve] server up after $(( $(date +%s) - START ))s"
$PY -c "import httpx, json; print(json.dumps(httpx.get('$URL/v1/models').json()['data'][0]))"

# One run per concurrency, its own prompt count (decode ~3.7 ms/step at batch 1, ~22 ms at batch 64:
# 8 x 256 tokens at c1 is ~8 s; 64 prompts at c16 and 128 at c64 are 4 and 2 waves).
STATUS=0
for spec in "1 ${PROMPTS_C1:-8} 120" "16 ${PROMPTS_C16:-64} 120" "64 ${PROMPTS_C64:-128} 150"; do
  set -- $spec
  echo "[gpu_serve] concurrency $1, $2 prompts ($(( $(date +%s) - START ))s in)"
  timeout "$3" $LAMINA bench serve --base-url "$URL" --num-prompts "$2" --input-len "$INPUT_LEN" \
    --output-len "$OUTPUT_LEN" --max-concurrency "$1" --output-json "$OUT/serve_c$1.json" 2>&1 | tail -8
  rc=${PIPESTATUS[0]}
  [ "$rc" -eq 0 ] || { echo "[gpu_serve] concurrency $1: exit status $rc" >&2; STATUS=6; }
done

# All records in one JSON and one markdown table.
$PY - "$OUT" <<'EOF'
import json, sys
from pathlib import Path

from lamina.entrypoints.bench_serve import serve_table

out = Path(sys.argv[1])
records = [r for c in (1, 16, 64) if (out / f"serve_c{c}.json").exists()
           for r in json.loads((out / f"serve_c{c}.json").read_text())]
(out / "serve.json").write_text(json.dumps(records, indent=2))
if records:
    first = records[0]
    lines = [f"`lamina bench serve` against `lamina serve --preset {first['model']}` ({first['gpu']}, {first['dtype']}, "
             f"prompts: {first['prompt_source']}), {first['input_len']} tokens in / {first['output_len']} out, "
             "streamed, ignore_eos, temperature 0:", "", serve_table(records), "", "Commands:", ""]
    lines += [f"    {r['command']}" for r in records]
    (out / "serve_tables.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))
else:
    print("[gpu_serve] no records were written", file=sys.stderr)
EOF

stop_server
trap - EXIT
echo "[gpu_serve] done in $(( $(date +%s) - START ))s; outputs in $OUT"
exit $STATUS
