"""Resources over HTTP: the wire protocol, the server (its sessions, its routes, its process), the
client, and the journaling gateway.

Public API (import from here)::

    from rollout_journal.participants.remote import RemoteEnvironment, serve_resources, serve_gateway

Names load lazily (PEP 562): importing this package, or ``.protocol``, never imports the HTTP stack
(starlette, uvicorn, httpx); the server, the client and the gateway load it when asked for.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from rollout_journal.participants.lazy_exports import lazy_exports as _lazy_exports

_EXPORTS: dict[str, str] = {
    "ControlError": ".protocol",
    "ResourceSessionLostError": ".protocol",
    "ServiceToken": ".protocol",
    "TransientControlError": ".protocol",
    "ResourceServer": ".server",
    "serve_resources": ".server",
    "EnvironmentFactory": ".client",
    "RemoteEnvironment": ".client",
    "GatewayConfig": ".gateway",
    "GatewayServer": ".gateway",
    "serve_gateway": ".gateway",
}

__all__ = [  # the names of _EXPORTS, spelled out for tools that read __all__ without running it
    "ControlError",
    "EnvironmentFactory",
    "GatewayConfig",
    "GatewayServer",
    "RemoteEnvironment",
    "ResourceServer",
    "ResourceSessionLostError",
    "ServiceToken",
    "TransientControlError",
    "serve_gateway",
    "serve_resources",
]

if TYPE_CHECKING:  # what type checkers and IDEs see; at run time __getattr__ loads on first use
    from rollout_journal.participants.remote.client import EnvironmentFactory, RemoteEnvironment
    from rollout_journal.participants.remote.gateway import GatewayConfig, GatewayServer, serve_gateway
    from rollout_journal.participants.remote.protocol import (
        ControlError,
        ResourceSessionLostError,
        ServiceToken,
        TransientControlError,
    )
    from rollout_journal.participants.remote.server import ResourceServer, serve_resources


__getattr__, __dir__ = _lazy_exports(__name__, _EXPORTS, globals())
