"""The example environments: determinism, optimal play, recovery by each declared mode."""

from __future__ import annotations

import gc
import os
import signal
from collections import deque
from collections.abc import Iterator

import pytest

from rollout_journal.journal.errors import ConfigurationError
from rollout_journal.participants.environments import (
    ENVIRONMENTS,
    Environment,
    UnknownEnvironmentError,
    make_environment,
)
from rollout_journal.participants.environments.base import SUBMIT, Observation, StepMutations
from rollout_journal.participants.environments.counter import CounterEnvironment
from rollout_journal.participants.environments.sandbox import (
    SandboxClosedError,
    SandboxCrashedError,
    SandboxEnvironment,
)
from rollout_journal.participants.environments.tasks import Task
from rollout_journal.participants.environments.workplace import WorkplaceEnvironment
from rollout_journal.participants.resources import (
    MutationRecord,
    MutationRequest,
    PolicyFault,
    Recovery,
    RecoveryNotSupportedError,
    Resource,
    StaleEpochError,
)
from tests.support.processes import children_of


class Agent:
    """The agent's side of step(): keys f"{rollout}:{turn}:{i}", current revisions, its epoch."""

    def __init__(self, env: Environment, attempt: int = 1, epoch: int = 1) -> None:
        self.env, self.attempt, self.epoch = env, attempt, epoch
        self.turn = 0
        self.journal: list[MutationRecord] = []

    def act(self, action: str, turn: int | None = None) -> Observation:
        turn = self.turn if turn is None else turn
        index = iter(range(1_000))

        def request_for(resource: Resource) -> MutationRequest:
            return MutationRequest(
                self.env.rollout_id,
                self.attempt,
                self.epoch,
                f"{self.env.rollout_id}:{turn}:{next(index)}",
                resource.revision,
            )

        obs, records = self.env.step(action, request_for)
        self.journal.extend(records)
        self.turn = turn + 1
        return obs

    def play(self, actions: list[str]) -> list[Observation]:
        return [self.act(a) for a in actions]


@pytest.fixture
def envs() -> Iterator[list[Environment]]:
    """Environments a test builds; closed afterwards even when the test fails."""
    made: list[Environment] = []
    yield made
    for env in made:
        env.close()


def build(envs: list[Environment], name: str, rollout_id: str = "r1", seed: int = 3) -> Environment:
    env = make_environment(name, rollout_id, seed)
    envs.append(env)
    return env


def sandbox_plan(start: int, target: int) -> list[str]:
    """Shortest arithmetic path from start to target over the sandbox's actions (BFS)."""
    steps = {a: f for a in SandboxEnvironment.ACTIONS if (f := SandboxEnvironment.step_effect(a)) is not None}
    seen, queue = {start: []}, deque([start])
    while queue:
        x = queue.popleft()
        if x == target:
            return seen[x]
        for action, effect in steps.items():
            y = effect(x)
            if y not in seen and -100 < y < 1000:
                seen[y] = seen[x] + [action]
                queue.append(y)
    raise AssertionError(f"no path from {start} to {target}")


def optimal_actions(env: Environment, agent: Agent) -> list[str]:
    if isinstance(env, SandboxEnvironment):
        start = int(agent.act("py(print(x))").text)  # the agent has to look: the start is not in the prompt
        return sandbox_plan(start, env.target) + [SUBMIT]
    assert isinstance(env, (WorkplaceEnvironment, CounterEnvironment))
    return env.solution()


def child_pids() -> set[int]:
    return children_of(os.getpid())


def alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return True


# ----------------------------------------------------------------- every environment

NAMES = sorted(ENVIRONMENTS)


def test_the_registry_builds_each_environment_and_names_the_known_ones(envs: list[Environment]) -> None:
    assert NAMES == ["counter", "sandbox", "workplace"]
    for name in NAMES:
        env = build(envs, name, rollout_id="rx")
        assert env.name == name and all(rid.startswith("rx/") for rid in env.resources)
    with pytest.raises(UnknownEnvironmentError, match="counter, sandbox, workplace"):
        make_environment("chess", "r1", 0)


@pytest.mark.parametrize(
    "name,mode",
    [("workplace", Recovery.EVENT_SOURCED), ("sandbox", Recovery.RESTART_ONLY), ("counter", Recovery.EXPORTABLE)],
)
def test_each_environment_declares_its_recovery(envs: list[Environment], name: str, mode: Recovery) -> None:
    assert build(envs, name).recovery is mode


