"""A real `lamina serve` app on a free loopback port, run by uvicorn on a thread of the test process."""

from __future__ import annotations

import socket
import threading
import time

import uvicorn

from lamina.engine.llm_engine import LLMEngine
from lamina.entrypoints.openai.app import ServerConfig, build_app
from lamina.entrypoints.openai.uvicorn_server import LaminaServer

MODEL_NAME = "tiny"


class RunningServer:
    def __init__(self, engine: LLMEngine, root_path: str = "", **config):
        config.setdefault("served_model_names", [MODEL_NAME])
        config.setdefault("drain_timeout_s", 5.0)
        self.app = build_app(engine, ServerConfig(**config))
        self.state = self.app.state.lamina
        self.sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        self.sock.bind(("127.0.0.1", 0))
        self.port = self.sock.getsockname()[1]
        self.url = f"http://127.0.0.1:{self.port}"
        self.base_url = f"{self.url}/v1"
        uv_config = uvicorn.Config(self.app, host="127.0.0.1", port=self.port, log_level="warning",
                                   access_log=False, timeout_graceful_shutdown=5, lifespan="on", root_path=root_path)
        self.server = LaminaServer(uv_config, self.state)
        self.thread = threading.Thread(target=self.server.run, kwargs={"sockets": [self.sock]}, daemon=True)

    @property
    def async_engine(self):
        return self.state.async_engine

    def start(self) -> "RunningServer":
        self.thread.start()
        deadline = time.monotonic() + 30
        while not self.server.started:
            if not self.thread.is_alive() or time.monotonic() > deadline:
                raise RuntimeError("the test server did not start")
            time.sleep(0.02)
        return self

    def stop(self, timeout: float = 30.0) -> None:
        self.server.should_exit = True
        self.thread.join(timeout)
        self.sock.close()
        assert not self.thread.is_alive(), "the test server did not stop"

    def __enter__(self) -> "RunningServer":
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()
