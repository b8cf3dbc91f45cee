"""The FastAPI application: routes, auth, errors and the static web UI.

One app serves both: ``/api/v1/...`` (JSON, described by ``/openapi.json``)
and the one-page UI (``/`` and ``/ui/*``, all assets local: the browser needs no internet).
Every data route reads the request store through a read-only connection per call, so the API
can run inside the collector (beside its writer) or alone (``tokentrace ui``).
"""

from __future__ import annotations

import contextlib
import hmac
import logging
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass, field
from importlib import resources
from typing import Any, Final

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import FileResponse, JSONResponse, Response
from fastapi.staticfiles import StaticFiles
from pydantic import BaseModel
from starlette.exceptions import HTTPException as StarletteHTTPException

from tokentrace.collector.api.params import ApiError
from tokentrace.collector.store import Store, StoreError, StoreNotFoundError, open_store_readonly
from tokentrace.collector.store.query import QueryTimeoutError

_log = logging.getLogger(__name__)

API_PREFIX: Final = "/api/v1"
UI_PREFIX: Final = "/ui"
_STATIC_PACKAGE: Final = "tokentrace.collector.ui"
_STATIC_FOLDER: Final = "static"
# Data is only ever inserted as text by the page's own script; nothing inline may run.
CONTENT_SECURITY_POLICY: Final = (
    "default-src 'self'; script-src 'self'; style-src 'self'; img-src 'self' data:; "
    "connect-src 'self'; object-src 'none'; base-uri 'none'; form-action 'self'; "
    "frame-ancestors 'none'"
)
_SECURITY_HEADERS: Final = {
    "X-Content-Type-Options": "nosniff",
    "Referrer-Policy": "no-referrer",
    "X-Frame-Options": "DENY",
}
_PUBLIC_PATHS: Final = ("/healthz",)


@dataclass(frozen=True, slots=True, kw_only=True)
class ApiSettings:
    store_path: str
    """The collector's request store (SQLite); opened read-only."""
    auth_token: str | None = None
    """When set, every ``/api`` route needs ``Authorization: Bearer <token>``."""
    trace_link: str | None = None
    """URL template of a trace in the tracing backend, ``{trace_id}`` replaced (e.g. Grafana)."""
    clock: Callable[[], float] = field(default=time.time)
    """Unix seconds: "now" for windows such as ``last=1h`` (injectable for tests)."""


def create_app(settings: ApiSettings) -> FastAPI:
    """The API + UI application for one store."""
    from tokentrace.collector.api import detail_route, diagnose_route, list_route, window_routes

    @contextlib.asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        yield
        store, app.state.store = app.state.store, None
        if store is not None:  # a PostgreSQL store's pooled connections go with the app
            store.close()

    app = FastAPI(
        lifespan=lifespan,
        title="tokentrace",
        summary="Drill-down API: stored LLM requests, their latency budgets, SLOs and windows",
        version=_version(),
        docs_url=None,  # FastAPI's docs page loads Swagger UI from a CDN; the UI needs none
        redoc_url=None,
        openapi_url="/openapi.json",
        # Every error has one shape; see _error_response.
        responses={
            400: {"description": "bad parameter", "model": ErrorBody},
            401: {"description": "missing or wrong bearer token", "model": ErrorBody},
            503: {"description": "the request store cannot be read", "model": ErrorBody},
        },
    )
    app.state.settings = settings
    app.state.clock = settings.clock
    app.state.store = None

    app.add_exception_handler(ApiError, _api_error)
    app.add_exception_handler(RequestValidationError, _validation_error)
    app.add_exception_handler(StarletteHTTPException, _http_error)
    app.add_exception_handler(StoreNotFoundError, _store_error)
    app.add_exception_handler(StoreError, _store_error)
    app.add_exception_handler(QueryTimeoutError, _store_error)
    app.add_exception_handler(Exception, _unexpected_error)
    app.middleware("http")(_guard(settings.auth_token))

    app.include_router(list_route.router, prefix=API_PREFIX)
    app.include_router(detail_route.router, prefix=API_PREFIX)
    app.include_router(window_routes.router, prefix=API_PREFIX)
    app.include_router(diagnose_route.router, prefix=API_PREFIX)

    @app.get("/healthz", include_in_schema=False)
    def healthz() -> dict[str, str]:
        return {"status": "ok"}

    @app.get(f"{API_PREFIX}/meta", tags=["meta"], summary="What this server serves")
    def meta(request: Request) -> dict[str, Any]:
        return meta_document(request)

    static = resources.files(_STATIC_PACKAGE).joinpath(_STATIC_FOLDER)
    index = static.joinpath("index.html")

    @app.get("/", include_in_schema=False)
    def ui_index() -> Response:
        return FileResponse(str(index), media_type="text/html; charset=utf-8")

    app.mount(UI_PREFIX, StaticFiles(directory=str(static)), name="ui")
    return app


