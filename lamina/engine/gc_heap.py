"""Keep Python's cyclic garbage collector off the objects that outlive the engine's steps.

A loaded engine's process tracks ~200k container objects (modules, parameters, the tokenizer,
imported libraries). Each step allocates a few per running request (chunks, outputs, lists); the
collections those allocations trigger walk every tracked object of the generations they cover,
and the survivors of each step keep the oldest generation's collections coming. `gc.freeze()`
moves every object tracked now into a permanent generation that collections skip, which is what
vLLM does once its engine has started; objects made afterwards (requests, outputs) are collected
as usual.

Frozen objects that become cyclic garbage are not freed while frozen, so lamina freezes only for
the span of a generate call or of the server's engine loop and unfreezes after it: an engine
dropped later is collected as before. The server's loop lasts as long as the process, so it
collects first (`collect=True`, ~0.1 s once): garbage left by loading, warm-up and graph capture
(possibly holding device memory) is freed rather than frozen for good. A generate call does not
(a collection per call would cost more than it saves; what it freezes is collectable again when
the call returns). Where the process has frozen objects already (the caller's own `gc.freeze()`,
or a server loop in the same process), nothing is done, so no one else's freeze is undone.
"""

from __future__ import annotations

import contextlib
import gc


@contextlib.contextmanager
def frozen_heap(collect: bool = False):
    """Inside the block, collections skip every object tracked at its start (`collect`: after a
    full collection, for blocks that last as long as the process)."""
    if gc.get_freeze_count() or not gc.isenabled():
        yield
        return
    if collect:
        gc.collect()
    gc.freeze()
    try:
        yield
    finally:
        gc.unfreeze()
