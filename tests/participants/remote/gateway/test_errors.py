"""The gateway's HTTP answer to a rollout it does not own says where the owner is, or, where the
owner is a member that serves no HTTP (a fleet worker beside the gateways), why no gateway can
serve the rollout there."""

from __future__ import annotations

import json

from rollout_journal.participants.remote.gateway.errors import answer_for
from rollout_journal.participants.session.errors import NotOwnerError


def body_of(exc: BaseException) -> tuple[int, dict]:
    answer = answer_for(exc, rollout="r7")
    return answer.status_code, json.loads(bytes(answer.body))


def test_a_rollout_owned_by_another_gateway_is_answered_421_with_its_address() -> None:
    status, body = body_of(NotOwnerError("r7", "http://gw-2:8100", "gw-2"))
    assert status == 421 and body["error"]["type"] == "not_owner"
    assert body["owner"] == "http://gw-2:8100" and body["owner_member"] == "gw-2"
    assert "at http://gw-2:8100; send its requests there" in body["error"]["message"]


def test_a_rollout_owned_by_a_fleet_worker_names_the_worker_and_the_way_out() -> None:
    status, body = body_of(NotOwnerError("r7", None, "worker-3"))
    assert status == 421 and body["owner"] is None and body["owner_member"] == "worker-3"
    message = body["error"]["message"]
    assert "worker-3" in message and "serves no HTTP" in message and "namespace of their own" in message


def test_an_owner_nobody_has_described_yet_is_said_to_be_unknown() -> None:
    status, body = body_of(NotOwnerError("r7", None))
    assert status == 421 and body["owner"] is None and body["owner_member"] is None
    assert "its address is unknown here" in body["error"]["message"]
