"""Compile the Triton kernels that an interpreted run launched, for a GPU, without one.

Triton's CPU interpreter (CI) runs a kernel's Python body: it does not build the kernel's IR, so
what only the compiler refuses (a value redefined with another type in a branch, a constexpr
misused, a call of a missing function) passes CI and fails on the GPU (session 35: the q/k prep
kernel on a bf16 model with an FP8 KV cache). Here:

- `record_launches()` notes every launch made under the interpreter in its scope: the kernel
  (module and name), each argument (a tensor's dtype, or a scalar's value) and the launch's
  `num_warps` / `num_stages`;
- `start_rank_recording` / `stop_rank_recording` do the same in the rank processes of a
  multi-rank engine (through `collective_rpc`), whose launches carry the shards' sizes;
- `compile_recorded(records)` builds each distinct launch's Triton IR for an sm90 target in a
  process without the interpreter (where the kernels are real `@triton.jit` functions), once as
  launched and, for kernels with a `PDL` constexpr, once with programmatic dependent launch on (what
  an H100 / H200 runs), and returns the errors. The front end alone (Python AST -> Triton IR)
  runs: that is where the type checks are, at about 15 ms a launch, where the whole compile to a
  cubin takes seconds.
"""

from __future__ import annotations

import contextlib
import importlib
import json
import os
import subprocess
import sys
from pathlib import Path

import torch
import triton
import triton.language as tl

# The compile options of a launch that the record keeps and the compile uses.
LAUNCH_OPTIONS = ("num_warps", "num_stages", "enable_fp_fusion")

TORCH_TO_TRITON = {
    torch.float32: "fp32", torch.bfloat16: "bf16", torch.float16: "fp16", torch.float64: "fp64",
    torch.float8_e4m3fn: "fp8e4nv", torch.float8_e5m2: "fp8e5", torch.int8: "i8", torch.uint8: "u8",
    torch.int16: "i16", torch.int32: "i32", torch.int64: "i64", torch.bool: "i1",
}


def describe_argument(value):
    """JSON for one launch argument: {"tensor": triton dtype} or {"value": a scalar}."""
    if isinstance(value, torch.Tensor):
        if value.dtype not in TORCH_TO_TRITON:
            raise TypeError(f"no Triton pointer type for a {value.dtype} tensor")
        return {"tensor": TORCH_TO_TRITON[value.dtype]}
    if value is None or isinstance(value, (bool, int, float, str)):
        return {"value": value}
    if type(value).__name__ == "dtype" and type(value).__module__.startswith("triton"):
        return {"triton_dtype": str(value)}
    raise TypeError(f"launch argument of type {type(value).__name__} is not recorded")


@contextlib.contextmanager
def record_launches():
    """Yields a list that fills with one record per launch made in the block (Triton's interpreter,
    patched by tests/triton_interpreter.py): {"module", "name", "args": {name: described},
    "options": the LAUNCH_OPTIONS it passed}."""
    import inspect

    from tests import triton_interpreter

    records: list[dict] = []

    def observe(fn, args, kwargs):
        names = list(inspect.signature(fn).parameters)
        bound = dict(zip(names, args))
        bound.update({k: v for k, v in kwargs.items() if k in names})
        options = {k: kwargs[k] for k in LAUNCH_OPTIONS if kwargs.get(k) is not None}
        records.append({"module": fn.__module__, "name": fn.__name__,
                        "args": {k: describe_argument(v) for k, v in bound.items()}, "options": options})

    triton_interpreter.launch_observers.append(observe)
    try:
        yield records
    finally:
        triton_interpreter.launch_observers.remove(observe)


_rank_recording: list = []  # in a rank process: the open `record_launches` scope and its records


def start_rank_recording(runner) -> None:
    """For `collective_rpc`: start recording the interpreted launches of this rank's process (rank
    processes install tests/triton_interpreter.py too, tests/conftest.py)."""
    scope = record_launches()
    _rank_recording[:] = [scope, scope.__enter__()]


def stop_rank_recording(runner) -> list[dict]:
    """For `collective_rpc`: this rank's records since `start_rank_recording`."""
    scope, records = _rank_recording
    scope.__exit__(None, None, None)
    _rank_recording.clear()
    return records


def distinct(records: list[dict]) -> list[dict]:
    seen, out = set(), []
    for record in records:
        key = json.dumps(record, sort_keys=True)
        if key not in seen:
            seen.add(key)
            out.append(record)
    return out


