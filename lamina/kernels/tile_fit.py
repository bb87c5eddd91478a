"""Launching a Triton kernel on a GPU with less shared memory than its tiles were tuned for.

The grouped MoE kernels' prefill tiles were swept on sm90 (227 KiB of shared memory a block);
an sm89 or sm80/86 card has ~100-164 KiB, and Triton refuses the launch with `OutOfResources`.
`launch_fitted` retries with fewer pipeline stages (down to two), then with the tile's wider side
halved (down to 16), and remembers the fit per (kernel, device, variant, tuned tiles), so later
calls launch once. The sums stay exact to the kernel's contract (the tile sides only change the
K-summation order, as the tiles chosen by call size already do: docs/ARCHITECTURE.md, "Batch
invariance"). Under Triton's interpreter nothing is refused.
"""

from __future__ import annotations

import functools
import logging
from collections.abc import Callable

import torch

from triton.runtime.errors import OutOfResources

logger = logging.getLogger(__name__)

SM90_SHARED_MEMORY = 227 * 1024  # a block's opt-in shared memory on an H100 / H200
SMALLEST_TILE_SIDE = 16  # a tl.dot operand's side
SMALLEST_STAGES = 2  # one buffer in flight beside the one in use

# (kernel name, device, variant, tuned tiles) -> the tiles that launched there
_FITTED: dict[tuple, dict[str, int]] = {}


def shared_memory_limit(device: torch.device) -> int:
    """The shared memory in bytes a block of a Triton kernel may use on `device` (what Triton checks
    a launch against); sm90's for a CPU tensor (Triton's interpreter)."""
    device = torch.device(device)
    if device.type != "cuda":
        return SM90_SHARED_MEMORY
    return _cuda_shared_memory(device.index if device.index is not None else torch.cuda.current_device())


@functools.cache
def _cuda_shared_memory(index: int) -> int:
    from triton.runtime import driver

    return int(driver.active.utils.get_device_properties(index)["max_shared_mem"])


def smaller_tiles(tiles: dict[str, int], n_key: str, k_key: str, stages_key: str) -> dict[str, int] | None:
    """The next tiles to try after `tiles` ran out of shared memory: one stage fewer, else the wider
    of the N / K sides halved (N on a tie), else None (nothing left to shrink)."""
    if tiles[stages_key] > SMALLEST_STAGES:
        return {**tiles, stages_key: tiles[stages_key] - 1}
    wider = n_key if tiles[n_key] >= tiles[k_key] else k_key
    if tiles[wider] <= SMALLEST_TILE_SIDE:
        return None
    return {**tiles, wider: tiles[wider] // 2}


def launch_fitted(name: str, device, tiles: dict[str, int], launch: Callable[[dict[str, int]], None],
                  n_key: str, k_key: str, stages_key: str, variant: tuple = ()) -> dict[str, int]:
    """Call `launch(tiles)`; while the GPU refuses it for shared memory, again with `smaller_tiles`.
    Returns the tiles that launched, remembered for the next call with the same tuned tiles and
    `variant` (what else sets the kernel's shared memory: dtypes, row block, constexpr forms), so
    one launch's fit never stands in for another's and the tiles follow the call alone."""
    key = (name, str(device), variant, tuple(sorted(tiles.items())))
    fitted = _FITTED.get(key, tiles)
    while True:
        try:
            launch(fitted)
        except OutOfResources as err:
            if err.name != "shared memory":
                raise
            smaller = smaller_tiles(fitted, n_key, k_key, stages_key)
            if smaller is None:
                raise
            fitted = smaller
            continue
        break
    if key not in _FITTED:
        if fitted != tiles:
            logger.warning("%s: tiles %s need more shared memory than %s has; launched with %s", name, tiles,
                           device, fitted)
        _FITTED[key] = fitted
    return fitted
