"""The admin API: list, add, drain and remove backends at run time, on a listener of its own (`--admin-port`).

    GET    /admin/backends               every backend as GET /backends describes it (with source, draining)
    POST   /admin/backends               {"url", "name"?, "model"?, "api_key"?}: added, 201; it serves after its
                                         first good health check
    POST   /admin/backends/{name}/drain  chosen for nothing new; its requests in flight finish; it stays listed
    DELETE /admin/backends/{name}        drained, then removed once nothing of it is in flight: 202

`{name}` is a backend's name or URL (percent-encoded). A separate listener, off by default, so that the API can
stay on an internal address while clients reach the main port; every request needs the admin key
(`ApiKeys.check_admin`). Errors are in OpenAI's shape. It changes this process's pool only: config.py refuses it
with `--workers N` (each worker has a pool of its own; a backend file or DNS name reaches all of them).
"""

from __future__ import annotations

import json
import logging
from collections.abc import Awaitable, Callable
from typing import Any

from aiohttp import web

from gateway.api.auth import ApiKeys
from gateway.errors import BackendNotFound, BadRequest, ConfigError, Conflict, GatewayError
from gateway.fleet.backends import Backend, BackendSpec
from gateway.fleet.discovery import Membership, name_of

logger = logging.getLogger(__name__)

SOURCE = "admin"
_FIELDS = ("url", "name", "model", "api_key")
Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]


class AdminApi:
    def __init__(self, membership: Membership, keys: ApiKeys, check_url: Callable[[str, Any], str]) -> None:
        self.membership = membership
        self.pool = membership.pool
        self.keys = keys
        self.check_url = check_url
        self._runner: web.AppRunner | None = None

    def app(self) -> web.Application:
        app = web.Application(middlewares=[self._middleware], client_max_size=64 * 1024)
        app.router.add_get("/admin/backends", self.listing)
        app.router.add_post("/admin/backends", self.add)
        app.router.add_post("/admin/backends/{name}/drain", self.drain)
        app.router.add_delete("/admin/backends/{name}", self.remove)
        return app

    async def start(self, host: str, port: int) -> None:
        self._runner = web.AppRunner(self.app(), access_log=None, handle_signals=False)
        await self._runner.setup()
        await web.TCPSite(self._runner, host, port).start()
        logger.info("admin API listening on http://%s:%d/admin/backends", host, port)

    async def stop(self) -> None:
        if self._runner is not None:
            await self._runner.cleanup()

    # -- the handlers -----------------------------------------------------------------------------------------

    async def listing(self, request: web.Request) -> web.Response:
        return web.json_response({"backends": [backend.describe() for backend in self.pool.backends]})

    async def add(self, request: web.Request) -> web.Response:
        spec = self.spec_of(await self.body_of(request))
        try:
            backend = self.membership.join(spec, SOURCE)
        except ValueError as exc:
            raise Conflict(f"Backend not added: {exc}.", code="backend_exists") from None
        return web.json_response({"backend": backend.describe()}, status=201)

    async def drain(self, request: web.Request) -> web.Response:
        backend = self.backend_of(request)
        self.membership.drain(backend)
        return web.json_response({"backend": backend.describe()})

    async def remove(self, request: web.Request) -> web.Response:
        backend = self.backend_of(request)
        described = backend.describe()
        self.membership.leave(backend)
        removed = backend not in self.pool.backends
        return web.json_response({"backend": {**described, "draining": True}, "removed": removed}, status=202)

    # -- reading requests -------------------------------------------------------------------------------------

    def backend_of(self, request: web.Request) -> Backend:
        name = request.match_info["name"]
        backend = self.pool.find(name)
        if backend is None:
            raise BackendNotFound(name)
        return backend

    async def body_of(self, request: web.Request) -> dict[str, Any]:
        try:
            body = json.loads(await request.read())
        except ValueError as exc:
            raise BadRequest(f"The request body is not valid JSON: {exc}.") from None
        if not isinstance(body, dict):
            raise BadRequest("The request body must be a JSON object like {\"url\": \"http://10.0.0.5:8000\"}.")
        unknown = sorted(set(body) - set(_FIELDS))
        if unknown:
            raise BadRequest(f"Unknown field '{unknown[0]}' (known: {', '.join(_FIELDS)}).", param=unknown[0])
        return body

    def spec_of(self, body: dict[str, Any]) -> BackendSpec:
        try:
            url = self.check_url("url", body.get("url"))
        except ConfigError as exc:
            raise BadRequest(f"{exc}.", param="url") from None
        for field in ("name", "model", "api_key"):
            if field in body and (not isinstance(body[field], str) or not body[field]):
                raise BadRequest(f"'{field}' must be a non-empty string.", param=field)
        return BackendSpec(url, body.get("model"), name=body.get("name") or name_of(url), api_key=body.get("api_key"))

    # -- authentication and errors ----------------------------------------------------------------------------

    @web.middleware
    async def _middleware(self, request: web.Request, handler: Handler) -> web.StreamResponse:
        try:
            self.keys.check_admin(request.headers)
            return await handler(request)
        except GatewayError as exc:
            return web.json_response(exc.body(), status=exc.status_code, headers=exc.headers())
        except web.HTTPException as exc:
            if exc.status < 400:
                raise
            error = GatewayError(f"{request.method} {request.path}: {exc.reason}", code=str(exc.status))
            error.error_type = "invalid_request_error"
            return web.json_response(error.body(), status=exc.status)
