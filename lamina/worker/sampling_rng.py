"""The random stream of requests without a seed: a torch.Generator per device, owned by the engine.

The engine seeds it with its `seed` (a data-parallel replica with a seed of its own) and the sampler
and rejection sampler draw their noise from it, so an engine running in the caller's process neither
reads nor moves the caller's global torch RNG (vLLM's engine runs in a process of its own: a script's
`torch.manual_seed` neither steers its sampling nor is reset by it). Requests with a seed draw
counter-based noise of their own (lamina.kernels.seeded_noise) and never touch this stream.
"""

from __future__ import annotations

import torch

_STREAMS: dict[tuple[str, int], torch.Generator] = {}


def _key(device: torch.device | str) -> tuple[str, int]:
    device = torch.device(device)
    index = device.index
    if index is None:
        index = torch.cuda.current_device() if device.type == "cuda" else 0
    return device.type, index


def seed_unseeded_stream(seed: int, device: torch.device | str) -> None:
    """(Re)start the stream of `device` at `seed` (an engine's start, a worker's start)."""
    generator = torch.Generator(device=torch.device(device))
    generator.manual_seed(seed)
    _STREAMS[_key(device)] = generator


def unseeded_generator(device: torch.device | str) -> torch.Generator | None:
    """The stream of `device`; None (torch's global RNG) where no engine seeded one (a sampler used
    on its own, in tests)."""
    return _STREAMS.get(_key(device))
