"""The dashboard's web application: a Starlette JSON API over the store and three pages that
draw it with Plotly.js, served from the installed ``plotly`` package (nothing from a CDN)."""

from __future__ import annotations

import json
import math
import os
import sys
import threading
from pathlib import Path
from typing import Any, Callable, Sequence

from ..errors import StoreError
from ._reader import MAX_POINTS, StoreReader
from ._views import Importance, architecture, pareto

__all__ = ["create_app", "serve", "Server"]

STATIC = Path(__file__).with_name("static")
LOCAL_HOSTS = ("127.0.0.1", "localhost", "::1")


def _finite(value: Any) -> Any:
    """JSON-safe: NaN and infinities (a metric that diverged) become null, containers recursively."""
    if isinstance(value, float) and not math.isfinite(value):
        return None
    if isinstance(value, dict):
        return {k: _finite(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_finite(v) for v in value]
    return value


def _host_name(header: str) -> str:
    """The host of a ``Host:`` header, without its port: ``[::1]:80`` -> ``::1``."""
    header = header.strip().lower()
    if header.startswith("["):
        return header[1:header.find("]")] if "]" in header else header
    return header.rsplit(":", 1)[0] if header.count(":") == 1 else header


class _HostAllowList:
    """ASGI middleware answering 403 to a request whose ``Host:`` is not one of ``hosts``: a web
    page on another site that resolves its own name to this machine (DNS rebinding) reaches the
    dashboard with its own name as the Host, and is refused."""

    def __init__(self, app: Any, hosts: Sequence[str]) -> None:
        self.app, self.hosts = app, {h.lower().strip("[]") for h in hosts}

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        if scope["type"] in ("http", "websocket"):
            headers = dict(scope.get("headers") or [])
            host = _host_name(headers.get(b"host", b"").decode("latin-1"))
            if host not in self.hosts:
                from starlette.responses import JSONResponse

                response = JSONResponse({"error": f"Host {host!r} is not an address of this dashboard "
                                                  f"({', '.join(sorted(self.hosts))})"}, status_code=403)
                await response(scope, receive, send)
                return
        await self.app(scope, receive, send)


def _plotly_js() -> bytes:
    """Plotly.js as the ``plotly`` Python package ships it."""
    import plotly.offline

    return plotly.offline.get_plotlyjs().encode()


def create_app(db: str | os.PathLike[str], *, allowed_hosts: Sequence[str] = LOCAL_HOSTS) -> Any:
    """The ASGI application over the store at ``db`` (opened read-only; nothing is ever written).
    It answers only requests whose ``Host:`` header is one of ``allowed_hosts`` (403 otherwise),
    so a page elsewhere cannot read the store through DNS rebinding; add the names you reach it
    by when it listens beyond this machine.

    >>> app = create_app("tridens.db")                 # doctest: +SKIP
    >>> uvicorn.run(app, host="127.0.0.1", port=8765)  # doctest: +SKIP
    """
    from starlette.applications import Starlette
    from starlette.requests import Request
    from starlette.responses import JSONResponse, Response
    from starlette.routing import Route

    reader = StoreReader(db)
    importance = Importance(reader)
    plotly_js: list[bytes] = []

    def api(fn: Callable[..., Any]) -> Callable[[Request], Any]:
        def endpoint(request: Request) -> Response:
            try:
                body = fn(request, **request.path_params)
            except StoreError as err:
                return JSONResponse({"error": " ".join(str(err).split())}, status_code=404)
            except ValueError as err:
                return JSONResponse({"error": " ".join(str(err).split())}, status_code=400)
            except (TypeError, AttributeError, KeyError, IndexError) as err:  # a damaged row this view cannot read
                return JSONResponse({"error": f"the store holds a row this view cannot read ({type(err).__name__}: "
                                              f"{' '.join(str(err).split())})"}, status_code=422)
            return Response(json.dumps(_finite(body), allow_nan=False, default=str), media_type="application/json")
        return endpoint

    def _int(request: Request, key: str, default: int) -> int:
        value = request.query_params.get(key)
        if value is None or value == "":
            return default
        return _bounded(value, f"the query parameter {key!r}")

    def experiments(request: Request) -> Any:
        return {"store": str(reader.path), "exists": reader.exists(), "experiments": reader.experiments()}

    def experiment(request: Request, name: str) -> Any:
        return reader.experiment(name)

    def trials(request: Request, name: str) -> Any:
        q = request.query_params
        filters = {k[len("label."):]: v for k, v in q.items() if k.startswith("label.") and v != ""}
        return reader.trials_page(name, offset=_int(request, "offset", 0), limit=_int(request, "limit", 50),
                                  sort=q.get("sort", "number"), descending=q.get("desc", "") in ("1", "true"),
                                  statuses=[s for s in q.get("status", "").split(",") if s], label_filters=filters)

    def trial(request: Request, name: str, number: str) -> Any:
        return reader.trial(name, _number(number))

    def arch(request: Request, name: str, number: str) -> Any:
        config = reader.experiment(name)["config"]
        return architecture(config, reader.trial(name, _number(number)))

    def curves(request: Request, name: str) -> Any:
        reader.experiment(name)
        ids = [s for s in request.query_params.get("ids", "").split(",") if s]
        numbers = [_bounded(s, "each of ids (trial ids separated by commas)") for s in ids]
        return reader.curves(numbers, request.query_params.get("metric") or None)

    def hparams(request: Request, name: str) -> Any:
        # at most MAX_POINTS trials (the best tenth of them and a uniform sample of the others): a
        # page stays small and quick to draw however many trials finished
        limit = max(1, min(_int(request, "limit", MAX_POINTS), MAX_POINTS))
        best = limit // 10
        return {"labels": reader.labels(name), "log_labels": reader.log_labels(name), "best": best,
                **reader.finished_points(name, limit=limit, best=best)}

    def importance_view(request: Request, name: str) -> Any:
        return importance(name, request.query_params.get("evaluator", "ped-anova"))

    def pareto_view(request: Request, name: str) -> Any:
        return pareto(reader, name)

    def plan(request: Request, name: str) -> Any:
        return reader.plan(name)

    def stages(request: Request, name: str) -> Any:
        return reader.stages(name)

    def oneshot(request: Request, name: str) -> Any:
        return reader.oneshot(name)

    def page(request: Request) -> Response:
        html = (STATIC / "index.html").read_text()
        return Response(html, media_type="text/html")

    def static(request: Request) -> Response:
        file = request.path_params["file"]
        if file == "plotly.min.js":
            if not plotly_js:
                plotly_js.append(_plotly_js())
            return Response(plotly_js[0], media_type="text/javascript",
                            headers={"Cache-Control": "max-age=86400"})
        kinds = {"dashboard.js": "text/javascript", "dashboard.css": "text/css", "favicon.svg": "image/svg+xml"}
        if file not in kinds:
            return Response("not found", status_code=404)
        return Response((STATIC / file).read_bytes(), media_type=kinds[file])

    prefix = "/api/experiments/{name}"
    routes = [
        Route("/", page), Route("/experiments/{name}", page), Route("/experiments/{name}/trials/{number}", page),
        Route("/static/{file}", static),
        Route("/favicon.ico", lambda request: Response((STATIC / "favicon.svg").read_bytes(), media_type="image/svg+xml")),
        Route("/api/experiments", api(experiments)),
        Route(prefix, api(experiment)),
        Route(prefix + "/trials", api(trials)),
        Route(prefix + "/trials/{number}", api(trial)),
        Route(prefix + "/trials/{number}/architecture", api(arch)),
        Route(prefix + "/curves", api(curves)),
        Route(prefix + "/hparams", api(hparams)),
        Route(prefix + "/importance", api(importance_view)),
        Route(prefix + "/pareto", api(pareto_view)),
        Route(prefix + "/plan", api(plan)),
        Route(prefix + "/stages", api(stages)),
        Route(prefix + "/oneshot", api(oneshot)),
    ]
    app = Starlette(routes=routes)
    app.state.reader = reader
    app.add_middleware(_HostAllowList, hosts=list(allowed_hosts))
    return app


# Integers a request may carry (offsets, limits, trial numbers and ids): SQLite's are 64-bit.
_MAX_INT = 2**53


def _bounded(text: str, what: str) -> int:
    """``text`` as an integer of at most 2**53 in size, or ValueError (a 400) naming ``what``."""
    try:
        value = int(text[:30]) if len(text) <= 30 else None
    except ValueError:
        value = None
    if value is None or abs(value) > _MAX_INT:
        raise ValueError(f"{what} must be an integer of at most 2**53 in size, got {text[:40]!r}")
    return value


def _number(text: str) -> int:
    return _bounded(text, "a trial number")


def _check_host(host: str) -> None:
    """Warn on stderr when the dashboard will listen beyond this machine."""
    if host not in LOCAL_HOSTS:
        print(f"tridens: warning: the dashboard listens on {host}: anyone who can reach this machine there can "
              "read the store (samples, metrics, error text); it has no authentication", file=sys.stderr, flush=True)


class Server:
    """A dashboard served by uvicorn in a background thread (for scripts and tests).

    >>> with Server("tridens.db", port=0) as server:     # doctest: +SKIP
    ...     print(server.url)
    http://127.0.0.1:54321
    """

    def __init__(self, db: str | os.PathLike[str], host: str = "127.0.0.1", port: int = 8765, *,
                 allowed_hosts: Sequence[str] = ()) -> None:
        import uvicorn

        _check_host(host)
        self.app = create_app(db, allowed_hosts=(host, *LOCAL_HOSTS, *allowed_hosts))
        self.host = host
        self.server = uvicorn.Server(uvicorn.Config(self.app, host=host, port=port, log_level="warning",
                                                    lifespan="off"))
        self._thread: threading.Thread | None = None

    @property
    def url(self) -> str:
        servers = getattr(self.server, "servers", None) or []
        port = servers[0].sockets[0].getsockname()[1] if servers else self.server.config.port
        host = f"[{self.host}]" if ":" in self.host else self.host
        return f"http://{host}:{port}"

    def start(self) -> "Server":
        """Start serving in a daemon thread; returns once the socket listens."""
        import time

        self._thread = threading.Thread(target=self.server.run, name="tridens-dashboard", daemon=True)
        self._thread.start()
        while not self.server.started:
            if not self._thread.is_alive():
                raise OSError(f"the dashboard could not listen on {self.host}:{self.server.config.port}")
            time.sleep(0.02)
        return self

    def stop(self) -> None:
        """Stop serving and wait for the thread."""
        self.server.should_exit = True
        if self._thread is not None:
            self._thread.join(timeout=10)

    def __enter__(self) -> "Server":
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()


def serve(db: str | os.PathLike[str], host: str = "127.0.0.1", port: int = 8765, *,
          allowed_hosts: Sequence[str] = ()) -> None:
    """Serve the dashboard of the store ``db`` until Ctrl-C (binds 127.0.0.1 unless ``host`` says
    otherwise, with a warning). Called from a search script, it can also draw the architectures of
    that script's space (its code is imported there). Requests are answered only for the
    ``Host:`` names ``host``, ``localhost``, ``127.0.0.1`` and ``allowed_hosts``.

    >>> serve("tridens.db", port=8765)   # doctest: +SKIP
    """
    import uvicorn

    _check_host(host)
    app = create_app(db, allowed_hosts=(host, *LOCAL_HOSTS, *allowed_hosts))
    print(f"tridens dashboard of {Path(db).absolute()} on http://{host}:{port} (Ctrl-C to stop)", flush=True)
    uvicorn.run(app, host=host, port=port, log_level="warning")
