"""Small host values (lists, tuples, numpy arrays from the step plan) as device tensors: the one
helper the runner, the spec step and proposer, the samplers and the request groups share.

The copy is issued with `non_blocking=True` from ordinary (pageable) host memory: CUDA stages such
a source before the call returns, so the host values may be dropped at once, and the copy is
ordered on the current stream before any kernel that reads the result. It never waits for the
device. On the CPU nothing is copied: a numpy array's tensor shares its memory (callers pass
arrays they built for this step and never change afterwards).

The decode graphs' inputs are not built here: they are written into one persistent pinned buffer
and uploaded with one copy (lamina.worker.cuda_graphs).
"""

from __future__ import annotations

import torch


def to_device(values, device: torch.device | str, dtype: torch.dtype = torch.long) -> torch.Tensor:
    """`values` (a sequence or numpy array of host numbers) as a `dtype` tensor on `device`."""
    return torch.as_tensor(values, dtype=dtype).to(device, non_blocking=True)


def to_device_many(device: torch.device | str, *lists) -> list[torch.Tensor]:
    """Several sequences of host ints as int64 tensors on `device` through one copy: views of one
    upload, each starting 16 bytes aligned (an upload costs ~10 us of host time and a gap on the
    device; a step that needs several lists at once sends them together)."""
    flat: list[int] = []
    starts = []
    for values in lists:
        starts.append(len(flat))
        flat.extend(values)
        if len(flat) % 2:
            flat.append(0)  # the next list starts on a 16-byte boundary
    uploaded = to_device(flat, device)  # [sum of the padded lengths]
    return [uploaded[start : start + len(values)] for start, values in zip(starts, lists)]