def store_of(request: Request) -> Store:
    """The app's read-only store, opened on first use (the collector may create it later)."""
    store: Store | None = request.app.state.store
    if store is None:
        settings: ApiSettings = request.app.state.settings
        store = open_store_readonly(settings.store_path, clock=settings.clock)
        request.app.state.store = store
    return store


def meta_document(request: Request) -> dict[str, Any]:
    from tokentrace.processors.slo import target_to_dict

    settings: ApiSettings = request.app.state.settings
    store = store_of(request)
    targets, _problems = store.slo_targets()  # /slo reports the problems
    stats = store.collector_stats()
    return {
        "version": _version(),
        "store": store.path,
        "requests": store.count(),
        "slo_targets": [target_to_dict(target) for target in targets],
        "trace_link": settings.trace_link,
        "auth": settings.auth_token is not None,
        "collector": stats,
    }


def _version() -> str:
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version("tokentrace")
    except PackageNotFoundError:
        return "0+unknown"


# --- errors: one JSON shape, never a traceback -------------------------------------------------


class ErrorBody(BaseModel):
    error: str


def error_response(status: int, message: str, **headers: str) -> JSONResponse:
    return JSONResponse({"error": message}, status_code=status, headers=headers or None)


async def _api_error(_request: Request, error: Exception) -> Response:
    assert isinstance(error, ApiError)
    return error_response(error.status, error.message)


async def _validation_error(_request: Request, error: Exception) -> Response:
    assert isinstance(error, RequestValidationError)
    parts = []
    for problem in error.errors()[:3]:
        where = ".".join(str(p) for p in problem.get("loc", ()) if p not in ("query", "path"))
        parts.append(f"{where or 'request'}: {problem.get('msg', 'invalid')}")
    return error_response(400, "; ".join(parts) or "invalid request")


async def _http_error(_request: Request, error: Exception) -> Response:
    assert isinstance(error, StarletteHTTPException)
    return error_response(error.status_code, str(error.detail))


async def _store_error(_request: Request, error: Exception) -> Response:
    return error_response(503, str(error))


async def _unexpected_error(request: Request, error: Exception) -> Response:
    _log.exception("%s %s failed", request.method, request.url.path)
    return error_response(500, f"internal error ({type(error).__name__}); see the server log")


def _guard(
    token: str | None,
) -> Callable[[Request, Callable[[Request], Awaitable[Response]]], Awaitable[Response]]:
    """Bearer-token check on the API (the static UI carries no data) plus security headers."""
    expected = None if token is None else f"Bearer {token}".encode()

    async def guard(
        request: Request, call_next: Callable[[Request], Awaitable[Response]]
    ) -> Response:
        path = request.url.path
        if (
            expected is not None
            and path.startswith(API_PREFIX)
            and path not in _PUBLIC_PATHS
            and not hmac.compare_digest(request.headers.get("authorization", "").encode(), expected)
        ):
            response: Response = error_response(
                401, "missing or wrong bearer token", **{"WWW-Authenticate": "Bearer"}
            )
        else:
            response = await call_next(request)
        for name, value in _SECURITY_HEADERS.items():
            response.headers.setdefault(name, value)
        response.headers.setdefault("Content-Security-Policy", CONTENT_SECURITY_POLICY)
        response.headers.setdefault("Cache-Control", "no-store")
        return response

    return guard
