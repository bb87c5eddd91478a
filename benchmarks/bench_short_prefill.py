"""TTFT of short prompts with the gated delta net's short-chunk path (the delta rule token by token
in one launch, lamina.kernels.triton_gdn_varlen) against fla-core's chunked kernel, in one process,
rounds alternating; and a mixed step (decodes with a new prompt's chunk) both ways. With
`--compare graphs`: the prefill / mixed steps' CUDA graphs (lamina.worker.mixed_graphs) against the
same steps run eagerly, both on the short path.

    python benchmarks/bench_short_prefill.py --input-len 16,32,64,128,256 --rounds 5 --out short_prefill.json
    python benchmarks/bench_short_prefill.py --compare graphs --input-len 16,128,256 --out mixed_graphs.json
    python benchmarks/bench_short_prefill.py --compare alone --input-len 384,512 --out short_alone.json
    python benchmarks/bench_short_prefill.py --compare graphs --mtp 2 --input-len 16,128 --out mtp_graphs.json

One engine (the preset's dummy weights, prefix caching off) is loaded and warmed once; the path is
switched by setting every delta-net layer's `short_prefill_tokens` (what LAMINA_GDN_SHORT_PREFILL
sets when the model is built): 0 = fla for every prefill chunk, a large value = the short path.
Each TTFT sample is one request of `max_tokens=1`, stepped alone until done. `mixed`: 8 running
requests decode while a new prompt of the given length joins; the step that carries its chunk is
timed (the one step whose plan holds more than one token for a request). Round 0 is not kept: with
graphs the engine captured every shape at start-up (LAMINA_MIXED_GRAPHS_AT_START=0: round 0
captures each when first needed).
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--input-len", default="16,32,64,128,256", help="comma-separated prompt lengths")
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--preset", default="qwen3.5-35b-a3b")
    ap.add_argument("--num-layers", type=int, default=None)
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--max-num-seqs", type=int, default=16,
                    help="the engine's (an MTP engine on an 80 GB card fits about 7 at the default memory share); "
                         "the joining-prompt steps ride beside min(8, this - 1) decodes")
    ap.add_argument("--out", default=None)
    ap.add_argument("--mtp", type=int, default=0, metavar="K",
                    help="an MTP engine of K drafts (the preset given one MTP layer, dummy weights): its prompt-alone "
                         "steps replay the prefill graphs too; joining steps hold drafts and run eagerly both ways")
    ap.add_argument("--compare", choices=("short", "graphs", "alone"), default="short",
                    help="short: fla against the short-chunk path; graphs: eager against the mixed steps' graphs; "
                         "alone: the short-chunk limit of every step (LAMINA_GDN_SHORT_PREFILL_ALONE=0) against "
                         "the longer one of small steps (the default)")
    args = ap.parse_args()

    import torch

    from lamina import LLM, SamplingParams
    from lamina.entrypoints.presets import preset_dir, preset_label
    from lamina.layers.gated_delta_net import GatedDeltaNet

    lengths = [int(n) for n in args.input_len.split(",")]
    rng = random.Random(0)
    first = SamplingParams(temperature=0.0, max_tokens=1, ignore_eos=True)
    records = []
    mtp = ({"speculative_config": {"method": "mtp", "num_speculative_tokens": args.mtp},
            "hf_overrides": {"mtp_num_hidden_layers": 1}} if args.mtp else {})
    with LLM(str(preset_dir(args.preset, args.num_layers)), dtype=args.dtype, load_format="dummy", max_num_seqs=args.max_num_seqs,
             max_model_len=max(lengths) + 512, show_progress=False, **mtp) as llm:
        engine = llm.engine
        runner = engine.executor.runner
        layers = [m for m in runner.model.modules() if isinstance(m, GatedDeltaNet)]
        default, default_alone = layers[0].short_prefill_tokens, layers[0].short_prefill_alone_tokens
        graphs = runner.mixed_graphs
        if args.compare == "graphs" and graphs is None:
            raise SystemExit(f"no mixed-step graphs: {runner.no_mixed_graphs_reason or 'not captured (enforce_eager?)'}")
        runner.mixed_graphs = graphs if args.compare == "graphs" else None
        names = {"short": ("fla", "short"), "graphs": ("eager", "graphs"), "alone": ("fixed", "alone")}[args.compare]
        vocab = min(engine.model_config.vocab_size, 200_000)
        # the decodes a joining prompt rides beside: 8, or as many as leave it a place in the step
        joining_decodes = min(8, engine.max_num_seqs - 1)
        if joining_decodes < 1:
            raise SystemExit(f"max_num_seqs = {engine.max_num_seqs}: a joining prompt needs at least 2")

        def fresh(n: int) -> list[int]:
            return [rng.randrange(0, vocab) for _ in range(n)]

        def sync() -> None:
            if torch.cuda.is_available():
                torch.cuda.synchronize()

        def ttft_ms(prompt: list[int]) -> float:
            engine.add_request({"prompt_token_ids": prompt}, first)
            sync()
            start = time.perf_counter()
            while engine.has_unfinished_requests():
                engine.step()
            sync()
            return (time.perf_counter() - start) * 1e3

        def mixed_ms(n: int) -> float:
            """`joining_decodes` decoding requests; a prompt of n tokens joins: the wall time of the step carrying it."""
            decoding = [engine.add_request({"prompt_token_ids": fresh(32)},
                                           SamplingParams(temperature=0.0, max_tokens=64, ignore_eos=True))
                        for _ in range(joining_decodes)]
            for _ in range(4):
                engine.step()
            engine.add_request({"prompt_token_ids": fresh(n)}, first)
            sync()
            start = time.perf_counter()
            engine.step()
            sync()
            took = (time.perf_counter() - start) * 1e3
            for request_id in decoding:
                engine.abort_request(request_id)
            while engine.has_unfinished_requests():
                engine.step()
            return took

        def use(second: bool) -> None:
            if args.compare == "graphs":
                runner.mixed_graphs = graphs if second else None
                return
            for layer in layers:
                if args.compare == "alone":  # the step-following limit off, then on (the model's own)
                    layer.short_prefill_alone_tokens = default_alone if second else 0
                    continue
                layer.short_prefill_tokens = 1 << 30 if second else 0
                layer.short_prefill_alone_tokens = 0

        for n in lengths:
            samples: dict[str, list[float]] = {f"{name}_{kind}": [] for kind in ("ttft", "mixed") for name in names}
            for r in range(args.rounds + 1):  # round 0 warms both paths at this shape (not kept)
                for second in ((False, True) if r % 2 == 0 else (True, False)):
                    use(second)
                    name = names[second]
                    ttft = ttft_ms(fresh(n))
                    mixed = mixed_ms(n)
                    if r > 0:
                        samples[f"{name}_ttft"].append(round(ttft, 3))
                        samples[f"{name}_mixed"].append(round(mixed, 3))
            summary = {k: statistics.median(v) for k, v in samples.items()}
            print(f"input {n}: " + ", ".join(f"{k} {v:.2f} ms" for k, v in summary.items()), flush=True)
            records.append({"input_len": n, "ms": samples, "median_ms": summary})
        for layer in layers:
            layer.short_prefill_tokens, layer.short_prefill_alone_tokens = default, default_alone
        captured = sorted(graphs.graphs) if graphs is not None else []
        capture_s = graphs.capture_seconds if graphs is not None else 0.0
        # each shape's capture in order: the engine's warm-up's first (Triton compiles included),
        # then those first met by the timed steps (what a new shape costs mid-serving)
        capture_ms = {f"{t}x{r}": round(ms, 1) for (t, r), ms in graphs.capture_ms.items()} if graphs is not None else {}
        if captured:
            print(f"{len(captured)} shapes captured in {capture_s:.2f} s: " +
                  ", ".join(f"{k} {v:.0f} ms" for k, v in capture_ms.items()), flush=True)
    if args.out:
        with open(args.out, "w") as f:
            json.dump({"command": "python benchmarks/bench_short_prefill.py " + " ".join(sys.argv[1:]),
                       "gpu": torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu",
                       "model": preset_label(args.preset, args.num_layers), "dtype": args.dtype,
                       "default_short_prefill_tokens": default,
                       "default_short_prefill_alone_tokens": default_alone, "compare": args.compare,
                       "mtp_num_speculative_tokens": args.mtp, "max_num_seqs": engine.max_num_seqs,
                       "joining_decodes": joining_decodes,
                       "mixed_graph_shapes": captured, "mixed_graph_capture_s": capture_s,
                       "mixed_graph_capture_ms": capture_ms, "records": records}, f,
                      indent=1)


if __name__ == "__main__":
    main()
