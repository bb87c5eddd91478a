"""Prefill of one gated delta net layer at the Qwen3.5-35B-A3B shape (hidden 2048, 16 key heads and
32 value heads of 128, conv kernel 4), on fla-core's chunked delta rule + lamina's Triton conv
(`LAMINA_GDN_PREFILL=fla`) against the torch references (`LAMINA_GDN_PREFILL=reference`).

    python benchmarks/bench_gdn_prefill.py --output-json gdn_prefill.json                # GPU
    python benchmarks/bench_gdn_prefill.py --device cpu --tiny --kernels reference      # CPU smoke run

For each prompt length T: the whole layer's forward (projections, conv, delta rule, gated norm,
out_proj) for one fresh request of T tokens, and the conv and the delta rule alone, median of
`--repeats` timed runs after `--warmup` runs; and the relative difference of the fla layer's output
from the reference layer's (same weights, same input).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

REAL = dict(hidden=2048, k_heads=16, v_heads=32, head_dim=128, conv=4)
TINY = dict(hidden=64, k_heads=2, v_heads=4, head_dim=16, conv=4)


def build_layer(choice: str, shape: dict, device: torch.device, dtype: torch.dtype):
    """A GatedDeltaNet built with LAMINA_GDN_PREFILL=choice, seeded random weights, one state slot."""
    from lamina.layers.gated_delta_net import GatedDeltaNet
    from lamina.parallel.context import ParallelContext

    os.environ["LAMINA_GDN_PREFILL"] = choice
    layer = GatedDeltaNet(
        hidden_size=shape["hidden"], total_num_k_heads=shape["k_heads"], total_num_v_heads=shape["v_heads"],
        head_k_dim=shape["head_dim"], head_v_dim=shape["head_dim"], conv_kernel_size=shape["conv"],
        rms_norm_eps=1e-6, ctx=ParallelContext.single(device), dtype=dtype, device=device,
    )
    gen = torch.Generator(device="cpu").manual_seed(0)
    with torch.no_grad():
        for name, param in layer.named_parameters():
            if name == "A_log":
                param.copy_(torch.empty(param.shape).uniform_(1, 16, generator=gen).log())
            elif name == "dt_bias" or name.startswith("norm."):
                param.fill_(1.0)
            else:
                std = 1 / math.sqrt(param.shape[-1])
                param.copy_(torch.randn(param.shape, generator=gen) * std)
    layer.bind_state(2, dtype, device)
    return layer


def metadata(num_tokens: int, device: torch.device):
    """One fresh request of `num_tokens` tokens in state slot 0."""
    from lamina.layers.metadata import ForwardMetadata

    def longs(values):
        return torch.tensor(values, dtype=torch.long, device=device)

    return ForwardMetadata(
        num_tokens=num_tokens, num_reqs=1, max_query_len=num_tokens, max_seq_len=num_tokens,
        positions=torch.arange(num_tokens, device=device), query_start_loc=longs([0, num_tokens]),
        seq_lens=longs([num_tokens]), slot_mapping=torch.arange(num_tokens, device=device),
        block_tables=longs([[0]]), state_slots=longs([0]), has_initial_state=torch.zeros(1, dtype=torch.bool, device=device),
        token_request_index=torch.zeros(num_tokens, dtype=torch.long, device=device),
        query_lens_host=(num_tokens,), seq_lens_host=(num_tokens,),
    )


def timed(fn, device: torch.device, warmup: int, repeats: int) -> float:
    """Median milliseconds of `fn()`."""
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(repeats):
        if device.type == "cuda":
            torch.cuda.synchronize()
        t0 = time.perf_counter()
        fn()
        if device.type == "cuda":
            torch.cuda.synchronize()
        times.append((time.perf_counter() - t0) * 1e3)
    return statistics.median(times)


def kernel_calls(layer, x: torch.Tensor, meta):
    """The layer's conv and delta rule alone, on its own kernels, from its projected inputs."""
    from lamina.kernels.causal_conv1d import causal_conv1d_varlen
    from lamina.kernels.gated_delta_rule import gated_delta_rule_varlen

    num_tokens = meta.num_tokens
    with torch.no_grad():
        mixed_qkv, _ = layer.in_proj_qkvz(x).split([layer.conv_dim, layer.value_dim], dim=-1)  # [T, C]
        b, a = layer.in_proj_ba(x).split(layer.num_v_heads, dim=-1)  # [T, Hv] each
        g, beta = layer._gates(b, a)
        q, k, v = torch.randn(num_tokens, layer.conv_dim, device=x.device, dtype=x.dtype).split(
            [layer.key_dim, layer.key_dim, layer.value_dim], dim=-1)
    q = q.reshape(num_tokens, layer.num_k_heads, layer.head_k_dim)  # [T, Hk, Dk]
    k = k.reshape(num_tokens, layer.num_k_heads, layer.head_k_dim)  # [T, Hk, Dk]
    v = v.reshape(num_tokens, layer.num_v_heads, layer.head_v_dim)  # [T, Hv, Dv]
    slots, keep, qsl = meta.state_slots, meta.has_initial_state, meta.query_start_loc
    if layer.prefill_kernels.conv == "triton":
        from lamina.kernels.triton_conv import causal_conv1d_prefill

        def conv():
            return causal_conv1d_prefill(mixed_qkv, layer.conv_weight, layer.conv_state, slots, keep, qsl)
    else:
        conv_in = torch.zeros(1, layer.conv_dim, layer.conv_kernel_size - 1, device=x.device, dtype=x.dtype)

        def conv():
            return causal_conv1d_varlen(mixed_qkv, layer.conv_weight, conv_in, qsl, num_tokens)
    if layer.prefill_kernels.delta_rule == "fla":
        from lamina.kernels.fla_prefill import gated_delta_rule_prefill_fla

        def delta_rule():
            return gated_delta_rule_prefill_fla(q, k, v, g, beta, layer.ssm_state, slots, keep, qsl)
    else:
        state_in = torch.zeros(1, *layer.ssm_state.shape[1:], device=x.device)

        def delta_rule():
            return gated_delta_rule_varlen(q, k, v, g, beta, state_in, qsl, num_tokens, groups=meta.request_groups())
    return conv, delta_rule


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--dtype", default=None, help="default: bfloat16 on CUDA, float32 elsewhere")
    parser.add_argument("--tiny", action="store_true", help="a tiny layer (smoke runs)")
    parser.add_argument("--lengths", default="1024,2048,4096,8192")
    parser.add_argument("--kernels", default="fla,reference", help="comma-separated LAMINA_GDN_PREFILL values")
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--repeats", type=int, default=10)
    parser.add_argument("--output-json", default=None)
    args = parser.parse_args()

    device = torch.device(args.device)
    dtype = getattr(torch, args.dtype or ("bfloat16" if device.type == "cuda" else "float32"))
    shape = TINY if args.tiny else REAL
    choices = args.kernels.split(",")
    layers = {choice: build_layer(choice, shape, device, dtype) for choice in choices}
    result = {
        "command": " ".join(sys.argv), "device": str(device), "dtype": str(dtype).removeprefix("torch."),
        "gpu": torch.cuda.get_device_name() if device.type == "cuda" else None,
        "shape": ("tiny " if args.tiny else "Qwen3.5-35B-A3B ") + json.dumps(shape),
        "kernels": {c: vars(layer.prefill_kernels) for c, layer in layers.items()},
        "warmup": args.warmup, "repeats": args.repeats, "results": [],
    }
    print(json.dumps({k: v for k, v in result.items() if k != "results"}))
    for num_tokens in [int(n) for n in args.lengths.split(",")]:
        meta = metadata(num_tokens, device)
        gen = torch.Generator(device="cpu").manual_seed(num_tokens)
        x = torch.randn(num_tokens, shape["hidden"], generator=gen).to(device, dtype)  # [T, hidden]
        row = {"tokens": num_tokens}
        outputs = {}
        for choice, layer in layers.items():
            with torch.no_grad():
                outputs[choice] = layer(x, meta).float()
                layer_ms = timed(lambda: layer(x, meta), device, args.warmup, args.repeats)
                conv, delta_rule = kernel_calls(layer, x, meta)
                conv_ms = timed(conv, device, args.warmup, args.repeats)
                rule_ms = timed(delta_rule, device, args.warmup, args.repeats)
            row[choice] = {"layer_ms": layer_ms, "conv_ms": conv_ms, "delta_rule_ms": rule_ms,
                           "layer_tokens_per_s": num_tokens / layer_ms * 1e3}
        if "fla" in outputs and "reference" in outputs:
            ref = outputs["reference"]
            row["fla_vs_reference_rel_diff"] = ((outputs["fla"] - ref).norm() / ref.norm()).item()
            row["layer_speedup"] = row["reference"]["layer_ms"] / row["fla"]["layer_ms"]
        result["results"].append(row)
        print(json.dumps(row))
    if args.output_json:
        Path(args.output_json).write_text(json.dumps(result, indent=2) + "\n")


if __name__ == "__main__":
    main()
