"""Triton's CPU interpreter (TRITON_INTERPRET=1, CI) without its redundant re-patching.

For a launch the interpreter (triton.runtime.interpreter) patches the `triton.language` modules
that the kernel's module sees, runs the programs one after another, and restores the modules. But
it patches them again at every call of a `@triton.jit` helper inside a program: `tl.sum`, `tl.max`,
`tl.zeros`, `tl.cdiv`, lamina's `wait_for_producer`, `softmax_topk`, ... About 0.3 ms a call and
several calls a program: half the time of a small kernel (the routing kernel, the split decode
attention), nearly half of the suite's (948 s before, 522 s after on the 2-core CI machine).

`install()` lets a helper's call skip the language modules that its launch has already patched:
patching them again would set the same interpreter functions (a builtin once wrapped is no longer
a builtin, so it is not wrapped twice). Modules the launch has not patched yet (`tl.core`, which
Triton's own helpers see) are patched as before, once per launch; and a helper's patch is never
restored, in Triton as here. So every kernel runs the same interpreted operations: same results,
faster. `worker_main` is the rank processes' entry with the same change (spawned processes do not
run the conftest).

It also sums the interpreter's float dots in an order no BLAS kernel or tile shape changes, and
bf16 ones from their values rather than their bits (`_order_free_dots`), and stops the interpreter
computing the int32 overflow checks that Triton drops outside its debug mode
(`_skip_dead_overflow_checks`): in `test_multirank_graphs.py` and `test_triton_kernels.py` together,
254 s before and 179 s after on this 2-core machine; one interpreted one-token MoE GEMV call
181 -> 93 ms.
"""

from __future__ import annotations

import dataclasses
import inspect
import os
import threading
import warnings

_installed = False
# Called as observe(kernel function, args, kwargs) at each launch (tests/triton_compile_check.py)
launch_observers: list = []
_launch = threading.local()  # .patched: ids of the language modules patched by this thread's launch


class _NothingToRestore:
    def restore(self) -> None:
        pass


def install() -> bool:
    """Patch Triton's interpreter in this process (idempotent). False where it does not apply: no
    TRITON_INTERPRET or no Triton; or, with a warning, an interpreter without the functions this
    relies on (the suite then runs at the interpreter's own speed)."""
    global _installed
    if _installed:
        return True
    if os.environ.get("TRITON_INTERPRET") != "1":
        return False
    try:
        import triton.language as tl
        from triton.runtime import interpreter
    except ImportError:
        return False
    grid_call = getattr(getattr(interpreter, "GridExecutor", None), "__call__", None)
    patch_lang = getattr(interpreter, "_patch_lang", None)
    if grid_call is None or patch_lang is None or not hasattr(interpreter, "_LangPatchScope"):
        warnings.warn("tests/triton_interpreter.py: this Triton's interpreter lacks GridExecutor, _patch_lang or "
                      "_LangPatchScope; the interpreted tests run without the speed-up", stacklevel=2)
        return False

    langs_of: dict = {}  # function -> ids of the language modules in its globals, those _patch_lang patches

    def patch_once(fn):
        langs = langs_of.get(fn)
        if langs is None:
            modules = (v for v in fn.__globals__.values() if inspect.ismodule(v))
            langs = langs_of[fn] = {id(m) for m in modules if m in (tl, tl.core)}
        patched = getattr(_launch, "patched", None)
        if patched is not None and langs <= patched:
            return _NothingToRestore()  # a helper's call in a launch that has patched these modules
        scope = patch_lang(fn)
        if patched is not None:
            patched |= langs
        return scope

    def launch(self, *args, **kwargs):
        for observe in launch_observers:
            observe(self.fn, args, kwargs)
        outer = getattr(_launch, "patched", None)
        _launch.patched = set()  # the launch's own patch (the kernel's modules) is the first
        try:
            return grid_call(self, *args, **kwargs)
        finally:
            _launch.patched = outer

    interpreter._patch_lang = patch_once
    interpreter.GridExecutor.__call__ = launch
    _skip_dead_overflow_checks(interpreter)
    _exact_fp8_downcasts(interpreter)
    _order_free_dots(interpreter)
    _installed = True
    return True


