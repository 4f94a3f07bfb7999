"""What the replica's server and the cluster's front share over HTTP: an OpenAI-style error
(``APIError``), a FastAPI app that answers unknown paths as one (``openai_app``), uvicorn's
configuration (``server_config``), ``GET /v1/models``'s body and where a started server listens."""

from __future__ import annotations

from typing import Any

DEFAULT_MAX_TOKENS = 256  # a request that gives no max_tokens: at most this many (and what the context allows)

# How long an idle HTTP connection stays open on our servers (uvicorn's default is 5 s): longer
# than an HTTP client keeps an idle pooled connection (httpx, under the openai SDK and the cluster
# front, drops it after 5 s), so the client closes it first. With both at 5 s, a request sent on a
# connection the server is closing that instant is lost ("Server disconnected without sending a
# response"; seen in a cluster test, and a client that does not retry gets an error).
KEEP_ALIVE_S = 65


def server_config(app, host: str, port: int):
    """The uvicorn configuration of a replica's server and of the cluster's front."""
    import uvicorn

    return uvicorn.Config(
        app,
        host=host,
        port=port,
        log_level="warning",
        access_log=False,
        timeout_graceful_shutdown=5,
        timeout_keep_alive=KEEP_ALIVE_S,
    )


def openai_app(title: str):
    """A FastAPI app whose unknown paths and methods answer as OpenAI errors, and ``error``: an
    ``APIError`` as its JSON response (the single replica's server and the cluster's front)."""
    from fastapi import FastAPI
    from fastapi.responses import JSONResponse
    from starlette.exceptions import HTTPException

    app = FastAPI(title=title, docs_url=None, redoc_url=None, openapi_url=None)

    def error(e: "APIError") -> JSONResponse:
        return JSONResponse(e.body(), status_code=e.status, headers=e.headers)

    @app.exception_handler(HTTPException)
    async def http_error(request, exc):
        return error(APIError(exc.status_code, str(exc.detail), kind="invalid_request_error"))

    return app, error


def models_body(name: str) -> dict[str, Any]:
    """``GET /v1/models``: the one model served, as OpenAI lists models."""
    return {"object": "list", "data": [{"id": name, "object": "model", "created": 0, "owned_by": "schedlab"}]}


def listening(http_server) -> tuple[str, int] | None:
    """Where a started uvicorn server listens: (host, port), or None."""
    for s in getattr(http_server, "servers", None) or []:
        for sock in getattr(s, "sockets", None) or []:
            host, port = sock.getsockname()[:2]
            return host, port
    return None


class APIError(Exception):
    """An OpenAI-style error response: ``status``, one-line ``message``, ``param``, ``code``
    (and ``headers``, of the response)."""

    def __init__(
        self,
        status: int,
        message: str,
        param: str | None = None,
        code: str | None = None,
        kind: str = "invalid_request_error",
        headers: dict[str, str] | None = None,
    ):
        super().__init__(message)
        self.status, self.message, self.param, self.code, self.kind = status, message, param, code, kind
        self.headers = headers  # of its response (a 429's Retry-After)

    def body(self) -> dict[str, Any]:
        return {"error": {"message": self.message, "type": self.kind, "param": self.param, "code": self.code}}
