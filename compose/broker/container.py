"""One Kafka broker in a container, started through testcontainers from the locally built image.

The container runs the image of :mod:`rollout_journal.compose.broker.image` with host networking,
on two free loopback ports chosen here and passed in by environment, so the
bootstrap address is ``127.0.0.1:<port>`` as for the jar launcher. Nothing is
pulled: an image missing from the local engine is an error, never a download,
and testcontainers' reaper (Ryuk, an image from a registry) is switched off;
containers started here are removed by :meth:`BrokerContainer.stop` or at exit.

Needs the ``docker`` extra (``pip install 'rollout-journal[docker]'``: testcontainers).
"""

from __future__ import annotations

import logging
import os
import uuid
from dataclasses import dataclass, field
from typing import Any

from rollout_journal.compose.broker.image import DockerImageError, image_name, image_status
from rollout_journal.compose.cluster_handle import BrokerHandle
from rollout_journal.compose.local_broker import BrokerStartError, free_ports, wait_for_brokers

log = logging.getLogger(__name__)

NAME_PREFIX = "rollout-journal-kafka-"
RYUK_ENV_VAR = "TESTCONTAINERS_RYUK_DISABLED"


@dataclass(eq=False)
class BrokerContainer(BrokerHandle):
    """A running broker container; a context manager, or call :meth:`stop`."""

    container: Any  # testcontainers.core.container.DockerContainer
    bootstrap_servers: str
    image: str
    _stopped: bool = field(default=False, repr=False)

    @property
    def name(self) -> str:
        return str(self.container.get_wrapped_container().name)

    def exited(self) -> str | None:
        """None while the container runs; otherwise its state, exit code and the tail of its output."""
        wrapped = self.container.get_wrapped_container()
        wrapped.reload()
        if wrapped.status == "running":
            return None
        code = wrapped.attrs.get("State", {}).get("ExitCode")
        return f"container {wrapped.name} is {wrapped.status} (exit {code})\n{self.logs_tail()}"

    def logs_tail(self, lines: int = 30) -> str:
        """The last lines the broker wrote to stdout/stderr (``docker logs``)."""
        try:
            out = self.container.get_wrapped_container().logs(tail=lines)
        except Exception as exc:  # noqa: BLE001 - a log tail is only a detail of another error
            return f"(no logs: {exc})"
        return bytes(out).decode("utf-8", "replace").rstrip()

    def stop(self) -> None:
        """Remove the container and its anonymous data volume. Idempotent."""
        if self._stopped:
            return
        self._stopped = True
        self._forget_at_exit()
        self.container.stop()


def start_broker_container(
    image: str | None = None,
    *,
    extra_config: dict[str, str] | None = None,
    ready_timeout_s: float = 60.0,
) -> BrokerContainer:
    """Start a 1-node KRaft broker container and return once it serves metadata.

    ``image`` defaults to :func:`rollout_journal.compose.broker.image.image_name`; it must already
    be in the local engine. ``extra_config`` overrides server properties. On
    failure the container is removed and the error carries its output.
    """
    image = image or image_name()
    status = image_status(image)
    if not status.usable:
        raise DockerImageError(
            f"image {image} is not in the local Docker engine and is never pulled: build it with "
            "`python3 -m rollout_journal.compose.broker.image build` (or set KAFKA_IMAGE to an image that is there)"
        )
    if status.state == "stale":
        log.warning(
            "broker image %s was built from older sources; rebuild it with "
            "`python3 -m rollout_journal.compose.broker.image build`",
            image,
        )
    container_class = _docker_container_class()
    port, controller_port = free_ports(2)
    container = (
        container_class(image)
        .with_name(f"{NAME_PREFIX}{uuid.uuid4().hex[:8]}")
        .with_kwargs(network_mode="host")
        .with_env("KAFKA_NODE_ID", "1")
        .with_env("KAFKA_QUORUM", f"1:{port}:{controller_port}")
    )
    if extra_config:
        container = container.with_env("KAFKA_EXTRA_PROPERTIES", "\n".join(f"{k}={v}" for k, v in extra_config.items()))
    broker = BrokerContainer(container, f"127.0.0.1:{port}", image)
    broker.stop_at_exit()  # without Ryuk nothing else removes a container whose test run died
    try:
        container.start()
        wait_for_brokers(
            broker.bootstrap_servers,
            {1},
            timeout_s=ready_timeout_s,
            what=f"broker container of {image}",
            dead=broker.exited,
            details=broker.logs_tail,
        )
    except BaseException:
        broker.stop()
        raise
    log.info("broker container %s ready at %s", broker.name, broker.bootstrap_servers)
    return broker


def _docker_container_class() -> Any:
    """testcontainers' DockerContainer, with its reaper off: Ryuk's image could only come from a registry."""
    os.environ.setdefault(RYUK_ENV_VAR, "true")
    try:
        from testcontainers.core.config import testcontainers_config
        from testcontainers.core.container import DockerContainer
    except ImportError as exc:
        raise BrokerStartError(
            f"testcontainers is not installed ({exc}): install the docker extra, `pip install 'rollout-journal[docker]'`"
        ) from exc
    testcontainers_config.ryuk_disabled = True
    return DockerContainer