@pytest.mark.parametrize("name", NAMES)
def test_the_same_seed_gives_the_same_task_and_actions(envs: list[Environment], name: str) -> None:
    a, b = build(envs, name, "r1", seed=11), build(envs, name, "r2", seed=11)
    assert a.task_prompt() == b.task_prompt()
    assert a.action_space() == b.action_space()
    assert a.action_space()[-1] == SUBMIT and len(set(a.action_space())) == len(a.action_space())
    assert {rid.split("/", 1)[1] for rid in a.resources} == {rid.split("/", 1)[1] for rid in b.resources}
    assert list(a.state_digests().values()) == list(b.state_digests().values())
    prompts = {build(envs, name, f"s{seed}", seed).task_prompt() for seed in range(6)}
    assert len(prompts) > 1  # the seed really picks the task


@pytest.mark.parametrize("name", NAMES)
def test_a_scripted_optimal_play_earns_full_reward(envs: list[Environment], name: str) -> None:
    for seed in (0, 1, 2, 3):
        env = build(envs, name, f"r{seed}", seed)
        agent = Agent(env)
        assert env.verify() < 1.0
        observations = agent.play(optimal_actions(env, agent))
        assert observations[-1].done and not any(o.done for o in observations[:-1])
        assert env.verify() == 1.0
        assert all(r.rollout_id == f"r{seed}" for r in agent.journal)


@pytest.mark.parametrize("name", NAMES)
def test_an_invalid_action_is_an_observation_not_an_exception(envs: list[Environment], name: str) -> None:
    env = build(envs, name)
    digests = env.state_digests()
    agent = Agent(env)
    for bad in ("rm -rf /", "mail.send(to=eve)", "py(import os; os._exit(1))", "counter.incr(name=zz, by=1)", ""):
        obs = agent.act(bad)
        assert not obs.done and "Invalid action" in obs.text
    assert agent.journal == [] and env.state_digests() == digests


@pytest.mark.parametrize("name", NAMES)
def test_a_random_policy_gets_varied_rewards(envs: list[Environment], name: str) -> None:
    import random

    rewards = set()
    for seed in range(8):
        env = build(envs, name, f"r{seed}", seed)
        agent, rng = Agent(env), random.Random(seed)
        for _ in range(10):
            agent.act(rng.choice(env.action_space()[:-1]))
        reward = env.verify()
        assert 0.0 <= reward <= 1.0
        rewards.add(round(reward, 6))
    assert len(rewards) > 1


# ----------------------------------------------------------------- workplace (event_sourced)


def test_workplace_rebuilt_by_replay_equals_the_original(envs: list[Environment]) -> None:
    env = build(envs, "workplace", seed=5)
    assert isinstance(env, WorkplaceEnvironment)
    agent = Agent(env)
    agent.play(["mail.list()", "calendar.list()"] + env.solution()[:4])
    assert len(agent.journal) == 4

    rebuilt = build(envs, "workplace", seed=5)
    rebuilt.replay(agent.journal)
    assert rebuilt.state_digests() == env.state_digests()
    assert {rid: r.chain_hash for rid, r in rebuilt.resources.items()} == {
        rid: r.chain_hash for rid, r in env.resources.items()
    }
    assert rebuilt.action_space() == env.action_space()
    assert rebuilt.verify() == env.verify()


def test_workplace_resumed_turn_maps_to_the_same_keys_and_applies_nothing_twice(envs: list[Environment]) -> None:
    env = build(envs, "workplace", seed=9)
    assert isinstance(env, WorkplaceEnvironment)
    first = Agent(env, attempt=1, epoch=1)
    plan = env.solution()
    first.play(plan[:3])
    revisions = env.revisions()

    # Attempt 2 rebuilds from the journal of turns 0-1 (turn 2 never committed) and re-runs turn 2.
    rebuilt = build(envs, "workplace", seed=9)
    rebuilt.replay(first.journal[:2])
    rebuilt.fence("r1", 2)
    second = Agent(rebuilt, attempt=2, epoch=2)
    second.act(plan[2], turn=2)
    assert second.journal[0].idempotency_key == first.journal[2].idempotency_key
    assert rebuilt.state_digests() == env.state_digests()

    # The same mutation re-sent to a resource that survived returns the recorded record, no second apply.
    recorded = first.journal[2]
    survivor = env.resources[recorded.resource_id]
    resent = MutationRequest("r1", 2, 2, recorded.idempotency_key, survivor.revision)
    assert survivor.mutate(resent, recorded.op, recorded.args) is recorded
    assert env.revisions() == revisions

    # Once fenced, the zombie attempt 1 is refused on both copies.
    env.fence("r1", 2)
    with pytest.raises(StaleEpochError):
        first.act(plan[3], turn=3)
    with pytest.raises(StaleEpochError):
        Agent(rebuilt, attempt=1, epoch=1).act(plan[3], turn=3)


