"""Build a model for a checkpoint directory and stream its weights in.

Everything that can be checked without reading weights is checked first: the directory, its
config (architecture, fields), the shard headers and the tensor inventory.
"""

from __future__ import annotations

from pathlib import Path

import torch
from transformers import AutoConfig, PretrainedConfig
from transformers.models.auto.configuration_auto import CONFIG_MAPPING

from lamina.layers.norm import GatedRMSNorm, RMSNorm
from lamina.models.loader import CheckpointError, LoadReport, load_checkpoint, resolve_shards
from lamina.quantization import unquantized_experts, read_quantization
from lamina.models.qwen4_exp_config import normalise_layer_type_spelling
from lamina.models.registry import resolve_model_class
from lamina.parallel.context import ParallelContext


def merge_overrides(config: dict, overrides: dict) -> dict:
    """`config` with `overrides` laid over it: a dict value merges into the dict it replaces, key by
    key (vLLM's hf_overrides); anything else replaces."""
    merged = dict(config)
    for key, value in overrides.items():
        if isinstance(value, dict) and isinstance(merged.get(key), dict):
            merged[key] = merge_overrides(merged[key], value)
        else:
            merged[key] = value
    return merged


def read_model_config(model_dir: str | Path, overrides: dict | None = None):
    """The transformers config of `model_dir` (with `overrides`, vLLM's hf_overrides, laid over
    config.json first), with a clear error when it is not a checkpoint."""
    path = Path(model_dir)
    if not path.exists():
        raise CheckpointError(f"model path {str(path)!r} does not exist")
    if not path.is_dir():
        raise CheckpointError(f"model path {str(path)!r} is not a directory")
    if not (path / "config.json").exists():
        raise CheckpointError(f"model path {str(path)!r} has no config.json")
    try:
        config_dict, _ = PretrainedConfig.get_config_dict(str(path))
        if overrides:
            config_dict = merge_overrides(config_dict, overrides)
        if normalise_layer_type_spelling(config_dict) or overrides:  # a spelling this transformers may refuse
            return CONFIG_MAPPING[config_dict["model_type"]].from_dict(config_dict)
        return AutoConfig.from_pretrained(str(path))
    except Exception as e:  # noqa: BLE001 - transformers' config validation raises its own classes
        where = f"{path / 'config.json'} with hf_overrides {overrides}" if overrides else path / "config.json"
        raise CheckpointError(f"cannot read {where}: {e}") from e


def build_model(
    model_dir: str | Path,
    hf_config,
    ctx: ParallelContext,
    *,
    dtype: torch.dtype,
    device: torch.device,
    progress: bool = True,
    layer_range: tuple[int, int] | None = None,
    model_options: dict | None = None,
    load_format: str = "auto",
    seed: int = 0,
):
    """Returns (model, text_config, load_report).

    `load_format="dummy"` (vLLM's name) fills the parameters with seeded random values instead of
    reading a checkpoint: benchmarks of real shapes need only a config.json.
    """
    if load_format not in ("auto", "safetensors", "dummy"):
        raise ValueError(f"load_format {load_format!r} is not one of auto, safetensors, dummy")
    architecture, model_cls = resolve_model_class(hf_config)
    cfg = model_cls.parse_config(hf_config, architecture)
    quantization = read_quantization(hf_config)  # block FP8: dequantized into `dtype` as it streams in ...
    # ... except the experts kept FP8 on the Triton kernels (lamina.layers.moe.fp8_experts_for); the
    # engine's options may also ask for dummy FP8 weights (lamina.quantization.resolve_quantization)
    model_options = {"quantization": quantization} | dict(model_options or {})
    engine_quantization = model_options["quantization"]
    if engine_quantization is not None and engine_quantization.online:  # an unquantized checkpoint's experts
        quantization = engine_quantization  # quantized as they load (lamina.quantization.ONLINE_FP8)
    if engine_quantization is not None and "fp8_experts" not in model_options:
        model_options["fp8_experts"] = engine_quantization.online or not unquantized_experts(model_dir, load_format)
    if load_format != "dummy":
        resolve_shards(Path(model_dir))  # fail on a weightless directory before allocating anything
    model = model_cls(cfg, ctx, dtype=dtype, device=device, layer_range=layer_range, options=model_options or {})
    if (model_options or {}).get("speculative_config") is not None:
        _attach_drafter(model, model_dir, hf_config, model_options, device, load_format)
    if load_format == "dummy":
        init_dummy_weights(model, seed)
        model.eval()
        return model, cfg, LoadReport()
    start, end = model.layer_range

    def other_stage(name: str) -> bool:
        from lamina.models.qwen3_next import checkpoint_layer_index

        if not name.startswith(model.checkpoint_prefix + "layers."):
            return False
        idx = checkpoint_layer_index(name)
        return idx is not None and not start <= idx < end

    weight_map = model.build_weight_map()
    if getattr(model, "mtp", None) is not None:
        model.mtp.add_weights(weight_map)
    online_on_gpu = quantization is not None and quantization.online and torch.device(device).type == "cuda"
    quantize_on = torch.device(device) if online_on_gpu else None
    report = load_checkpoint(
        weight_map, model_dir, skip_prefixes=model.ignored_prefixes, skip_name=other_stage, progress=progress,
        quantization=quantization, quantize_on=quantize_on,
    )
    if quantize_on is not None:  # the quantizer's float32 temporaries: free for the memory plan's reading
        torch.cuda.empty_cache()
    model.eval()
    return model, cfg, report


