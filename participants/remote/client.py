"""The worker's side of a resource server: a client, and environments whose resources live there.

:class:`RemoteEnvironment` is an :class:`~rollout_journal.participants.environments.base.Environment` whose
task, tools and resources are hosted by a resource server
(:mod:`rollout_journal.participants.remote.server`): each step is one HTTP request carrying the
rollout's attempt, epoch, idempotency key and the revisions it expects. Its resources
are :class:`RemoteResource` mirrors: revisions, chain heads and digests come back with
every answer, so reading them costs no request.

Errors come back as what the server raised (:func:`~rollout_journal.participants.remote.protocol.raise_error`).
Transient failures (connection refused or reset, timeouts, HTTP 5xx, a session held by a
checkpoint) are retried with exponential backoff and jitter (tenacity) for up to the
workload's ``resource_server_wait_s``; a server that was restarted in the meantime
answers that it does not know the rollout (:class:`ResourceSessionLostError`), and the
agent brings the rollout's resources back from its journal.

:class:`EnvironmentFactory` builds each rollout's environment where the workload says:
in this process, or at the server named for its kind in ``resource_servers``.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Iterable, Mapping, Sequence
from typing import Any
from urllib.parse import quote

import httpx
from tenacity import (
    AsyncRetrying,
    Retrying,
    retry_if_exception_type,
    stop_after_delay,
    wait_random_exponential,
)

from rollout_journal.participants.environments.base import (
    Action,
    Environment,
    Observation,
    RequestFor,
    StepContext,
    StepMutations,
)
from rollout_journal.participants.environments.registry import make_environment
from rollout_journal.participants.environments.tasks import Task
from rollout_journal.participants.environments.tool_calls import ToolCall
from rollout_journal.participants.remote.protocol import (
    ResourceServerUnavailableError,
    ServiceToken,
    TransientControlError,
    decode_exports,
    encode_exports,
    raise_error,
)
from rollout_journal.participants.resources import (
    MutationRecord,
    MutationRequest,
    Recovery,
    RecoveryNotSupportedError,
    Resource,
)

__all__ = ["EnvironmentFactory", "RemoteEnvironment", "RemoteResource", "ResourceServiceClient"]

log = logging.getLogger(__name__)

_BACKOFF_S = 0.05  # first retry after up to 50 ms, doubling (with jitter) up to _BACKOFF_MAX_S
_BACKOFF_MAX_S = 2.0


class ResourceServiceClient:
    """One resource server, shared by every rollout of a worker that runs there: pooled
    connections, the bearer token, timeouts and the retry policy."""

    def __init__(
        self,
        base_url: str,
        token: ServiceToken,
        *,
        timeout_s: float = 30.0,
        wait_s: float = 60.0,
        max_connections: int = 64,
    ) -> None:
        self.base_url = base_url.rstrip("/")
        self.wait_s = wait_s
        self._token = token
        self._timeout = httpx.Timeout(timeout_s)
        self._limits = httpx.Limits(max_connections=max_connections, max_keepalive_connections=max_connections)
        self._sync = httpx.Client(
            base_url=self.base_url, headers=token.header(), timeout=self._timeout, limits=self._limits
        )
        self._async: httpx.AsyncClient | None = None
        self._async_loop: asyncio.AbstractEventLoop | None = None

    def __repr__(self) -> str:
        return f"ResourceServiceClient({self.base_url!r})"  # never the token

    # -- one request ------------------------------------------------------------------------
    def request(
        self, method: str, path: str, body: Mapping[str, Any] | None = None, *, what: str, retry: bool = True
    ) -> dict[str, Any]:
        """The JSON answer of one request; transient failures are retried for ``wait_s`` when ``retry``."""

        def once() -> dict[str, Any]:
            try:
                response = self._sync.request(method, path, json=body)
            except httpx.TransportError as exc:
                raise TransientControlError(f"{what}: {self.base_url} does not answer ({exc!r})") from exc
            return self._answer(response, what)

        if not retry:
            return once()
        try:
            for attempt in Retrying(**self._policy(what)):
                with attempt:
                    return once()
        except TransientControlError as exc:
            raise ResourceServerUnavailableError(f"{exc} (gave up after {self.wait_s}s)") from exc
        raise AssertionError("unreachable")

    async def arequest(
        self, method: str, path: str, body: Mapping[str, Any] | None = None, *, what: str, retry: bool = True
    ) -> dict[str, Any]:
        """:meth:`request` on the event loop."""
        client = self._async_client()

        async def once() -> dict[str, Any]:
            try:
                response = await client.request(method, path, json=body)
            except httpx.TransportError as exc:
                raise TransientControlError(f"{what}: {self.base_url} does not answer ({exc!r})") from exc
            return self._answer(response, what)

        if not retry:
            return await once()
        try:
            async for attempt in AsyncRetrying(**self._policy(what)):
                with attempt:
                    return await once()
        except TransientControlError as exc:
            raise ResourceServerUnavailableError(f"{exc} (gave up after {self.wait_s}s)") from exc
        raise AssertionError("unreachable")

    def _policy(self, what: str) -> dict[str, Any]:
        def say(state: Any) -> None:
            if state.attempt_number in (1, 10) or state.attempt_number % 50 == 0:
                log.warning("%s: retrying (try %d): %s", what, state.attempt_number, state.outcome.exception())

        return {
            "retry": retry_if_exception_type(TransientControlError),
            "reraise": True,
            "wait": wait_random_exponential(multiplier=_BACKOFF_S, max=_BACKOFF_MAX_S),
            "stop": stop_after_delay(self.wait_s),
            "before_sleep": say,
        }

    @staticmethod
    def _answer(response: httpx.Response, what: str) -> dict[str, Any]:
        try:
            body = response.json()
        except ValueError:
            body = response.text
        if response.status_code >= 400 or not isinstance(body, dict):
            raise_error(response.status_code, body, what)
        return body

    def _async_client(self) -> httpx.AsyncClient:
        loop = asyncio.get_running_loop()
        if self._async is None or self._async_loop is not loop:  # a client's pool belongs to one loop
            self._async = httpx.AsyncClient(
                base_url=self.base_url, headers=self._token.header(), timeout=self._timeout, limits=self._limits
            )
            self._async_loop = loop
        return self._async

    async def aclose(self) -> None:
        if self._async is not None and self._async_loop is asyncio.get_running_loop():
            await self._async.aclose()
        self._async = self._async_loop = None
        self._sync.close()

    def close(self) -> None:
        self._sync.close()


class RemoteResource(Resource):
    """A mirror of a resource hosted by a resource server. Revision, chain head, digest and the
    rollout's fence are what the server's last answer said; mutations, queries and exports go
    over HTTP. Import, replay and reset go through the environment (:meth:`RemoteEnvironment.restore`)."""

    def __init__(self, env: RemoteEnvironment, head: Mapping[str, Any]) -> None:
        super().__init__(head["resource_id"])
        self._env = env
        self.kind = head["kind"]  # type: ignore[misc]  # per instance: whatever the server hosts
        self.recovery = Recovery(head["recovery"])  # type: ignore[misc]
        self.supports_export = bool(head["supports_export"])  # type: ignore[misc]
        self._digest = ""
        self.mirror(head)

    @property
    def name(self) -> str:
        return self.resource_id.rsplit("/", 1)[-1]

    def mirror(self, head: Mapping[str, Any]) -> None:
        self._revision, self._chain_hash, self._digest = head["revision"], head["chain_hash"], head["state_digest"]
        self._fences[self._env.rollout_id] = head["fenced_epoch"]

    def state_digest(self) -> str:
        return self._digest

    def mutate(self, req: MutationRequest, op: str, args: Mapping[str, Any]) -> MutationRecord:
        answer = self._env.client.request(
            "POST",
            f"{self._env.path}/resources/{quote(self.name, safe='')}/mutate",
            {
                "op": op,
                "args": dict(args),
                "attempt": req.attempt,
                "epoch": req.epoch,
                "idempotency_key": req.idempotency_key,
                "expected_revision": req.expected_revision,
            },
            what=f"mutation {op!r} of {self.resource_id}",
        )
        self._env.mirror(answer["heads"])
        return MutationRecord.from_dict(answer["record"])

    def query(self, op: str, args: Mapping[str, Any] | None = None) -> dict[str, Any]:
        answer = self._env.client.request(
            "POST",
            f"{self._env.path}/resources/{quote(self.name, safe='')}/query",
            {"op": op, "args": dict(args or {})},
            what=f"query {op!r} of {self.resource_id}",
        )
        result: dict[str, Any] = answer["result"]  # the host's Resource.query answer: a JSON object
        return result

    def export_state(self) -> bytes:
        return self._env.export_now([self.resource_id])[self.resource_id]

    def fence(self, rollout_id: str, epoch: int) -> None:
        self._env.fence(rollout_id, epoch)

    def replay(self, record: MutationRecord) -> None:
        raise self._through_environment("replay")

    def import_state(self, data: bytes) -> None:
        raise self._through_environment("import")

    def reset(self) -> None:
        raise self._through_environment("reset")

    def close(self) -> None:
        """Nothing here: the server closes the rollout's resources with its session."""

    def _through_environment(self, what: str) -> RecoveryNotSupportedError:
        return RecoveryNotSupportedError(
            f"resource {self.resource_id!r} lives in {self._env.client.base_url}: {what} "
            "it through its environment (RemoteEnvironment.restore), one request for all"
        )

    def _apply(self, op: str, args: dict[str, Any]) -> dict[str, Any]:
        raise self._through_environment("apply")

    def _query(self, op: str, args: dict[str, Any]) -> dict[str, Any]:
        raise self._through_environment("query")

    def _canonical_state(self) -> object:
        raise self._through_environment("read the state of")


