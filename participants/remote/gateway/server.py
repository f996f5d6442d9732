"""Running the gateway: as the CLI's process (:func:`serve_gateway`) or on a background thread of
this one (:class:`GatewayServer`: tests, notebooks, the bench)."""

from __future__ import annotations

import logging
import socket
from collections.abc import Callable

from rollout_journal.journal.errors import ConfigurationError
from rollout_journal.journal.journal import Journal
from rollout_journal.journal.open import is_kafka_url, open_journal
from rollout_journal.participants.remote.gateway.app import Gateway, GatewayConfig
from rollout_journal.participants.remote.gateway.upstream import open_upstream
from rollout_journal.participants.remote.serving import ThreadedServer, bind, run_loop, serve, url_of
from rollout_journal.participants.session.ownership import GroupOwnership, RolloutOwnership

__all__ = ["GatewayServer", "build_gateway", "serve_gateway"]

log = logging.getLogger(__name__)


def build_gateway(config: GatewayConfig, journal: Journal | None = None, *, listening: str | None = None) -> Gateway:
    """The gateway over ``config``'s journal (or ``journal``) and upstream; it has read the journal.
    Under group ownership it has joined the namespace's group (call it from within the serving
    loop), advertising ``config.advertise`` or ``listening``, the URL it serves at."""
    if config.ownership == "group" and not is_kafka_url(config.journal):
        raise ConfigurationError(
            f"gateway --ownership group shares a Kafka namespace among gateways; {config.journal} is a file "
            "journal, which has one writer: use --ownership single, or a kafka://host:port/namespace journal"
        )
    upstream = open_upstream(
        config.upstream,
        config.model_dir,
        api=config.upstream_api,
        retries=config.upstream_retries,
        logprobs=config.upstream_logprobs,
    )
    ownership: RolloutOwnership | None = None
    if config.ownership == "group":
        name = config.writer_name()
        journal = journal if journal is not None else open_journal(config.journal, mode="member", writer=name)
        ownership = GroupOwnership(journal, name=name, address=config.advertise or _reachable(listening))
    journal = journal if journal is not None else open_journal(config.journal, writer=config.writer_name())
    gateway = Gateway(config, journal, upstream, ownership=ownership)
    gateway.start()
    return gateway


def _reachable(url: str | None) -> str | None:
    """``url`` as other machines reach it: a wildcard address is named by this host's name."""
    if url is None:
        return None
    for wildcard in ("//0.0.0.0:", "//[::]:"):
        if wildcard in url:
            return url.replace(wildcard, f"//{socket.getfqdn()}:")
    return url


def serve_gateway(config: GatewayConfig, *, ready: Callable[[str], None] = lambda url: None) -> None:
    """Serve until SIGINT or SIGTERM; every append is durable before the journal closes."""
    sock = bind(config.host, config.port)

    async def main() -> None:
        gateway = build_gateway(config, listening=url_of(sock))  # in the loop: a group member joins from it
        try:
            await serve(gateway.app(), sock, ready=ready, on_stop=gateway.aclose)
        finally:
            gateway.journal.close()

    run_loop(main())


class GatewayServer(ThreadedServer):
    """A gateway on a background thread (``.url``; ``.gateway`` once started). The journal is
    closed with it unless it was handed in."""

    def __init__(self, config: GatewayConfig, journal: Journal | None = None) -> None:
        self.gateway: Gateway | None = None
        self._own_journal = journal is None
        self._journal = journal

        def make_app() -> object:
            self.gateway = build_gateway(config, journal, listening=self.url)
            return self.gateway.app()

        async def on_stop() -> None:
            if self.gateway is not None:
                await self.gateway.aclose()
                if self._own_journal:
                    self.gateway.journal.close()

        super().__init__(make_app, host=config.host, port=config.port, name="gateway", on_stop=on_stop)

    def base_url(self, rollout_id: str) -> str:
        """What an agent is given: the gateway's OpenAI base URL for one rollout."""
        return f"{self.url}/r/{rollout_id}/v1"
