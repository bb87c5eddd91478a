"""How long `--quantization fp8` takes to quantize one Qwen3.5-35B-A3B layer's routed experts as
they load (fused gate_up [256, 1024, 2048] and down [256, 2048, 512] in bf16, 128 x 128 blocks):
on the CPU (where shards are read) and on the GPU (the loader's `quantize_on`). Prints one line
per device and the whole model's estimate (40 layers)."""

from __future__ import annotations

import time

import torch

from lamina.quantization import BlockFp8, quantize_block_fp8

LAYERS = 40


def seconds_per_layer(device: str, tensors: list[torch.Tensor]) -> float:
    quant = BlockFp8(128, 128, online=True)
    quantize_block_fp8(tensors[1][:2].to(device), quant)  # warm-up
    if device == "cuda":
        torch.cuda.synchronize()
    start = time.perf_counter()
    for t in tensors:
        out = quantize_block_fp8(t.to(device), quant)
    if device == "cuda":
        torch.cuda.synchronize()
    del out
    return time.perf_counter() - start


def main() -> None:
    torch.manual_seed(0)
    tensors = [torch.randn(256, 1024, 2048, dtype=torch.bfloat16), torch.randn(256, 2048, 512, dtype=torch.bfloat16)]
    devices = ["cpu"] + (["cuda"] if torch.cuda.is_available() else [])
    for device in devices:
        per_layer = seconds_per_layer(device, tensors)
        print(f"{device}: {per_layer:.3f} s a layer's routed experts (host copy included), "
              f"{per_layer * LAYERS:.1f} s for {LAYERS} layers ({torch.get_num_threads()} CPU threads)")


if __name__ == "__main__":
    main()
