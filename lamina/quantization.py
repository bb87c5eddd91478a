"""Block-wise FP8 checkpoints (the Qwen "-FP8" releases, DeepSeek's format): what config.json says,
what the tensor files must hold, and how a weight is turned back into real numbers.

Such a checkpoint declares `quantization_config = {"quant_method": "fp8", "weight_block_size":
[bn, bk], "activation_scheme": "dynamic", ...}` and stores each quantized linear weight `X` as
float8 e4m3 values beside a float32 `X_scale_inv` (`X.weight` -> `X.weight_scale_inv`; a fused 3-D
`experts.gate_up_proj` -> `experts.gate_up_proj_scale_inv`) holding one multiplier per bn x bk
block of the last two dims: `w[..., r, c] = q[..., r, c] * scale_inv[..., r // bn, c // bk]`. The
scale grid is `ceil(rows / bn) x ceil(cols / bk)` (a partial last block has its own multiplier).

Which tensors are quantized is read from the files (a float8 dtype in a shard's header), not
guessed from names or shapes; every one must have its scale tensor with exactly that grid, checked
from the headers before any weight is read. lamina dequantizes each weight as it streams in and
keeps the model's dtype in memory, so every kernel and layout runs unchanged and the result is
what transformers computes from the same files (it dequantizes the same way off a GPU) — except
where a layer keeps its weights in FP8 (`Fp8Weight`): on lamina's Triton kernels the MoE experts
(lamina.layers.moe, lamina.kernels.expert_scales) stay float8 with their scales, half the memory
and the bytes a decode step reads, and the kernels multiply by the scales as they go.

`quantization="fp8"` on an unquantized checkpoint quantizes at load (`ONLINE_FP8`): the routed and
shared experts' weights become block FP8 (128 x 128 blocks, absmax / 448 scales, `quantize_block_fp8`)
as they stream in, exactly as an FP8 checkpoint of those tensors would hold them, and follow that
path (kept FP8 on the Triton kernels, dequantized elsewhere); every other weight keeps its dtype.
Activations stay in the model's dtype (weight-only FP8, unlike vLLM's dynamic per-tensor W8A8).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

SCALE_SUFFIX = "_scale_inv"
FP8_DTYPES = {"F8_E4M3": torch.float8_e4m3fn}
# activation scales of a static scheme; lamina computes activations in the model's dtype
STATIC_ACTIVATION_SUFFIXES = ("input_scale", "activation_scale")
SUPPORTED = "quant_method 'fp8' with weight_block_size [bn, bk], activation_scheme 'dynamic', fmt 'e4m3'"


@dataclass
class Fp8Weight:
    """A checkpoint tensor as stored: float8 values and their block scales, for a layer that keeps
    its weights in FP8 (the loader gives every other layer the dequantized tensor)."""

    values: torch.Tensor  # float8_e4m3fn [..., rows, cols]
    scale_inv: torch.Tensor  # float32 [..., ceil(rows / bn), ceil(cols / bk)]


@dataclass(frozen=True)
class BlockFp8:
    """A checkpoint's block FP8 format (its config.json's quantization_config)."""

    block_rows: int
    block_cols: int
    # quantized at load from an unquantized checkpoint (its expert weights; ONLINE_FP8)
    online: bool = False

    def describe(self) -> str:
        return f"block FP8 (e4m3, {self.block_rows}x{self.block_cols} blocks{', quantized at load' if self.online else ''})"

    def scale_grid(self, shape: tuple[int, ...]) -> tuple[int, ...]:
        """The scale tensor's shape for a quantized weight of `shape` (leading dims kept)."""
        if len(shape) < 2:
            raise ValueError(f"a block-quantized weight has at least 2 dims, got shape {shape}")
        *lead, rows, cols = shape
        return (*lead, -(-rows // self.block_rows), -(-cols // self.block_cols))


def quantization_config_of(hf_config) -> dict | None:
    """The checkpoint's quantization_config (top level, or its text_config's), or None."""
    for config in (hf_config, getattr(hf_config, "text_config", None)):
        value = getattr(config, "quantization_config", None) if config is not None else None
        if value is not None:
            return value if isinstance(value, dict) else value.to_dict()
    return None


def read_quantization(hf_config) -> BlockFp8 | None:
    """The checkpoint's quantization (None: unquantized); refuses what lamina does not run, naming it."""
    qc = quantization_config_of(hf_config)
    if qc is None:
        return None
    method = str(qc.get("quant_method", "")).lower()
    if method != "fp8":
        raise ValueError(f"config.json: quantization_config.quant_method = {qc.get('quant_method')!r} is not "
                         f"supported; lamina runs {SUPPORTED}, or unquantized checkpoints")
    block = qc.get("weight_block_size")
    if block is None:
        raise ValueError("config.json: an fp8 quantization_config without weight_block_size (one scale per "
                         f"tensor) is not supported; lamina runs {SUPPORTED}")
    if (not isinstance(block, (list, tuple)) or len(block) != 2
            or not all(isinstance(b, int) and not isinstance(b, bool) and b > 0 for b in block)):
        raise ValueError(f"config.json: quantization_config.weight_block_size = {block!r} must be two positive "
                         "integers [rows, cols]")
    scheme = str(qc.get("activation_scheme", "dynamic")).lower()
    if scheme != "dynamic":
        raise ValueError(f"config.json: quantization_config.activation_scheme = {scheme!r} is not supported "
                         f"(static activation scales); lamina runs {SUPPORTED}")
    fmt = str(qc.get("fmt", "e4m3")).lower()
    if fmt != "e4m3":
        raise ValueError(f"config.json: quantization_config.fmt = {fmt!r} is not supported; lamina runs {SUPPORTED}")
    scale_fmt = str(qc.get("scale_fmt", "float")).lower()
    if scale_fmt not in ("float", "none"):
        raise ValueError(f"config.json: quantization_config.scale_fmt = {scale_fmt!r} is not supported (float32 "
                         f"scales only); lamina runs {SUPPORTED}")
    return BlockFp8(int(block[0]), int(block[1]))


# The block FP8 format of dummy weights under quantization="fp8" (the Qwen "-FP8" releases' blocks)
DUMMY_FP8 = BlockFp8(128, 128)
# ... and of an unquantized checkpoint's experts under quantization="fp8" (quantized at load)
ONLINE_FP8 = BlockFp8(128, 128, online=True)
FP8_MAX = 448.0  # float8 e4m3's largest finite value


def resolve_quantization(option: str | None, quant: BlockFp8 | None, load_format: str = "auto") -> BlockFp8 | None:
    """The quantization the engine runs: the checkpoint's (`quant`), checked against vLLM's
    `quantization` argument (`check_quantization_option`); with dummy weights, 'fp8' makes them
    block FP8 (DUMMY_FP8) whatever the config says, so benchmarks of real shapes need only a config."""
    if load_format == "dummy" and option is not None and option.lower() == "fp8":
        return quant or DUMMY_FP8
    check_quantization_option(option, quant)
    if quant is None and option is not None and option.lower() == "fp8":
        return ONLINE_FP8  # an unquantized checkpoint: its experts quantized at load
    return quant


def online_blocks(quant: BlockFp8 | None, intermediate_per_rank: int) -> BlockFp8 | None:
    """An at-load quantization's blocks for this layout: 128 x 128 (the Qwen "-FP8" releases') where
    they tile a rank's expert intermediate slice, else the largest power of two down to 16 that does
    (so the Triton MoE kernels keep the experts FP8: lamina.layers.moe.fp8_block_fits); 128 when none
    does. Any other quantization is returned as it is."""
    if quant is None or not quant.online:
        return quant
    for block in (128, 64, 32, 16):
        if intermediate_per_rank and intermediate_per_rank % block == 0:
            return BlockFp8(block, block, online=True)
    return ONLINE_FP8


def check_quantization_option(option: str | None, quant: BlockFp8 | None) -> None:
    """vLLM's `quantization` argument against the checkpoint: None follows the checkpoint; 'fp8'
    asks for the checkpoint's FP8 weights, or an unquantized checkpoint's experts quantized at load
    (`resolve_quantization`)."""
    if option is None:
        return
    name = option.lower()
    if name == "fp8":
        return
    if name == "none":
        if quant is not None:
            raise ValueError(f"quantization = 'none': this checkpoint is {quant.describe()}; leave quantization "
                             "unset (or pass 'fp8') to load it")
        return
    raise ValueError(f"quantization = {option!r} is not supported; supported: fp8 (a block-wise FP8 checkpoint, or "
                     "an unquantized one's experts quantized at load), none, or unset (follow the checkpoint's "
                     "config.json)")


def quantized_tensors(headers, quant: BlockFp8 | None, model_dir) -> dict[str, str]:
    """{quantized weight name: its scale tensor's name}, from the shard headers; every check that
    needs no data is made here: float8 tensors without a quantization_config, other float8
    formats, missing scales, scale grids that do not match the weight and the block size, and
    static activation scales."""
    shapes = {name: info for h in headers for name, info in h.tensors.items()}
    out: dict[str, str] = {}
    for name, (dtype, shape) in shapes.items():
        if quant is not None and name.endswith(STATIC_ACTIVATION_SUFFIXES):
            raise ValueError(f"checkpoint {model_dir}: tensor {name!r} is a static activation scale, which lamina "
                             f"does not apply; it runs {SUPPORTED}")
        if not dtype.startswith("F8"):
            continue
        if dtype not in FP8_DTYPES:
            raise ValueError(f"checkpoint {model_dir}: tensor {name!r} is {dtype}; lamina reads float8 e4m3 "
                             "(F8_E4M3) weights only")
        if quant is None:
            raise ValueError(f"checkpoint {model_dir}: tensor {name!r} is {dtype} but config.json has no "
                             f"quantization_config; lamina runs {SUPPORTED}")
        scale = name + SCALE_SUFFIX
        if scale not in shapes:
            raise ValueError(f"checkpoint {model_dir}: float8 tensor {name!r} has no scale tensor {scale!r}")
        want = quant.scale_grid(shape)
        scale_dtype, scale_shape = shapes[scale]
        if tuple(scale_shape) != want:
            raise ValueError(
                f"checkpoint {model_dir}: {scale!r} has shape {tuple(scale_shape)}, but {name!r} of shape "
                f"{tuple(shape)} in {quant.block_rows}x{quant.block_cols} blocks (weight_block_size) needs {want}"
            )
        if scale_dtype not in ("F32", "BF16", "F16"):
            raise ValueError(f"checkpoint {model_dir}: {scale!r} is {scale_dtype}; lamina reads float scales only")
        out[name] = scale
    return out


def is_expert_tensor(name: str, mtp_prefix: str = "mtp.") -> bool:
    """A routed or shared expert weight of a target layer (`mlp.experts.*`, `mlp.shared_expert.*`),
    the tensors lamina keeps FP8; the MTP drafter's (under `mtp_prefix`) are `is_drafter_expert_tensor`."""
    if name.startswith(mtp_prefix) or name.endswith(SCALE_SUFFIX):
        return False
    return ".mlp.experts." in name or ".mlp.shared_expert." in name


def is_drafter_expert_tensor(name: str, mtp_prefix: str = "mtp.") -> bool:
    """An expert weight of the MTP drafter's layers (under `mtp_prefix`)."""
    return name.startswith(mtp_prefix) and not name.endswith(SCALE_SUFFIX) and (
        ".mlp.experts." in name or ".mlp.shared_expert." in name)


def unquantized_expert_tensors(headers, *, drafter: bool = False, mtp_prefix: str = "mtp.") -> list[str]:
    """Expert tensors (`is_expert_tensor`, or with `drafter` the MTP drafter's) the shard headers hold
    in another dtype than float8: a block FP8 checkpoint with any of them keeps those experts
    (the target's, or the drafter's) dequantized."""
    chosen = is_drafter_expert_tensor if drafter else is_expert_tensor
    return sorted(name for h in headers for name, (dtype, _) in h.tensors.items()
                  if chosen(name, mtp_prefix) and not dtype.startswith("F8"))


def unquantized_experts(model_dir, load_format: str = "auto") -> list[str]:
    """The expert tensors of a block FP8 checkpoint that are not FP8 ([] for dummy weights), from its
    shard headers: with any, lamina keeps every expert dequantized (lamina.layers.moe.fp8_experts_for)."""
    if load_format == "dummy":
        return []
    from lamina.models.loader import read_header, resolve_shards

    return unquantized_expert_tensors([read_header(p) for p in resolve_shards(model_dir)])


def quantize_block_fp8(weight: torch.Tensor, quant: BlockFp8) -> Fp8Weight:
    """`weight` [..., rows, cols] as block FP8: per block of the last two dims (a partial last block
    its own), scale_inv = the block's absolute maximum / 448 in float32, values = weight / scale_inv
    rounded to float8 e4m3 (nearest even); `dequantize` gives the weight back within e4m3's rounding."""
    bn, bk = quant.block_rows, quant.block_cols
    *lead, rows, cols = weight.shape
    grid_r, grid_c = -(-rows // bn), -(-cols // bk)
    padded = weight.new_zeros(*lead, grid_r * bn, grid_c * bk, dtype=torch.float32)
    padded[..., :rows, :cols] = weight.float()
    blocks = padded.reshape(*lead, grid_r, bn, grid_c, bk)  # [..., R, bn, C, bk]
    amax = blocks.abs().amax(dim=(-3, -1)).clamp(min=1e-12)  # [..., R, C]
    # a tensor divisor: CUDA divides by a Python scalar as a product with its reciprocal (not
    # correctly rounded), so the scales would differ from the CPU's in the last bit
    scale_inv = amax / torch.full_like(amax, FP8_MAX)  # [..., R, C]
    values = (blocks / scale_inv[..., :, None, :, None]).clamp(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn)
    values = values.reshape(*lead, grid_r * bn, grid_c * bk)[..., :rows, :cols].contiguous()  # [..., rows, cols]
    return Fp8Weight(values, scale_inv)


def is_quantized_at_load(name: str) -> bool:
    """Under `ONLINE_FP8`: a routed or shared expert weight (the target's or the MTP drafter's),
    which is quantized as it loads."""
    return not name.endswith(SCALE_SUFFIX) and (".mlp.experts." in name or ".mlp.shared_expert." in name)


def dequantize(weight: torch.Tensor, scale_inv: torch.Tensor, quant: BlockFp8) -> torch.Tensor:
    """float32 `weight * scale_inv` with one multiplier per block of the last two dims."""
    *lead, rows, cols = weight.shape
    if tuple(scale_inv.shape) != quant.scale_grid(tuple(weight.shape)):
        raise ValueError(f"scale of shape {tuple(scale_inv.shape)} does not match a weight of shape "
                         f"{tuple(weight.shape)} in {quant.block_rows}x{quant.block_cols} blocks")
    scale = scale_inv.float().repeat_interleave(quant.block_rows, dim=-2)[..., :rows, :]  # [..., rows, col blocks]
    scale = scale.repeat_interleave(quant.block_cols, dim=-1)[..., :cols]  # [..., rows, cols]
    return weight.float() * scale
