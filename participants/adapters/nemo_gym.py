"""NeMo Gym behind the gateway: which URLs its agents are given, and how its rollouts are named.

NeMo Gym's agents speak the Responses API to a model server and NeMo Gym's resources-server
protocol to resources servers (``participants.remote.gateway.tools`` lists the routes, with the
lines of NeMo Gym's source they follow). Point both at the gateway:

- model server: ``{gateway}/r/{rollout}`` (the agent posts ``/v1/responses`` under it); with NeMo
  Gym's observability on, its ``ServerClient`` prefixes every model-server call with
  ``/ng-rollout/<rollout_id>`` itself (``nemo_gym/server_utils.py:341-358``), so the gateway's plain
  URL works and the rollout comes from that prefix;
- resources server: ``{gateway}/r/{rollout}/tools/{name}`` with ``rollout-journal gateway --tools
  name=URL``; or, with observability on, the gateway's plain URL and ``--ng-resources name``.

Rollout ids: NeMo Gym names a rollout by ``_ng_rollout_id``, else ``{_ng_task_index}-{_ng_rollout_index}``
plus ``-a{_ng_attempt_index}`` on its own retries (``nemo_gym/rollout_correlation.py:41-77``). Journal
by the id without the attempt suffix (:func:`rollout_id`), so NeMo Gym's retry of a rollout and a
restarted job re-drive the same journaled rollout instead of starting new ones.

What was run: the protocol as the source defines it (NVIDIA-NeMo/Gym 07d6b0d), against a resources
server and the simple agent's loop written to it (``tests/support/nemo_gym_protocol.py``). NeMo Gym
itself was not run: it needs Python >= 3.13.14 (``pyproject.toml:28``) and pins ``openai<=2.7.2``.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from typing import Any

__all__ = ["model_server_url", "resources_server_url", "rollout_id", "rollout_of_capture_id"]

_REDISPATCH = re.compile(r"-a\d+$")


def rollout_id(body: Mapping[str, Any]) -> str:
    """The journal's id of a NeMo Gym run request's rollout (its own retries share it)."""
    explicit = body.get("_ng_rollout_id")
    if isinstance(explicit, str) and explicit:
        return rollout_of_capture_id(explicit)
    return f"{body.get('_ng_task_index', 0)}-{body.get('_ng_rollout_index', 0)}"


def rollout_of_capture_id(capture_id: str) -> str:
    """The journal's id of the rollout a NeMo Gym capture id names (the ``/ng-rollout/<id>`` prefix
    its ``ServerClient`` puts on every call): without the ``-a<n>`` of a re-dispatch
    (``nemo_gym/rollout_correlation.py:73-75``), so a re-dispatch re-drives the journaled rollout.
    NeMo Gym's capture ids cannot tell an explicit ``_ng_rollout_id`` that itself ends in ``-a<n>``
    from a re-dispatch of the id before it, so such an id is journaled as that one: give explicit
    ids another ending."""
    return _REDISPATCH.sub("", capture_id)


def model_server_url(gateway_url: str, rollout: str) -> str:
    return f"{gateway_url.rstrip('/')}/r/{rollout}"


def resources_server_url(gateway_url: str, rollout: str, server: str) -> str:
    return f"{gateway_url.rstrip('/')}/r/{rollout}/tools/{server}"