class RemoteEnvironment(Environment):
    """A rollout's environment hosted by a resource server (``fresh``: at the task's initial state,
    whatever the server held for this rollout; else attached to what it holds)."""

    def __init__(
        self, client: ResourceServiceClient, environment: str, rollout_id: str, task: Task | int, *, fresh: bool = True
    ) -> None:
        super().__init__(rollout_id, task)
        self.name = environment  # type: ignore[misc]  # the kind the server hosts
        self.client = client
        self.path = f"/v1/rollouts/{quote(rollout_id, safe='')}"
        self.last_restore: str | None = None  # how the server took the last restore: reconciled, imported, fresh
        self._prompt = ""
        self._actions: list[str] = []
        self._closed = False
        if fresh:
            self._described(self._call("restore", self._restore_body({}, [], None)))
        else:
            self._described(self._call("open", {"task": self.task.to_json()}))

    def __repr__(self) -> str:
        return f"RemoteEnvironment({self.name!r}, {self.rollout_id!r} at {self.client.base_url})"

    # -- what the server said ----------------------------------------------------------------
    def _described(self, doc: Mapping[str, Any]) -> None:
        self._prompt, self._actions = doc["task_prompt"], list(doc["actions"])
        self.mirror(doc["heads"])
        self.last_restore = doc.get("mode", self.last_restore)

    def mirror(self, heads: Iterable[Mapping[str, Any]]) -> None:
        for head in heads:
            resource = self.resources.get(head["resource_id"])
            if isinstance(resource, RemoteResource):
                resource.mirror(head)
            else:
                self._add_resource(RemoteResource(self, head))

    def _call(self, route: str, body: Mapping[str, Any], **kwargs: Any) -> dict[str, Any]:
        return self.client.request(
            "POST", f"{self.path}/{route}", body, what=f"{route} of rollout {self.rollout_id}", **kwargs
        )

    async def _acall(self, route: str, body: Mapping[str, Any], **kwargs: Any) -> dict[str, Any]:
        return await self.client.arequest(
            "POST", f"{self.path}/{route}", body, what=f"{route} of rollout {self.rollout_id}", **kwargs
        )

    # -- the agent-facing API ------------------------------------------------------------------
    def task_prompt(self) -> str:
        return self._prompt

    def action_space(self) -> list[str]:
        return list(self._actions)

    def step(self, action: Action, request_for: RequestFor) -> tuple[Observation, list[MutationRecord]]:
        return self._stepped(self._call("step", self._step_body(action, request_for)))

    async def astep(self, action: Action, request_for: RequestFor) -> tuple[Observation, list[MutationRecord]]:
        return self._stepped(await self._acall("step", self._step_body(action, request_for)))

    def _step_body(self, action: Action, request_for: RequestFor) -> dict[str, Any]:
        if not isinstance(request_for, StepContext):
            raise TypeError(
                "a remote environment's step takes a StepContext: the server derives the "
                "mutations' keys from its key prefix"
            )
        spelled: Any = (
            {"name": action.name, "arguments": dict(action.arguments)} if isinstance(action, ToolCall) else action
        )
        return {
            "action": spelled,
            "attempt": request_for.attempt,
            "epoch": request_for.epoch,
            "key": request_for.key_prefix,
            "expected_revisions": self.revisions(),
        }

    def _stepped(self, answer: Mapping[str, Any]) -> tuple[Observation, list[MutationRecord]]:
        self.mirror(answer["heads"])
        self._actions = list(answer["actions"])
        observation = Observation(answer["observation"]["text"], bool(answer["observation"]["done"]))
        return observation, [MutationRecord.from_dict(r) for r in answer["records"]]

    def _perform(self, action: str, mutations: StepMutations) -> str:
        raise AssertionError("a remote environment performs its actions in its server")

    def verify(self) -> float:
        return float(self._call("verify", {})["reward"])

    async def averify(self) -> float:
        return float((await self._acall("verify", {}))["reward"])

    # -- exports and checkpoints ----------------------------------------------------------------
    def export_now(self, resource_ids: Sequence[str]) -> dict[str, bytes]:
        return decode_exports(self._call("export", {"resource_ids": list(resource_ids)})["exports"])

    async def aexport(self, resource_ids: Iterable[str]) -> dict[str, bytes]:
        return decode_exports((await self._acall("export", {"resource_ids": list(resource_ids)}))["exports"])

    async def aprepare_checkpoint(self, epoch: int, hold_s: float = 60.0) -> dict[str, bytes]:
        """Prepare: the server holds the rollout's session (steps wait) and exports. Not retried
        here: the checkpointer retries within its prepare timeout."""
        answer = await self._acall("prepare", {"epoch": epoch, "hold_s": hold_s}, retry=False)
        self.mirror(answer["heads"])
        return decode_exports(answer["exports"])

    async def aend_checkpoint(self, epoch: int, committed: bool) -> None:
        await self._acall("resume" if committed else "abort", {"epoch": epoch}, retry=False)

    # -- restore, fencing, lifetime ------------------------------------------------------------------
    def _restore_body(
        self, exports: Mapping[str, bytes], mutations: Sequence[MutationRecord], fence_epoch: int | None
    ) -> dict[str, Any]:
        return {
            "task": self.task.to_json(),
            "exports": encode_exports(exports),
            "mutations": [m.to_dict() for m in mutations],
            "fence_epoch": fence_epoch,
        }

    def restore(
        self, exports: Mapping[str, bytes], mutations: Sequence[MutationRecord], *, fence_epoch: int | None = None
    ) -> None:
        """The server reconciles by revision (its heads equal the journal's: nothing moves) or
        imports the exports and re-applies the mutations; ``{}`` and ``[]``: a fresh environment."""
        self._described(self._call("restore", self._restore_body(exports, mutations, fence_epoch)))

    async def arestore(
        self, exports: Mapping[str, bytes], mutations: Sequence[MutationRecord], *, fence_epoch: int | None = None
    ) -> None:
        self._described(await self._acall("restore", self._restore_body(exports, mutations, fence_epoch)))

    def fence(self, rollout_id: str, epoch: int) -> None:
        if all(r.fenced_epoch(rollout_id) >= epoch for r in self.resources.values()) and self.resources:
            return  # the server fenced it already (a restore carries the next attempt's epoch)
        self.mirror(self._call("fence", {"epoch": epoch})["heads"])

    def replay(self, records: Iterable[MutationRecord]) -> None:
        raise RecoveryNotSupportedError(f"{self!r}: re-apply journaled mutations with restore(exports, mutations)")

    def reset(self) -> None:
        self.restore({}, [])

    def close(self) -> None:
        """The rollout is done here: the server drops its session. Best effort: a server that is
        gone holds nothing to drop."""
        if self._closed:
            return
        self._closed = True
        try:
            self.client.request("DELETE", self.path, what=f"close of rollout {self.rollout_id}", retry=False)
        except Exception as exc:  # closing must never hide the error that led here
            log.info("%r: could not close its session: %s", self, exc)


