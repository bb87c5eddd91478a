"""vLLM's HTTP flags of `lamina serve`: CORS (--allowed-origins / --allowed-methods / --allowed-headers /
--allow-credentials, vLLM's defaults: any origin, method and header), --root-path behind a proxy,
--disable-fastapi-docs, --uvicorn-log-level and --disable-uvicorn-access-log."""

from __future__ import annotations

import httpx
import pytest

from lamina import LLM
from lamina.entrypoints.cli import build_parser, main as cli_main
from tests.server_harness import RunningServer

ENGINE = dict(device="cpu", dtype="float32", show_progress=False, max_num_seqs=2)


@pytest.fixture(scope="module")
def llm(qwen3_next_dir):
    with LLM(str(qwen3_next_dir), **ENGINE) as llm:
        yield llm


def _preflight(url: str, origin: str) -> httpx.Response:
    return httpx.options(url, headers={"Origin": origin, "Access-Control-Request-Method": "POST",
                                       "Access-Control-Request-Headers": "authorization,content-type"})


def test_cors_defaults_allow_any_origin_before_the_api_key(llm):
    with RunningServer(llm.engine, api_key="k") as srv:
        pre = _preflight(f"{srv.base_url}/completions", "http://ui.example")
        assert pre.status_code == 200 and pre.headers["access-control-allow-origin"] == "*"
        got = httpx.get(f"{srv.base_url}/models", headers={"Origin": "http://ui.example", "Authorization": "Bearer k"})
        assert got.status_code == 200 and got.headers["access-control-allow-origin"] == "*"
        assert httpx.get(f"{srv.base_url}/models").status_code == 401  # CORS does not open the API


def test_cors_allowed_origins(llm):
    with RunningServer(llm.engine, allowed_origins=["http://ui.example"], allow_credentials=True) as srv:
        pre = _preflight(f"{srv.base_url}/completions", "http://ui.example")
        assert pre.headers["access-control-allow-origin"] == "http://ui.example"
        assert pre.headers["access-control-allow-credentials"] == "true"
        assert _preflight(f"{srv.base_url}/completions", "http://other.example").status_code == 400
        got = httpx.get(f"{srv.base_url}/models", headers={"Origin": "http://other.example"})
        assert got.status_code == 200 and "access-control-allow-origin" not in got.headers


def test_api_key_guards_the_routes_under_a_root_path(llm):
    """uvicorn puts --root-path in front of scope['path']: the API-key check reads the route's own path,
    so a root path never opens /v1 or /invocations."""
    with RunningServer(llm.engine, root_path="/api", api_key="k") as srv:
        assert httpx.get(f"{srv.url}/v1/models").status_code == 401  # as a prefix-stripping proxy sends it
        assert httpx.post(f"{srv.url}/invocations", json={"prompt": "x"}).status_code == 401
        assert httpx.get(f"{srv.url}/api/v1/models").status_code in (401, 404)  # never answered without the key
        assert httpx.get(f"{srv.url}/v1/models", headers={"Authorization": "Bearer k"}).status_code == 200
        assert httpx.get(f"{srv.url}/health").status_code == 200


def test_root_path_and_docs(llm):
    with RunningServer(llm.engine, root_path="/api") as srv:
        assert httpx.get(f"{srv.url}/openapi.json").json()["servers"] == [{"url": "/api"}]
        assert httpx.get(f"{srv.base_url}/models").status_code == 200  # the proxy strips the prefix
        assert httpx.get(f"{srv.url}/docs").status_code == 200
    with RunningServer(llm.engine, fastapi_docs=False) as srv:
        assert all(httpx.get(f"{srv.url}{p}").status_code == 404 for p in ("/docs", "/redoc", "/openapi.json"))
        assert httpx.get(f"{srv.base_url}/models").status_code == 200


def test_cli_flags(capsys):
    args = build_parser().parse_args([
        "serve", "/m", "--allowed-origins", '["http://a.example"]', "--allowed-methods", '["GET", "POST"]',
        "--allow-credentials", "--root-path", "/api", "--disable-fastapi-docs", "--uvicorn-log-level", "trace",
        "--disable-uvicorn-access-log", "--return-tokens-as-token-ids"])
    assert (args.allowed_origins, args.allowed_methods, args.allowed_headers) == (["http://a.example"], ["GET", "POST"], ["*"])
    assert args.allow_credentials and args.disable_fastapi_docs and args.no_access_log and args.return_tokens_as_token_ids
    assert (args.root_path, args.uvicorn_log_level) == ("/api", "trace")
    defaults = build_parser().parse_args(["serve"])
    assert defaults.allowed_origins == ["*"] and not defaults.no_access_log and defaults.uvicorn_log_level is None
    assert not defaults.return_tokens_as_token_ids
    for bad in ("http://a.example", '{"a": 1}'):
        with pytest.raises(SystemExit):
            cli_main(["serve", "--allowed-origins", bad])
        assert "--allowed-origins" in capsys.readouterr().err
