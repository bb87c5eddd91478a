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
dropped later is collected as before. Where the process has frozen objects already (the caller's
own `gc.freeze()`), nothing is done, so the caller's freeze is never undone.
"""

from __future__ import annotations

import contextlib
import gc


@contextlib.contextmanager
def frozen_heap():
    """Inside the block, collections skip every object tracked at its start."""
    if gc.get_freeze_count() or not gc.isenabled():
        yield
        return
    gc.freeze()
    try:
        yield
    finally:
        gc.unfreeze()