class EnvironmentFactory:
    """Builds each rollout's environment where the workload says: at the resource server named for
    its kind in ``resource_servers``, or in this process."""

    def __init__(
        self,
        resource_servers: Mapping[str, str],
        *,
        timeout_s: float = 30.0,
        wait_s: float = 60.0,
        max_connections: int = 64,
    ) -> None:
        token = ServiceToken.from_environment("a workload with resource_servers") if resource_servers else None
        self.clients = {
            name: ResourceServiceClient(url, token, timeout_s=timeout_s, wait_s=wait_s, max_connections=max_connections)
            for name, url in resource_servers.items()
            if token is not None
        }

    @classmethod
    def for_workload(cls, config: Any) -> EnvironmentFactory:
        return cls(
            config.resource_servers,
            timeout_s=config.resource_timeout_s,
            wait_s=config.resource_server_wait_s,
            max_connections=max(8, config.concurrency),
        )

    def build(self, environment: str, rollout_id: str, task: Task, *, fresh: bool = True) -> Environment:
        """The rollout's environment; a remote one ``fresh`` (the task's initial state) or attached
        to what its server holds (a resume reconciles or imports next)."""
        client = self.clients.get(environment)
        if client is None:
            return make_environment(environment, rollout_id, task)
        return RemoteEnvironment(client, environment, rollout_id, task, fresh=fresh)

    async def aclose(self) -> None:
        for client in self.clients.values():
            await client.aclose()

    def close(self) -> None:
        for client in self.clients.values():
            client.close()
