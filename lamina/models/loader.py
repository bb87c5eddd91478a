"""Stream safetensors checkpoints into a model's preallocated parameters, shard by shard.

Before any weight is read: the shard list is resolved (single file or index json), every shard's
header is parsed and checked against the file size (a truncated download is named), and the
checkpoint's tensor names are compared with what the model needs (missing tensors are named).
Then each shard is memory-mapped and its tensors copied one at a time into the parameters, which
converts the dtype and moves them to the device; no second full copy of the model exists.
`mtp.*` tensors are loaded when the model built an MTP drafter (speculative decoding) and are
otherwise recorded (name, shape, file), never an error. A block FP8 checkpoint's weights are
dequantized as they stream in (lamina.quantization), each with its scale tensor.
"""

from __future__ import annotations

import json
import logging
import struct
from contextlib import ExitStack
from dataclasses import dataclass, field
from pathlib import Path

from safetensors import safe_open
from tqdm.auto import tqdm

from lamina.quantization import BlockFp8, Fp8Weight, dequantize, is_quantized_at_load, quantize_block_fp8, quantized_tensors
from lamina.models.weight_map import WeightMap

logger = logging.getLogger(__name__)

SIDE_PREFIXES = ("mtp.",)


class CheckpointError(ValueError):
    """A checkpoint is missing, truncated, or does not match the model's config."""


@dataclass
class ShardHeader:
    path: Path
    tensors: dict[str, tuple[str, tuple[int, ...]]]  # name -> (dtype, shape)


@dataclass
class LoadReport:
    loaded: list[str] = field(default_factory=list)
    side_tensors: dict[str, tuple[Path, tuple[int, ...]]] = field(default_factory=dict)  # e.g. mtp.*
    skipped: list[str] = field(default_factory=list)
    unexpected: list[str] = field(default_factory=list)


def resolve_shards(model_dir: Path) -> list[Path]:
    model_dir = Path(model_dir)
    index = model_dir / "model.safetensors.index.json"
    if index.exists():
        try:
            weight_map = json.loads(index.read_text())["weight_map"]
        except (json.JSONDecodeError, KeyError) as e:
            raise CheckpointError(f"{index} is not a valid safetensors index (need a 'weight_map'): {e}") from e
        files = sorted(set(weight_map.values()))
        missing = [f for f in files if not (model_dir / f).exists()]
        if missing:
            raise CheckpointError(f"{index} lists shard files that do not exist: {missing}")
        return [model_dir / f for f in files]
    files = sorted(model_dir.glob("*.safetensors"))
    if not files:
        raise CheckpointError(f"no weights in {model_dir}: expected model.safetensors or model.safetensors.index.json")
    return files


def read_header(path: Path) -> ShardHeader:
    """Parse a safetensors header and check that the file holds all the data it declares."""
    size = path.stat().st_size
    with open(path, "rb") as f:
        raw_len = f.read(8)
        if len(raw_len) < 8:
            raise CheckpointError(f"{path} is truncated or not a safetensors file ({size} bytes)")
        (header_len,) = struct.unpack("<Q", raw_len)
        if header_len > size - 8:
            raise CheckpointError(f"{path} is truncated or not a safetensors file: header of {header_len} bytes, file of {size}")
        try:
            header = json.loads(f.read(header_len))
        except (json.JSONDecodeError, UnicodeDecodeError) as e:
            raise CheckpointError(f"{path} has a corrupt safetensors header: {e}") from e
    tensors: dict[str, tuple[str, tuple[int, ...]]] = {}
    data_end = 0
    for name, info in header.items():
        if name == "__metadata__":
            continue
        tensors[name] = (info["dtype"], tuple(info["shape"]))
        data_end = max(data_end, int(info["data_offsets"][1]))
    if 8 + header_len + data_end > size:
        raise CheckpointError(
            f"{path} is truncated: its header declares {8 + header_len + data_end} bytes but the file has {size}"
        )
    return ShardHeader(path, tensors)