def _exact_fp8_downcasts(interpreter) -> None:
    """Triton 3.9's interpreter converts a float to FP8 by cutting the significand and adding its next
    bit, without carrying into the exponent when that overflows (31.5 becomes 16 in e4m3, not 32) and
    rounding halves up; a GPU converts round-to-nearest-even (cvt.rn), as torch does. Here downcasts
    to fp8e4nv / fp8e5 (the FP8 KV cache's writers) go through torch's conversion; every other
    conversion is the interpreter's own."""
    import numpy as np
    import torch
    import triton.language as tl

    convert = getattr(interpreter, "_convert_float", None)
    if convert is None:
        return
    targets = {tl.float8e4nv: torch.float8_e4m3fn, tl.float8e5: torch.float8_e5m2}

    def to_fp8(input, input_dtype, output_dtype, rounding_mode):
        target = targets.get(output_dtype)
        if target is None or input_dtype.primitive_bitwidth <= 8:
            return convert(input, input_dtype, output_dtype, rounding_mode)
        if input_dtype == tl.float32:
            values = np.frombuffer(input.tobytes(), dtype=np.float32)
        else:  # a 16-bit float: widened exactly by the interpreter itself
            values = convert(input, input_dtype, tl.float32, rounding_mode).view(np.float32).reshape(-1)
        fp8 = torch.from_numpy(values.copy()).to(target)
        return fp8.view(torch.uint8).numpy().reshape(input.shape)

    interpreter._convert_float = to_fp8


def _order_free_dots(interpreter) -> None:
    """The interpreter's `tl.dot` is NumPy's matmul, i.e. the BLAS NumPy ships (OpenBLAS), whose
    float32 sum of an element depends on the CPU's kernel and on the matrix's shape: on an AMD EPYC
    (OpenBLAS's Zen / Haswell kernels) a query row summed in a 32-row tile differs in its last bit
    from the same row in a 4-row tile, where the SkylakeX and generic kernels agree, so the tests
    that hold kernels bit for bit with each other (MTP verification rows against the one-token
    decode kernel) passed on one CI machine and failed on another. A GPU's MMA sums each element
    in an order fixed by the instruction, whatever the number of rows. Here a dot of float16,
    bfloat16 or float32 operands is summed in float64 and rounded once to the accumulator's dtype
    (each element's correctly rounded value, barring double-rounding ties and heavy cancellation),
    then added to the accumulator as before: the same value for a row whatever the tile or the
    machine. bfloat16 operands are read from their bits: the interpreter keeps them as raw uint16
    and its own dot multiplied those as integers (bf16 tiles were tested on a GPU only, or through
    a per-test conversion); a GPU's bf16 MMA forms the same products exactly in float32. Other dots
    (FP8 operands, integers) are the interpreter's own."""
    import numpy as np
    import triton.language as tl

    builder_cls = getattr(interpreter, "InterpreterBuilder", None)
    original = getattr(builder_cls, "create_dot", None)
    handle_cls = getattr(interpreter, "TensorHandle", None)
    if original is None or handle_cls is None:
        return
    exact_kinds = (np.float16, np.float32, np.float64)

    def widened(operand):
        """The operand in float64, or None: float16 / float32 data as they are, bfloat16 (kept by the
        interpreter as its raw bits in uint16) from its bits."""
        data = operand.data
        if data.dtype in exact_kinds:
            return data.astype(np.float64)
        if operand.dtype.scalar == tl.bfloat16 and data.dtype == np.uint16:
            return (data.astype(np.uint32) << 16).view(np.float32).astype(np.float64)
        return None

    def create_dot(self, a, b, d, input_precision, max_num_imprecise_acc):
        acc = d.data
        lhs, rhs = widened(a), widened(b)
        if lhs is None or rhs is None or acc.dtype not in exact_kinds:
            return original(self, a, b, d, input_precision, max_num_imprecise_acc)
        product = np.matmul(lhs, rhs).astype(acc.dtype)
        return handle_cls(product + acc, d.dtype.scalar)

    builder_cls.create_dot = create_dot


def _skip_dead_overflow_checks(interpreter) -> None:
    """Off Triton's debug mode, the int32 overflow check of `+`, `-` and `*` (`sanitize_overflow`)
    ends in a `device_assert` that is dropped, on the GPU and in the interpreter alike: the GPU
    compiles the check away, but the interpreter computes it (casts to int64, the operation again,
    two comparisons) with NumPy and throws it away, at every integer `+`, `-` and `*` of every
    program. Here it is not computed when the interpreter's options have debug off (in Triton 3.9
    they always do: its interpreter never turns debug on, so no check could fire either way)."""
    builder = getattr(interpreter, "interpreter_builder", None)
    options = getattr(builder, "options", None)
    if options is None or not dataclasses.is_dataclass(options) or getattr(options, "debug", True):
        return
    if getattr(options, "sanitize_overflow", False):
        builder.options = dataclasses.replace(options, sanitize_overflow=False)


def worker_main(*args, **kwargs):
    """`lamina.worker.worker.worker_main` in a spawned rank process, with `install()` first."""
    from lamina.worker.worker import worker_main as real

    install()
    return real(*args, **kwargs)
