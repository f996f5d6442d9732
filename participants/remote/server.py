"""A resource server: the environments of one kind, one per rollout, behind HTTP.

As NeMo Gym's resource servers do, one process hosts many rollouts' environments
(tools, resources, reward) and the workers call it over HTTP
(:mod:`rollout_journal.participants.remote.protocol` lists the routes). The sessions and the
resource contract they hold live in :mod:`~rollout_journal.participants.remote.host`, the
routes in :mod:`~rollout_journal.participants.remote.app`; this module runs them.

Start one with ``rollout-journal serve-resources --environment workplace --port 8700``
(:func:`serve_resources`: until SIGINT or SIGTERM), or in this process on a background thread
with :class:`ResourceServer` (tests, notebooks).
"""

from __future__ import annotations

from collections.abc import Callable

from starlette.applications import Starlette

from rollout_journal.participants.remote.app import build_app
from rollout_journal.participants.remote.host import EnvironmentHost
from rollout_journal.participants.remote.protocol import ControlError, ServiceToken, TransientControlError
from rollout_journal.participants.remote.serving import ThreadedServer, bind, run_loop, serve

__all__ = ["ControlError", "EnvironmentHost", "ResourceServer", "TransientControlError", "build_app", "serve_resources"]


def serve_resources(
    environment: str,
    *,
    host: str = "127.0.0.1",
    port: int = 0,
    token: ServiceToken | None = None,
    faults: bool = False,
    ready: Callable[[str], None] = lambda url: None,
) -> None:
    """Serve ``environment`` until SIGINT or SIGTERM (the CLI's ``serve-resources``); ``ready(url)``
    is called once the port listens. Closes every session (sandbox interpreters) on the way out."""
    token = token or ServiceToken.from_environment("serve-resources")
    sock = bind(host, port)

    async def main() -> None:
        env_host = EnvironmentHost(environment)  # in the serving loop: what it holds belongs to it
        await serve(build_app(env_host, token, faults=faults), sock, ready=ready, on_stop=env_host.close_all)

    run_loop(main())


class ResourceServer(ThreadedServer):
    """A resource server on a background thread of this process (tests, notebooks); the CLI's
    ``serve-resources`` runs the same app in a process of its own. ``.host`` holds its sessions."""

    def __init__(
        self,
        environment: str,
        *,
        host: str = "127.0.0.1",
        port: int = 0,
        token: ServiceToken | None = None,
        faults: bool = False,
    ) -> None:
        self.token = token or ServiceToken.from_environment("ResourceServer")
        self.host: EnvironmentHost | None = None

        def make_app() -> Starlette:
            self.host = EnvironmentHost(environment)
            return build_app(self.host, self.token, faults=faults)

        async def on_stop() -> None:
            if self.host is not None:
                await self.host.close_all()

        try:
            super().__init__(make_app, host=host, port=port, name="resource-server", on_stop=on_stop)
        except RuntimeError as exc:
            raise ControlError(f"resource server for {environment!r} did not start: {exc.__cause__!r}") from exc