def test_workplace_partial_work_earns_partial_credit(envs: list[Environment]) -> None:
    env = build(envs, "workplace", seed=4)
    assert isinstance(env, WorkplaceEnvironment)
    agent = Agent(env)
    agent.play(env.solution()[:2])  # read the request, cancel the old event
    goals = env.goals()
    assert goals["request marked read"] and goals["old event cancelled"] and not goals["contact emailed"]
    assert env.verify() == pytest.approx(3 / 7)  # plus "nothing else changed"
    wrong = next(a for a in env.action_space() if a.startswith("mail.delete"))
    agent.act(wrong)
    assert not env.goals()["nothing else changed"]


def test_workplace_queries_read_without_journaling(envs: list[Environment]) -> None:
    env = build(envs, "workplace", seed=2)
    assert isinstance(env, WorkplaceEnvironment)
    agent = Agent(env)
    obs = agent.act("mail.list()")
    assert env.world.contact in obs.text and "unread" in obs.text
    assert agent.journal == [] and set(env.revisions().values()) == {0}


# ----------------------------------------------------------------- counter (exportable)


def test_counter_export_import_round_trip(envs: list[Environment]) -> None:
    env = build(envs, "counter", seed=8)
    assert isinstance(env, CounterEnvironment)
    agent = Agent(env)
    agent.play(env.solution()[:5])
    exported = {rid: r.export_state() for rid, r in env.resources.items()}
    assert all(isinstance(blob, bytes) for blob in exported.values())

    restored = build(envs, "counter", seed=8)
    for rid, blob in exported.items():
        restored.resources[rid].import_state(blob)
    assert restored.state_digests() == env.state_digests()
    assert restored.revisions() == env.revisions()
    assert restored.verify() == env.verify()
    # The idempotency table came along: turn 4 re-sent after restore is not applied again.
    resumed = Agent(restored, attempt=2, epoch=2)
    resumed.act(env.solution()[4], turn=4)
    assert resumed.journal == [agent.journal[4]] and restored.revisions() == env.revisions()
    resumed.play(env.solution()[5:])
    assert restored.verify() == 1.0


# ----------------------------------------------------------------- sandbox (restart_only)


def test_the_sandbox_state_lives_in_a_real_subprocess(envs: list[Environment]) -> None:
    before = child_pids()
    env = build(envs, "sandbox", seed=1)
    assert isinstance(env, SandboxEnvironment)
    pid = env.python.pid
    assert pid is not None and pid != os.getpid() and alive(pid) and pid in child_pids()
    with open(f"/proc/{pid}/cmdline", "rb") as fh:
        assert b"python" in fh.read().lower()

    agent = Agent(env)
    start = int(agent.act("py(print(x))").text)
    assert start == env.start_value
    agent.act("py(x = x * 2)")
    assert env.current_x() == 2 * start and env.python.revision == 2
    digest = env.python.state_digest()
    assert env.python.query("vars")["vars"]["x"] == repr(2 * start)
    assert env.python.state_digest() == digest and env.python.revision == 2  # queries change nothing

    env.close()
    env.close()  # idempotent
    assert not alive(pid) and child_pids() == before
    with pytest.raises(SandboxClosedError):
        agent.act("py(x = x + 1)")

    fresh = build(envs, "sandbox", seed=1)
    assert isinstance(fresh, SandboxEnvironment)
    assert fresh.python.pid != pid and fresh.current_x() == start  # the doubled x died with its process


def test_the_sandbox_cannot_export_and_resets_to_turn_zero(envs: list[Environment]) -> None:
    env = build(envs, "sandbox", seed=2)
    assert isinstance(env, SandboxEnvironment)
    with pytest.raises(RecoveryNotSupportedError, match="restarting the rollout"):
        env.python.export_state()
    Agent(env).play(["py(x = x + 1)", "py(x = x * 2)"])
    old_pid = env.python.pid
    env.reset()
    assert env.python.pid != old_pid and old_pid is not None and not alive(old_pid)
    assert env.current_x() == env.start_value and env.python.revision == 0


def test_user_output_cannot_break_the_sandbox_protocol(envs: list[Environment]) -> None:
    env = build(envs, "sandbox", seed=2)
    assert isinstance(env, SandboxEnvironment)
    record = env.python.mutate(
        MutationRequest("r1", 1, 1, "k0", 0),
        "exec",
        {"code": "import os, sys\nos.write(1, b'junk\\n')\nsys.__stdout__.write('more\\n')\nprint('hi')\n1/0"},
    )
    assert (
        record.result["ok"] is False
        and "ZeroDivisionError" in record.result["error"]
        and record.result["stdout"] == "hi\n"
    )
    assert env.current_x() == env.start_value


