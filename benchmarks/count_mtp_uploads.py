"""Host-to-device uploads of an MTP step (CPU): counts the calls of `lamina.host_to_device.to_device`
made by the verification, the drafter and the sampling batches, per engine step of a greedy
generation from the demo model (which has an MTP layer). Each upload on a GPU costs ~10 us of host
time and a gap on the device, and MTP steps run without asynchronous scheduling.

    python benchmarks/count_mtp_uploads.py 1      # K = 1
    PYTHONPATH=OTHER_TREE python benchmarks/count_mtp_uploads.py 3
"""

from __future__ import annotations

import collections
import sys

import torch

import lamina.host_to_device as host_to_device
from lamina import LLM, SamplingParams

counts: collections.Counter = collections.Counter()
_to_device = host_to_device.to_device


def _counted(values, device, dtype=torch.long):
    caller = sys._getframe(1).f_code
    counts[f"{caller.co_filename.rsplit('/', 1)[-1]}:{caller.co_name}"] += 1
    return _to_device(values, device, dtype)


def main() -> None:
    k = int(sys.argv[1]) if len(sys.argv) > 1 else 1
    import lamina.worker.proposer as proposer
    import lamina.worker.sampler as sampler
    import lamina.worker.spec_step as spec_step

    for module in (host_to_device, proposer, sampler, spec_step):
        if hasattr(module, "to_device"):
            module.to_device = _counted
    spec = {"method": "mtp", "num_speculative_tokens": k}
    with LLM(None, device="cpu", dtype="float32", show_progress=False, speculative_config=spec) as llm:
        prompt = {"prompt_token_ids": [5, 6, 7, 8]}
        llm.generate([prompt], SamplingParams(temperature=0, max_tokens=4, ignore_eos=True), use_tqdm=False)
        before = len(llm.engine.step_token_counts)
        counts.clear()
        llm.generate([prompt], SamplingParams(temperature=0, max_tokens=41, ignore_eos=True), use_tqdm=False)
        steps = len(llm.engine.step_token_counts) - before
    print(f"K = {k}: {steps} steps, {sum(counts.values()) / steps:.2f} uploads a step: {dict(counts)}")


if __name__ == "__main__":
    main()
