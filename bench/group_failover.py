"""How fast Kafka's consumer group moves a fleet's partitions, per protocol and membership.

    python bench/group_failover.py [--json] [--partitions 12] [--skip-consumer-protocol]

Three member processes join ``<namespace>.workers`` through ``rollout_journal.journal.kafka.group.WorkerGroup``
(the worker's own membership code) and report every assignment change with a timestamp.
Scenarios, each on a fresh namespace:

- ``classic_sigkill``: classic protocol, cooperative-sticky, session timeout 6 s; one member
  SIGKILLed: seconds until the survivors own all its partitions;
- ``classic_sigterm``: the same, the member leaves gracefully: seconds until they move;
- ``static_restart``: classic with ``group.instance.id``: a member SIGKILLed and restarted at
  once: seconds until it owns its partitions again, and whether any other member saw a
  revocation (a rebalance);
- ``static_sigterm``: a static member leaving gracefully: seconds until its partitions move;
- ``consumer_sigkill`` / ``consumer_sigterm``: the KIP-848 consumer protocol with the
  broker's session timeout.

Measured against ``KAFKA_BOOTSTRAP_SERVERS`` (or a 1-node broker started for the run): the
group coordinator is one broker whatever the cluster size.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
import threading
import time
import uuid
from dataclasses import dataclass, field
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench.common import kafka_bootstrap  # noqa: E402
from rollout_journal.journal.kafka.backend import KafkaBackend  # noqa: E402
from rollout_journal.journal.kafka.config import KafkaSettings  # noqa: E402
from rollout_journal.journal.kafka.group import PartitionsCallback, WorkerGroup  # noqa: E402

MEMBERS = 3


def log(message: str) -> None:
    print(message, file=sys.stderr, flush=True)


def member_main(args: argparse.Namespace) -> None:
    """A member process: join, print each change as ``<event> <time> <partitions>``, leave on SIGTERM."""
    settings = KafkaSettings(
        bootstrap_servers=args.bootstrap,
        namespace=args.namespace,
        partitions=args.partitions,
        group_protocol=args.protocol,
    )
    stop = threading.Event()

    def say(event: str) -> PartitionsCallback:
        return lambda parts: print(f"{event} {time.time():.3f} {','.join(map(str, parts))}", flush=True)

    group = WorkerGroup(
        settings,
        args.name,
        on_assigned=say("assigned"),
        on_revoked=say("revoked"),
        on_lost=say("lost"),
        instance_id=args.instance_id,
    )
    signal.signal(signal.SIGTERM, lambda *_: stop.set())
    group.start()
    print(f"joined {time.time():.3f} -", flush=True)
    stop.wait()
    group.close()
    print(f"left {time.time():.3f} -", flush=True)


@dataclass
class Member:
    name: str
    process: subprocess.Popen[str]
    owned: set[int] = field(default_factory=set)
    revocations: int = 0
    changes: list[tuple[str, float, list[int]]] = field(default_factory=list)


class Fleet:
    def __init__(self, bootstrap: str, partitions: int, protocol: str, static: bool) -> None:
        self.bootstrap, self.partitions, self.protocol, self.static = bootstrap, partitions, protocol, static
        self.namespace = f"bench-group-{uuid.uuid4().hex[:8]}"
        settings = KafkaSettings(bootstrap_servers=bootstrap, namespace=self.namespace, partitions=partitions)
        KafkaBackend(settings, transactional=False).close()  # the events topic the group subscribes to
        self.members: dict[str, Member] = {}
        self.lock = threading.Lock()

    def start(self, name: str) -> Member:
        cmd = [
            sys.executable,
            __file__,
            "member",
            "--bootstrap",
            self.bootstrap,
            "--namespace",
            self.namespace,
            "--partitions",
            str(self.partitions),
            "--protocol",
            self.protocol,
            "--name",
            name,
        ]
        if self.static:
            cmd += ["--instance-id", name]
        process = subprocess.Popen(cmd, stdout=subprocess.PIPE, text=True)
        member = Member(name, process)
        with self.lock:
            self.members[name] = member
        threading.Thread(target=self._follow, args=(member,), daemon=True).start()
        return member

    def _follow(self, member: Member) -> None:
        assert member.process.stdout is not None  # started with stdout=PIPE
        for line in member.process.stdout:
            event, at, parts = line.split()
            numbers = [] if parts == "-" or not parts else [int(p) for p in parts.split(",") if p]
            with self.lock:
                member.changes.append((event, float(at), numbers))
                if event == "assigned":
                    member.owned |= set(numbers)
                elif event in ("revoked", "lost"):
                    member.owned -= set(numbers)
                    member.revocations += event == "revoked"

    def owners(self) -> dict[int, str]:
        with self.lock:
            return {p: m.name for m in self.members.values() if m.process.poll() is None for p in m.owned}

    def wait(self, condition, timeout_s: float) -> float:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if condition():
                return time.time()
            time.sleep(0.02)
        raise TimeoutError(f"condition not reached within {timeout_s} s; owners {self.owners()}")

    def settled(self) -> bool:
        owners = self.owners()
        return len(owners) == self.partitions and len(set(owners.values())) == len(
            [m for m in self.members.values() if m.process.poll() is None]
        )

    def stop(self) -> None:
        for member in self.members.values():
            if member.process.poll() is None:
                member.process.terminate()
        for member in self.members.values():
            try:
                member.process.wait(30)
            except subprocess.TimeoutExpired:
                member.process.kill()


def scenario(bootstrap: str, partitions: int, protocol: str, *, static: bool, how: str, timeout_s: float) -> dict:
    fleet = Fleet(bootstrap, partitions, protocol, static)
    try:
        for i in range(MEMBERS):
            fleet.start(f"m{i}")
        fleet.wait(fleet.settled, 120)
        time.sleep(1.0)  # let any trailing rebalance finish
        victim = fleet.members["m0"]
        moved = set(victim.owned)
        others_revoked = sum(m.revocations for m in fleet.members.values() if m is not victim)
        signalled = time.time()
        if how == "sigterm":
            victim.process.terminate()
        else:
            victim.process.kill()
        victim.process.wait()
        result: dict = {"protocol": protocol, "static": static, "signal": how, "partitions_moved": len(moved)}
        if how == "restart":
            again = fleet.start("m0")  # the same instance id
            done = fleet.wait(lambda: moved <= again.owned, timeout_s)
            result["seconds_until_back"] = round(done - signalled, 2)
            result["rebalance_seen_by_others"] = (
                sum(m.revocations for m in fleet.members.values() if m.name != "m0") > others_revoked
            )
        else:
            done = fleet.wait(lambda: all(fleet.owners().get(p) not in (None, "m0") for p in moved), timeout_s)
            result["seconds_until_moved"] = round(done - signalled, 2)
        return result
    finally:
        fleet.stop()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = parser.add_subparsers(dest="command")
    member = sub.add_parser("member")
    for flag in ("--bootstrap", "--namespace", "--protocol", "--name"):
        member.add_argument(flag, required=True)
    member.add_argument("--partitions", type=int, required=True)
    member.add_argument("--instance-id")
    parser.add_argument("--json", action="store_true")
    parser.add_argument("--partitions", type=int, default=12)
    parser.add_argument("--skip-consumer-protocol", action="store_true", help="its SIGKILL case waits ~45 s")
    args = parser.parse_args()
    if args.command == "member":
        member_main(args)
        return
    cases = [
        ("classic", False, "sigkill"),
        ("classic", False, "sigterm"),
        ("classic", True, "restart"),
        ("classic", True, "sigterm"),
    ]
    if not args.skip_consumer_protocol:
        cases += [("consumer", False, "sigkill"), ("consumer", False, "sigterm")]
    results = []
    with kafka_bootstrap() as bootstrap:
        for protocol, static, how in cases:
            log(f"group failover: {protocol}{' static' if static else ''} {how} ...")
            results.append(scenario(bootstrap, args.partitions, protocol, static=static, how=how, timeout_s=120))
            log(f"  {results[-1]}")
    if args.json:
        print(json.dumps({"members": MEMBERS, "partitions": args.partitions, "cases": results}, indent=2))
    else:
        for r in results:
            print(r)


if __name__ == "__main__":
    os.environ.setdefault("PYTHONUNBUFFERED", "1")
    main()