def _attach_drafter(model, model_dir, hf_config, model_options: dict, device, load_format: str) -> None:
    """Speculative decoding: the last stage's model gets its MTP drafter (lamina.models.mtp)."""
    from lamina.models.loader import read_header

    model.speculative = True  # every stage keeps per-position states; the last one also drafts
    headers = [] if load_format == "dummy" else [read_header(path) for path in resolve_shards(Path(model_dir))]
    attach_drafter(model, hf_config, model_options, device, headers)


def attach_drafter(model, hf_config, model_options: dict, device, headers: list) -> None:
    """Give the last stage's `model` its MTP drafter, from the checkpoint's shard `headers` ([] for
    dummy weights). Its experts stay block FP8 where the target's may (`fp8_experts_for`) and every
    drafter expert tensor of the checkpoint is FP8 (dummy weights: by construction). Also what
    `lamina plan` builds on the meta device."""
    from lamina.layers.moe import fp8_experts_for
    from lamina.models.hybrid_config import num_mtp_layers
    from lamina.models.mtp import attach_mtp
    from lamina.quantization import unquantized_expert_tensors

    prefix = model_options.get("mtp_prefix") or "mtp."
    drafter_fp8 = None
    quantization = model_options.get("quantization")
    if quantization is not None and (quantization.online or not unquantized_expert_tensors(
            headers, drafter=True, mtp_prefix=prefix)):
        drafter_fp8 = fp8_experts_for(dict(model_options, fp8_experts=True), device)
    attach_mtp(
        model, num_layers=num_mtp_layers(hf_config), prefix=prefix, device=device,
        available_names=[n for h in headers for n in h.tensors], fp8_experts=drafter_fp8,
    )


@torch.no_grad()
def init_dummy_weights(model: torch.nn.Module, seed: int, std: float = 0.02, chunk_elements: int = 1 << 26) -> None:
    """Seeded random weights of plausible scale: norms at identity, delta-net decay in range.
    Large tensors (a host PLE table of ~95 GiB) are filled in chunks in their own dtype, so no
    float32 copy of them is ever made."""
    for index, (name, param) in enumerate(model.named_parameters()):
        if param.device.type == "meta":
            continue
        gen = torch.Generator(device=param.device).manual_seed(seed * 1_000_003 + index)
        if name.endswith("_scale_inv"):  # block FP8: values of unit scale times `std`
            param.fill_(std)
        elif name.endswith("A_log"):
            param.copy_(torch.empty(param.shape, device=param.device).uniform_(1.0, 16.0, generator=gen).log())
        elif name.endswith("dt_bias"):
            param.zero_()
        else:
            flat = param.view(-1)
            for start in range(0, flat.numel(), chunk_elements):
                part = flat[start : start + chunk_elements]
                spread = 1.0 if param.dtype == torch.float8_e4m3fn else std
                part.copy_(torch.empty(part.shape, device=param.device, dtype=torch.float32).normal_(0.0, spread, generator=gen))
    for module in model.modules():
        if isinstance(module, RMSNorm):
            module.weight.fill_(0.0 if module.zero_centred else 1.0)
        elif isinstance(module, GatedRMSNorm):
            module.weight.fill_(1.0)
