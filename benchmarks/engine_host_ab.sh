#!/bin/bash
# Engine host time (benchmarks/bench_engine_host.py, CPU): this tree against .baseline, trees alternating,
# two rounds, in one run. Make the baseline first: mkdir .baseline && git archive REV lamina | tar -x -C .baseline
# Session 20 ran it with REV = e4548f2 (PY = the CI venv's python, OUT = /tmp/hostbench).
cd "$(dirname "$0")/.."
PY=${PY:-python3}; OUT=${OUT:-/tmp/hostbench}; mkdir -p $OUT
for round in 1 2; do
  for tree in base new; do
    root=$PWD; [ $tree = base ] && root=$PWD/.baseline
    PYTHONPATH=$root $PY benchmarks/bench_engine_host.py --batches 1,16,64,256 --output-len 256 --label "$tree" \
      --out $OUT/${tree}_plain_generate_$round.json
    PYTHONPATH=$root $PY benchmarks/bench_engine_host.py --batches 1,16,64,256 --output-len 256 --path engine --label "$tree" \
      --out $OUT/${tree}_plain_engine_$round.json
    PYTHONPATH=$root $PY benchmarks/bench_engine_host.py --batches 1,16,64 --output-len 256 --spec-k 2 --label "$tree" \
      --out $OUT/${tree}_mtp2_generate_$round.json
  done
done
