"""Every launch of a lamina Triton kernel passes `**FP_FUSION` (lamina/kernels/launch_options.py):
FP contraction stays what the kernels were tuned and checked with, whatever the installed Triton's
default (3.10 turns it off). A scan of the source, so it covers launches no test reaches; the
launches a test does reach are also checked at run time (tests/test_triton_compiles.py)."""

from __future__ import annotations

import ast
from pathlib import Path

import lamina

LAMINA = Path(lamina.__file__).resolve().parent
KERNELS = LAMINA / "kernels"


def _is_triton_jit(decorator: ast.expr) -> bool:
    target = decorator.func if isinstance(decorator, ast.Call) else decorator
    return ast.unparse(target) == "triton.jit"


def launches_without_fusion(source: str) -> tuple[int, list[int]]:
    """(launches, lines of those without `**FP_FUSION`) of one module's source. A launch is a call
    of a subscripted name, `kernel[grid](...)`: in lamina/kernels nothing else is written so."""
    tree = ast.parse(source)
    count, missing = 0, []
    for node in ast.walk(tree):
        launch = isinstance(node, ast.Call) and isinstance(node.func, ast.Subscript)
        if launch and isinstance(node.func.value, ast.Name):
            count += 1
            if not any(k.arg is None and ast.unparse(k.value) == "FP_FUSION" for k in node.keywords):
                missing.append(node.lineno)
    return count, missing


def test_every_kernel_launch_passes_fp_fusion():
    total, missing = 0, []
    for path in sorted(KERNELS.glob("*.py")):
        count, lines = launches_without_fusion(path.read_text())
        total += count
        missing += [f"{path.name}:{line}" for line in lines]
    assert total >= 34, total  # the scan sees the launches (34 when this test was written)
    assert not missing, f"launches without **FP_FUSION: {missing}"


def test_triton_kernels_live_in_lamina_kernels():
    """The scan above covers lamina/kernels: no `@triton.jit` function is defined elsewhere."""
    elsewhere = []
    for path in sorted(LAMINA.rglob("*.py")):
        if path.parent == KERNELS:
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.FunctionDef) and any(_is_triton_jit(d) for d in node.decorator_list):
                elsewhere.append(f"{path.relative_to(LAMINA)}:{node.name}")
    assert not elsewhere, elsewhere


def test_the_scan_finds_a_launch_without_the_option():
    source = (
        "def launch(x):\n"
        "    _a_kernel[(1,)](x, BLOCK=16, **pdl_kwargs(x.device), **FP_FUSION)\n"
        "    _b_kernel[(2, 3)](x, num_warps=4)\n"
        "    kernel = _a_kernel\n"
        "    kernel[grid(8)](x, **FP_FUSION)\n"
    )
    assert launches_without_fusion(source) == (3, [3])
