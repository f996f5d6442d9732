"""The OpenAI-compatible journaling gateway and the tool gateway for NeMo Gym resources servers.

Public API (import from here)::

    from rollout_journal.participants.remote.gateway import GatewayConfig, GatewayServer, serve_gateway
"""

from __future__ import annotations

from rollout_journal.participants.remote.gateway.app import ROLLOUT_ID, Gateway, GatewayConfig
from rollout_journal.participants.remote.gateway.errors import (
    GatewayError,
    ToolReplayDivergedError,
    ToolServerUnavailableError,
)
from rollout_journal.participants.remote.gateway.server import GatewayServer, build_gateway, serve_gateway
from rollout_journal.participants.remote.gateway.tools import ToolGateway, ToolServer, parse_tool_servers
from rollout_journal.participants.remote.gateway.upstream import (
    CompletionsUpstream,
    GenerateUpstream,
    UpstreamClient,
    UpstreamRejectedError,
    UpstreamUnavailableError,
    open_upstream,
)

__all__ = [
    "ROLLOUT_ID",
    "CompletionsUpstream",
    "Gateway",
    "GatewayConfig",
    "GatewayError",
    "GatewayServer",
    "GenerateUpstream",
    "ToolGateway",
    "ToolReplayDivergedError",
    "ToolServer",
    "ToolServerUnavailableError",
    "UpstreamClient",
    "UpstreamRejectedError",
    "UpstreamUnavailableError",
    "build_gateway",
    "open_upstream",
    "parse_tool_servers",
    "serve_gateway",
]
