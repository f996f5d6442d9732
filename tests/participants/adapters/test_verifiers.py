"""verifiers 0.4.0, unmodified, behind the gateway in front of ``vllm serve`` (CPU, the tiny model):
its job is SIGKILLed mid-run and run again, and every call it had made comes from the journal."""

from __future__ import annotations

from pathlib import Path

import pytest

from rollout_journal.participants.remote.gateway import GatewayConfig, GatewayServer
from tests.support.verifiers_drill import crash_drill


@pytest.mark.slow
@pytest.mark.timeout(3600)
def test_a_killed_verifiers_job_rerun_regenerates_no_committed_turn(tmp_path: Path, vllm_server: str) -> None:
    journal = tmp_path / "journal"
    server = GatewayServer(GatewayConfig(upstream=vllm_server, journal=str(journal), port=0))
    assert server.gateway is not None and server.gateway.upstream.api == "generate"  # token ids upstream
    drill = crash_drill(server, journal, tmp_path, tasks=2, turns=3)
    assert drill.turns_committed_at_crash >= 3  # the first episode's turns, at least
    assert drill.model_tokens_regenerated_for_committed_turns == 0
    assert drill.replayed_calls >= drill.calls_journaled_at_crash
    assert drill.identical_to_uninterrupted  # greedy: the same trajectories as the run without a kill
    assert set(drill.rewards.values()) == {3.0}
