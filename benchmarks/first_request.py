"""Time to first token of the first request a fresh engine serves, with and without the engine's
CUDA warm-up (`LLMEngine.warm_up`), each in its own process with an empty Triton cache, so the
compile cost a user meets on a new machine is what is measured; then a restart on the warm cache.

    python benchmarks/first_request.py [--layers 40] [--input-len 1024] [--out first_request.json]
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))


def one_process(layers: int, input_len: int, warm_up: bool) -> dict:
    import torch

    from lamina import LLM, SamplingParams
    from lamina.engine.llm_engine import LLMEngine
    from lamina.entrypoints.presets import preset_dir

    if not warm_up:
        LLMEngine.warm_up = lambda self, *a, **k: None
    t0 = time.perf_counter()
    llm = LLM(str(preset_dir("qwen3.5-35b-a3b", layers)), device="cuda", dtype="bfloat16", load_format="dummy",
              max_model_len=input_len + 64, max_num_seqs=4, show_progress=False)
    startup = time.perf_counter() - t0
    params = SamplingParams(temperature=0.0, max_tokens=1, ignore_eos=True)
    ttfts = []
    for i in range(3):
        prompt = [(i * 7919 + j) % 200_000 for j in range(input_len)]
        torch.cuda.synchronize()
        t = time.perf_counter()
        llm.generate([{"prompt_token_ids": prompt}], params, use_tqdm=False)
        ttfts.append((time.perf_counter() - t) * 1e3)
    return {"warm_up": warm_up, "startup_s": startup, "ttft_ms_first_three": ttfts}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--layers", type=int, default=40)
    ap.add_argument("--input-len", type=int, default=1024)
    ap.add_argument("--out", default=None)
    ap.add_argument("--child", choices=["on", "off"], default=None)
    ap.add_argument("--skip-off", action="store_true", help="only warm-up on: cold cache, then the restart")
    args = ap.parse_args()
    if args.child:
        print(json.dumps(one_process(args.layers, args.input_len, args.child == "on")))
        return
    records = []
    # warm-up off and on with an empty Triton cache (a new machine), then on again with the cache
    # the previous process left (a restart: compiled kernels and fla's autotuning results on disk).
    with tempfile.TemporaryDirectory() as off_cache, tempfile.TemporaryDirectory() as on_cache:
        runs = (("off", off_cache, "cold"), ("on", on_cache, "cold"), ("on", on_cache, "warm"))
        for mode, cache, label in runs[1:] if args.skip_off else runs:
            env = dict(os.environ, TRITON_CACHE_DIR=cache)
            out = subprocess.run([sys.executable, __file__, "--child", mode, "--layers", str(args.layers),
                                  "--input-len", str(args.input_len)], env=env, capture_output=True, text=True)
            if out.returncode != 0:
                print(out.stderr[-3000:], file=sys.stderr)
                continue
            record = dict(json.loads(out.stdout.strip().splitlines()[-1]), triton_cache=label)
            print(record)
            records.append(record)
    result = {"kind": "first_request", "command": " ".join(sys.argv), "input_len": args.input_len,
              "layers": args.layers, "records": records}
    if args.out:
        Path(args.out).write_text(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
