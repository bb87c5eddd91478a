"""The block scales of FP8 expert weights, as the Triton MoE kernels take them.

A block FP8 checkpoint (lamina.quantization) stores each weight as float8 e4m3 values and
one float32 multiplier per `bn x bk` block of its last two dims. Kept that way on the device, the
routed experts' `w13 [E, 2I, H]` and `w2 [E, H, I]` come with `w13 [E, 2I/bn, ceil(H/bk)]` and
`w2 [E, ceil(H/bn), I/bk]` scales (and the shared expert's, riding in the same launches, with
theirs). The kernels read the weights as float8, half the bytes of bfloat16: the decode GEMVs
multiply the activations by a block's scale (a program's output rows lie in one block row); the
grouped kernels dequantize each weight tile into the activations' dtype before its dot (or, config
`fp8_scale_b` 0, scale the tile's products after it).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass
class ExpertScales:
    w13: torch.Tensor  # [E_local, 2I/bn, ceil(H/bk)] float32
    w2: torch.Tensor  # [E_local, ceil(H/bn), I/bk] float32
    block: tuple[int, int]  # (bn, bk): rows x columns of a block, powers of two
    shared_w13: torch.Tensor | None = None  # [2I/bn, ceil(H/bk)]: the shared expert's, when it rides along
    shared_w2: torch.Tensor | None = None  # [ceil(H/bn), I/bk]

    def pointers(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
        """(w13, w2, shared w13, shared w2) scales; the routed ones stand in for an absent shared expert."""
        return (self.w13, self.w2, self.w13 if self.shared_w13 is None else self.shared_w13,
                self.w2 if self.shared_w2 is None else self.shared_w2)

    def check(self, w13: torch.Tensor, w2: torch.Tensor, shared: tuple | None) -> None:
        """The weights are float8 and the scales have their grids; a block row never straddles the
        gate / up boundary (I a multiple of bn)."""
        bn, bk = self.block
        if bn & (bn - 1) or bk & (bk - 1) or bk < 16:
            raise ValueError(f"FP8 experts: block {self.block} must be powers of two, the columns at least 16 "
                             "(a tl.dot tile's K)")
        experts, two_inter, hidden = w13.shape
        inter = two_inter // 2
        if inter % bn or inter % bk:
            raise ValueError(f"FP8 experts: intermediate size {inter} is not a multiple of the block {self.block}")
        want = {"w13": (experts, two_inter // bn, -(-hidden // bk)), "w2": (experts, -(-hidden // bn), inter // bk)}
        for name, tensor, weight in (("w13", self.w13, w13), ("w2", self.w2, w2)):
            if weight.dtype != torch.float8_e4m3fn:
                raise ValueError(f"FP8 experts: {name} is {weight.dtype}, expected float8_e4m3fn")
            if tuple(tensor.shape) != want[name] or tensor.dtype != torch.float32:
                raise ValueError(f"FP8 experts: {name} scales {tuple(tensor.shape)} {tensor.dtype}, expected "
                                 f"{want[name]} float32")
        if shared is not None:
            if self.shared_w13 is None or self.shared_w2 is None:
                raise ValueError("FP8 experts: the shared expert rides along without its scales")
            for name, tensor, weight in (("w13", self.shared_w13, shared[0]), ("w2", self.shared_w2, shared[1])):
                if weight.dtype != torch.float8_e4m3fn or tuple(tensor.shape) != want[name][1:]:
                    raise ValueError(f"FP8 experts: the shared expert's {name} ({weight.dtype}, scales "
                                     f"{tuple(tensor.shape)}) does not match the routed experts' format")
