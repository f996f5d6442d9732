"""A real HTTP resource server: hosts resources whose state lives outside the
rollout worker, and exports it on request. Coordinated checkpoints talk to it
with ``HttpStateExporter``; a 5xx answer or a dropped connection is transient
and retried, a 4xx is not.

Endpoints: ``GET /resources/<resource_id>/export`` (the opaque state bytes) and
``GET /health``. ``fail_next(n, status, body)`` makes the next ``n`` export
requests answer ``status`` with ``body`` instead of the state (fault injection for
tests and drills: a 500, or an error page served with a 200).
"""

from __future__ import annotations

import http.client
import threading
from collections.abc import Callable
import urllib.error
import urllib.parse
import urllib.request
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

from journal.errors import RolloutJournalError

from .resources import Resource


class ControlError(RolloutJournalError):
    """A checkpoint control call failed for good (a 4xx, or retries exhausted)."""


class TransientControlError(ControlError):
    """A control call failed in a way worth retrying (HTTP 5xx, connection reset, timeout)."""


class ResourceServer:
    def __init__(self, host: str = "127.0.0.1", port: int = 0,
                 lookup: Callable[[str], Resource | None] | None = None) -> None:
        """``lookup`` finds resources not registered with ``host`` (e.g. those a runner creates)."""
        self._resources: dict[str, Resource] = {}
        self._lookup = lookup
        self._lock = threading.Lock()
        self._failures: list[tuple[int, bytes]] = []
        self.requests = 0
        server = self

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, format: str, *args: object) -> None:  # quiet: library code never prints
                pass

            def do_GET(self) -> None:
                server._handle(self)

        self._http = ThreadingHTTPServer((host, port), Handler)
        self._thread = threading.Thread(target=self._http.serve_forever, name="resource-server", daemon=True)
        self._thread.start()

    @property
    def url(self) -> str:
        host, port = self._http.server_address[:2]
        return f"http://{host}:{port}"

    def host(self, resource: Resource) -> None:
        with self._lock:
            self._resources[resource.resource_id] = resource

    def fail_next(self, count: int, status: int = 500, body: bytes = b"injected failure") -> None:
        with self._lock:
            self._failures.extend([(status, body)] * count)

    def _handle(self, request: BaseHTTPRequestHandler) -> None:
        with self._lock:
            self.requests += 1
            failure = self._failures.pop(0) if self._failures else None
        if request.path == "/health":
            return self._reply(request, 200, b"ok")
        if failure is not None:
            return self._reply(request, *failure)
        parts = request.path.strip("/").split("/")
        if len(parts) < 3 or parts[0] != "resources" or parts[-1] != "export":
            return self._reply(request, 404, b"unknown endpoint")
        resource_id = urllib.parse.unquote("/".join(parts[1:-1]))
        with self._lock:
            resource = self._resources.get(resource_id)
        if resource is None and self._lookup is not None:
            resource = self._lookup(resource_id)
        if resource is None:
            return self._reply(request, 404, f"no resource {resource_id}".encode())
        self._reply(request, 200, resource.export_state())

    @staticmethod
    def _reply(request: BaseHTTPRequestHandler, status: int, body: bytes) -> None:
        request.send_response(status)
        request.send_header("Content-Length", str(len(body)))
        request.end_headers()
        request.wfile.write(body)

    def close(self) -> None:
        self._http.shutdown()
        self._http.server_close()

    def __enter__(self) -> "ResourceServer":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


class HttpStateExporter:
    """Exports resource state from a ``ResourceServer`` (blocking; run it in a thread)."""

    def __init__(self, base_url: str, timeout_s: float = 5.0) -> None:
        self.base_url = base_url.rstrip("/")
        self.timeout_s = timeout_s

    def export(self, resource: Resource) -> bytes:
        url = f"{self.base_url}/resources/{urllib.parse.quote(resource.resource_id, safe='')}/export"
        try:
            with urllib.request.urlopen(url, timeout=self.timeout_s) as response:
                return response.read()
        except urllib.error.HTTPError as exc:
            error = TransientControlError if exc.code >= 500 else ControlError
            raise error(f"export of {resource.resource_id} from {self.base_url}: HTTP {exc.code}") from exc
        except (urllib.error.URLError, http.client.HTTPException, OSError) as exc:  # resets, timeouts, short reads
            raise TransientControlError(f"export of {resource.resource_id} from {self.base_url}: {exc!r}") from exc


class InProcessExporter:
    """Exports straight from the resource object (state held by the worker itself)."""

    def export(self, resource: Resource) -> bytes:
        return resource.export_state()
