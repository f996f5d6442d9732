"""The common base of every local-broker failure, in a module of its own.

:mod:`rollout_journal.compose.maven_jars`, :mod:`rollout_journal.compose.local_broker` and
:mod:`rollout_journal.compose.broker.daemon` each raise their own subclasses; keeping the base
here lets them import it without importing each other, and lets the CLI catch
one type for all of them.
"""

from __future__ import annotations


class LocalBrokerError(RuntimeError):
    """Base class for every failure of the local Kafka launcher."""
