"""Compile options that every launch of a lamina Triton kernel passes explicitly.

`FP_FUSION`: floating-point contraction on (`a * b + c` compiled as one fused multiply-add, one
rounding instead of two). Triton up to 3.9 contracts by default; 3.9 warns that 3.10 will not
(`TRITON_DEFAULT_FP_FUSION`). lamina's kernels were tuned, timed and checked on H100 / H200 with
contraction on: the decode GEMVs' FMA kernels, the MoE slot sum checked bit for bit against the
id-free sum, the seeded sampling noise within a few float32 ulps of the CPU's. So a launch asks
for it rather than follow the installed Triton's default, and a Triton upgrade does not change
what the kernels compute. Triton's own override still wins where it has one (3.9:
`TRITON_FORCE_DISABLE_FP_FUSION=1` turns contraction off whatever a launch asks). Under Triton's
interpreter (CI) the option is ignored: the interpreter runs each operation in numpy, where nothing
is contracted.

tests/test_triton_launch_options.py checks that every launch in `lamina/kernels` passes it (and
that no Triton kernel lives elsewhere), and tests/test_triton_compiles.py that the launches it
records carry it into their compile.
"""

from __future__ import annotations

__all__ = ["FP_FUSION"]

FP_FUSION = {"enable_fp_fusion": True}
