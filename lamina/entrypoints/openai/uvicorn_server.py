"""uvicorn's server with lamina's drain on shutdown (`lamina serve`)."""

from __future__ import annotations

import uvicorn


class LaminaServer(uvicorn.Server):
    """uvicorn's server with a drain before its own shutdown (which waits for open connections)."""

    def __init__(self, config: uvicorn.Config, state):
        super().__init__(config)
        self.lamina_state = state

    async def shutdown(self, sockets=None) -> None:
        for server in getattr(self, "servers", []):
            server.close()  # no new connections while draining
        await self.lamina_state.drain(give_up=lambda: self.force_exit)  # a second Ctrl-C stops waiting
        await super().shutdown(sockets=sockets)
        # uvicorn re-raises a captured SIGTERM after serving; the drain is done, so exit normally
        captured = getattr(self, "_captured_signals", None)
        if isinstance(captured, list):
            captured.clear()
