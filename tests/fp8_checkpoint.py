"""Block FP8 copies of the tiny checkpoints, written the way the Qwen "-FP8" releases are: every
linear weight of at least two dims in float8 e4m3 with a float32 `*_scale_inv` per block (absmax /
448), except what those releases leave unquantized (embeddings, the LM head, routers and gates,
the delta-net's b/a projections, norms, conv weights); `quantization_config` in config.json."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

FP8_MAX = 448.0
KEPT = ("embed_tokens", "lm_head", "mlp.gate.weight", "shared_expert_gate", "in_proj_ba", "in_proj_b.", "in_proj_a.",
        "conv1d", "norm", "A_log", "dt_bias")


def quantize_block_fp8(w: torch.Tensor, block: tuple[int, int]) -> tuple[torch.Tensor, torch.Tensor]:
    """(float8 e4m3 values, float32 scale_inv [..., ceil(rows/bn), ceil(cols/bk)]) of `w`."""
    bn, bk = block
    *lead, rows, cols = w.shape
    grid_r, grid_c = -(-rows // bn), -(-cols // bk)
    padded = torch.zeros(*lead, grid_r * bn, grid_c * bk)
    padded[..., :rows, :cols] = w.float()
    blocks = padded.reshape(*lead, grid_r, bn, grid_c, bk)
    scale = blocks.abs().amax(dim=(-3, -1)).clamp(min=1e-12) / FP8_MAX  # [..., grid_r, grid_c]
    q = (blocks / scale[..., :, None, :, None]).clamp(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn)
    q = q.reshape(*lead, grid_r * bn, grid_c * bk)[..., :rows, :cols].contiguous()
    return q, scale


def _quantized_name(name: str, tensor: torch.Tensor) -> bool:
    if tensor.dim() < 2 or any(k in name for k in KEPT):
        return False
    return name.endswith(".weight") or name.endswith(("experts.gate_up_proj", "experts.down_proj"))


def fp8_copy(src: Path, dst: Path, *, block=(16, 16), scales_apart: bool = False, twin: Path | None = None,
             only=None) -> Path:
    """A block FP8 copy of checkpoint `src` (all its shards). `scales_apart`: the scales in a
    shard of their own (with an index json), so a weight's scale is read from another file.
    `twin`: also write there the float32 checkpoint of the dequantized values (what the FP8 copy
    means), computed here independently of lamina. `only(name)`: quantize just the tensors it picks
    (of those a release quantizes)."""
    shutil.copytree(src, dst)
    index = dst / "model.safetensors.index.json"
    files = (sorted({*json.loads(index.read_text())["weight_map"].values()}) if index.exists()
             else sorted(p.name for p in dst.glob("*.safetensors")))  # e.g. model + a separate mtp shard
    tensors: dict[str, torch.Tensor] = {}
    for f in files:
        tensors.update(load_file(str(dst / f)))
        (dst / f).unlink()
    index.unlink(missing_ok=True)
    out, dequantized = {}, {}
    for name, t in tensors.items():
        if _quantized_name(name, t) and (only is None or only(name)):
            q, s = quantize_block_fp8(t, block)
            out[name], out[name + "_scale_inv"] = q, s
            grid = s.repeat_interleave(block[0], -2)[..., : t.shape[-2], :].repeat_interleave(block[1], -1)
            dequantized[name] = q.float() * grid[..., : t.shape[-1]]
        else:
            out[name] = dequantized[name] = t
    if scales_apart:
        shards = {"model-00001-of-00002.safetensors": [n for n in out if not n.endswith("_scale_inv")],
                  "model-00002-of-00002.safetensors": [n for n in out if n.endswith("_scale_inv")]}
        for file, names in shards.items():
            save_file({n: out[n] for n in names}, str(dst / file), metadata={"format": "pt"})
        weight_map = {n: file for file, names in shards.items() for n in names}
        index.write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))
    else:
        save_file(out, str(dst / "model.safetensors"), metadata={"format": "pt"})
    config = json.loads((dst / "config.json").read_text())
    config["quantization_config"] = {"quant_method": "fp8", "activation_scheme": "dynamic", "fmt": "e4m3",
                                     "weight_block_size": list(block), "modules_to_not_convert": ["lm_head"]}
    (dst / "config.json").write_text(json.dumps(config))
    if twin is not None:
        shutil.copytree(src, twin)
        for f in files:
            (twin / f).unlink()
        (twin / "model.safetensors.index.json").unlink(missing_ok=True)
        save_file({n: t.contiguous() for n, t in dequantized.items()}, str(twin / "model.safetensors"),
                  metadata={"format": "pt"})
    return dst