def test_sandboxes_do_not_leak_processes(envs: list[Environment]) -> None:
    before = child_pids()
    with make_environment("sandbox", "r1", 0):
        assert len(child_pids() - before) == 1
    assert child_pids() == before

    forgotten = make_environment("sandbox", "r2", 0)
    pid = forgotten.python.pid  # type: ignore[attr-defined]
    del forgotten
    gc.collect()
    assert pid is not None and not alive(pid) and child_pids() == before


# ----------------------------------------------------------------- whose fault: the policy's or the infrastructure's


def test_code_that_outlives_the_timeout_is_answered_and_the_interpreter_starts_again(envs: list[Environment]) -> None:
    env = make_environment(
        "sandbox", "r1", Task(2, "loop", {"timeout_s": 0.5, "actions": ["x = x * 3", "while True: pass"]})
    )
    envs.append(env)
    assert isinstance(env, SandboxEnvironment)
    assert env.action_space() == ["py(x = x * 3)", "py(while True: pass)", SUBMIT]
    agent = Agent(env)
    agent.act("py(x = x * 3)")
    old_pid = env.python.pid

    observation = agent.act("py(while True: pass)")  # no exception: the model is told

    assert observation.text.startswith("Timeout: the code ran longer than 0.5 s; the interpreter was started again")
    assert not observation.done and env.python.pid not in (None, old_pid) and old_pid is not None
    assert not alive(old_pid) and env.current_x() == env.start_value  # the tripled x died with that interpreter
    assert agent.journal[-1].result["reset"] is True and env.python.revision == 2  # a mutation like any other
    assert agent.act("py(x = x * 3)").text == "ok" and env.current_x() == 3 * env.start_value


def test_code_that_dribbles_onto_the_protocol_pipe_still_times_out(envs: list[Environment]) -> None:
    """The timeout bounds the whole answer: bytes without a newline every 0.1 s (the model's code
    found the protocol's pipe) do not restart it, and the code is stopped as any other overrun."""
    dribble = "import __main__, time\nfor _ in range(40):\n    __main__.proto_out.write(' '); __main__.proto_out.flush(); time.sleep(0.1)"
    env = make_environment("sandbox", "r1", Task(2, "dribble", {"timeout_s": 0.5, "actions": [dribble]}))
    envs.append(env)
    observation = Agent(env).act(f"py({dribble})")
    assert observation.text.startswith("Timeout: the code ran longer than 0.5 s"), observation.text


def test_code_that_ends_the_interpreter_is_answered_with_its_exit_code(envs: list[Environment]) -> None:
    env = make_environment("sandbox", "r1", Task(2, None, {"actions": ["import os; os._exit(7)"]}))
    envs.append(env)
    observation = Agent(env).act("py(import os; os._exit(7))")
    assert observation.text.startswith("Exited: the code ended the interpreter (exit code 7)")
    assert isinstance(env, SandboxEnvironment) and env.current_x() == env.start_value


def test_an_interpreter_dead_before_the_code_is_sent_is_an_infrastructure_failure(envs: list[Environment]) -> None:
    env = build(envs, "sandbox", seed=2)
    assert isinstance(env, SandboxEnvironment) and env.python.pid is not None
    pid = env.python.pid
    os.kill(pid, signal.SIGKILL)  # between turns: no code of the model was running
    while open(f"/proc/{pid}/stat").read().split(")")[-1].split()[0] != "Z":  # dead (a zombie until reaped)
        os.sched_yield()
    with pytest.raises(SandboxCrashedError, match="is gone"):
        Agent(env).act("py(x = x + 1)")


@pytest.mark.parametrize("fields", [{"timeout_s": 0}, {"timeout_s": "1"}, {"actions": []}, {"actions": ["", "x"]}])
def test_a_sandbox_task_with_unusable_settings_is_refused_naming_the_task(fields: dict) -> None:
    with pytest.raises(ConfigurationError, match="sandbox task row3: task"):
        make_environment("sandbox", "r1", Task(1, "p", fields, "row3"))


class Careful(CounterEnvironment):
    """A counter environment whose task forbids resetting a counter: asking is the policy's fault."""

    def _perform(self, action: str, mutations: StepMutations) -> str:
        if action.startswith("counter.set("):
            raise PolicyFault("resetting a counter is not allowed in this task", ends_episode=True)
        return super()._perform(action, mutations)


def test_a_policy_fault_is_an_observation_never_an_exception(envs: list[Environment]) -> None:
    env = Careful("r1", 5)
    envs.append(env)
    reset = next(a for a in env.action_space() if a.startswith("counter.set("))
    agent = Agent(env)
    observation = agent.act(reset)
    assert observation == Observation("Error: resetting a counter is not allowed in this task", done=True)
    assert agent.journal == [] and env.store.revision == 0