def compile_recorded(records: list[dict], tmp_dir: Path, timeout: float = 300) -> dict:
    """Build the IR of every distinct record (and its PDL twin) in a fresh process without Triton's
    interpreter. Returns {"compiled": n, "errors": [text, ...]}, or {"unsupported": why} from a
    Triton whose compiler internals differ."""
    path = Path(tmp_dir) / "launches.json"
    path.write_text(json.dumps(distinct(records)))
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    root = Path(__file__).resolve().parent.parent
    done = subprocess.run([sys.executable, "-m", "tests.triton_compile_check", str(path)], cwd=root, env=env,
                          capture_output=True, text=True, timeout=timeout)
    if done.returncode != 0:
        raise RuntimeError(f"the compile process failed ({done.returncode}):\n{done.stderr[-4000:]}")
    return json.loads(done.stdout.strip().splitlines()[-1])


def _signature(kernel, record: dict):
    """(signature, constexprs) of a record for `kernel` (a triton.runtime.jit.JITFunction)."""
    signature, constexprs = {}, {}
    for param in kernel.params:
        arg = record["args"].get(param.name)
        if arg is None:  # a parameter left at its default
            default = kernel.signature.parameters[param.name].default
            arg = {"value": default}
        if "triton_dtype" in arg:
            value = getattr(tl, arg["triton_dtype"], None) or tl.str_to_ty(arg["triton_dtype"])
            signature[param.name], constexprs[param.name] = "constexpr", value
        elif param.is_constexpr or arg.get("value", 0) is None:
            signature[param.name], constexprs[param.name] = "constexpr", arg["value"]
        elif "tensor" in arg:
            signature[param.name] = "*" + arg["tensor"]
        else:
            value = arg["value"]
            if isinstance(value, bool):
                signature[param.name] = "i1"
            elif isinstance(value, int):
                signature[param.name] = "i32" if -2**31 <= value < 2**31 else "i64"
            else:
                signature[param.name] = "fp32"
    return signature, constexprs


def _build_ir(records: list[dict]) -> dict:
    """In a process without the interpreter: the front end of Triton's compile for sm90. A Triton
    without the functions this drives (their names and arguments are Triton's internals, checked
    with 3.9) gives {"unsupported": why}."""
    import inspect

    try:
        from triton._C.libtriton import ir
        from triton.backends.compiler import GPUTarget
        from triton.compiler import ASTSource
        from triton.compiler.compiler import make_backend
    except ImportError as e:
        return {"unsupported": f"triton {triton.__version__}: {e}"}
    wanted = ["self", "target", "options", "codegen_fns", "module_map", "context"]
    if list(inspect.signature(ASTSource.make_ir).parameters) != wanted:
        return {"unsupported": f"triton {triton.__version__}: ASTSource.make_ir takes "
                               f"{list(inspect.signature(ASTSource.make_ir).parameters)}, not {wanted}"}

    target = GPUTarget("cuda", 90, 32)
    backend = make_backend(target)
    compiled, errors = 0, []
    for record in records:
        kernel = getattr(importlib.import_module(record["module"]), record["name"])
        signature, constexprs = _signature(kernel, record)
        variants = [constexprs] + ([dict(constexprs, PDL=True)] if constexprs.get("PDL") is False else [])
        for consts in variants:
            options = backend.parse_options(dict(record["options"]))
            context = ir.context()
            ir.load_dialects(context)
            backend.load_dialects(context)
            try:
                ASTSource(fn=kernel, signature=signature, constexprs=consts).make_ir(
                    target, options, backend.get_codegen_implementation(options), backend.get_module_map(), context)
                compiled += 1
            except Exception as e:  # noqa: BLE001 (every compile error is reported)
                shown = {k: v for k, v in consts.items() if not isinstance(v, float) or k.isupper()}
                errors.append(f"{record['module']}.{record['name']} {signature} {shown}: "
                              f"{type(e).__name__}: {str(e)[-1500:]}")
    return {"compiled": compiled, "errors": errors}


@triton.jit
def _retyped_in_a_branch(x_ptr, flag):
    """The check's control: the interpreter runs it, the compiler refuses it (x is bf16 before the
    branch and float32 in it)."""
    x = tl.load(x_ptr)
    if flag > 0:
        x = x.to(tl.float32)
    tl.store(x_ptr, x)


# A launch of the control kernel, as record_launches would note it: its compile must fail.
CONTROL_RECORD = {"module": "tests.triton_compile_check", "name": "_retyped_in_a_branch",
                  "args": {"x_ptr": {"tensor": "bf16"}, "flag": {"value": 3}},
                  "options": {"enable_fp_fusion": True}}


if __name__ == "__main__":
    assert os.environ.get("TRITON_INTERPRET") != "1", "the compile check needs the real @triton.jit functions"
    print(json.dumps(_build_ir(json.loads(Path(sys.argv[1]).read_text()))))