def load_checkpoint(
    weight_map: WeightMap,
    model_dir: str | Path,
    *,
    skip_prefixes: tuple[str, ...] = (),
    skip_name: "callable | None" = None,
    progress: bool = True,
    quantization: BlockFp8 | None = None,
    quantize_on: torch.device | None = None,
) -> LoadReport:
    """Load every tensor `weight_map` needs from the checkpoint in `model_dir`.

    `skip_prefixes` / `skip_name(name)` mark tensors that belong to other parts (a vision tower,
    layers of other pipeline stages) and are skipped without reading them. `quantization`: the
    checkpoint's block FP8 format (its config.json's), which its float8 tensors must follow; or
    `ONLINE_FP8` (an unquantized checkpoint): its expert weights are quantized as they are read, kept
    FP8 where `weight_map.keeps_fp8` says so and dequantized again elsewhere, as an FP8 checkpoint of
    them would load. `quantize_on`: the device that quantizes them (the model's GPU: the CPU takes
    minutes over a 35B checkpoint's experts); None: the CPU, where shards are read.
    """
    shards = [read_header(p) for p in resolve_shards(Path(model_dir))]
    online = quantization is not None and quantization.online
    report = LoadReport()
    try:
        scale_of = quantized_tensors(shards, quantization, model_dir)  # {fp8 weight: its scale tensor}
    except ValueError as e:
        raise CheckpointError(str(e)) from e
    scales = set(scale_of.values())
    shard_of = {name: s.path for s in shards for name in s.tensors}
    available = {name for s in shards for name in s.tensors} - scales
    missing = weight_map.missing(available)
    if missing:
        shown = "\n  ".join(missing[:20])
        more = f"\n  ... and {len(missing) - 20} more" if len(missing) > 20 else ""
        raise CheckpointError(f"checkpoint {model_dir} is missing {len(missing)} tensor(s):\n  {shown}{more}")

    bar = tqdm(shards, desc="Loading safetensors shards", unit="shard", disable=not progress or len(shards) < 1)
    other_shards = ExitStack()  # shards holding scales of another shard's weights, each opened once
    opened: dict[Path, object] = {}

    def scale_tensor(scale_name: str):
        path = shard_of[scale_name]
        if path not in opened:
            opened[path] = other_shards.enter_context(safe_open(str(path), framework="pt", device="cpu"))
        return opened[path].get_tensor(scale_name)

    with other_shards:  # closed however the loading ends
        for shard in bar:
            with safe_open(str(shard.path), framework="pt", device="cpu") as f:

                def read(name: str):
                    if online and is_quantized_at_load(name):
                        tensor = f.get_tensor(name)
                        quantized = quantize_block_fp8(tensor if quantize_on is None else tensor.to(quantize_on),
                                                       quantization)
                        if name in weight_map.keeps_fp8:
                            return quantized
                        return dequantize(quantized.values, quantized.scale_inv, quantization)
                    if name not in scale_of:
                        return f.get_tensor(name)
                    scale_name = scale_of[name]
                    scale = f.get_tensor(scale_name) if shard_of[scale_name] == shard.path else scale_tensor(scale_name)
                    if name in weight_map.keeps_fp8:
                        return Fp8Weight(f.get_tensor(name), scale)
                    return dequantize(f.get_tensor(name), scale, quantization)

                for name in f.keys():
                    if name in scales:  # read with its weight
                        continue
                    if name.startswith(SIDE_PREFIXES) and name not in weight_map.loaders and name not in weight_map.ignored:
                        report.side_tensors[name] = (shard.path, shard.tensors[name][1])
                        continue
                    if name.startswith(skip_prefixes) or (skip_name is not None and skip_name(name)) or name in weight_map.ignored:
                        report.skipped.append(name)
                        continue
                    loader = weight_map.loaders.get(name)
                    if loader is None:
                        report.unexpected.append(name)
                        continue
                    try:
                        loader(name, read(name))
                    except CheckpointError:
                        raise
                    except ValueError as e:
                        raise CheckpointError(f"{shard.path.name}: {e}") from e
                    report.loaded.append(name)
    if report.unexpected:
        logger.warning("ignored %d unexpected checkpoint tensors, e.g. %s", len(report.unexpected), report.unexpected[:5])
    return report
