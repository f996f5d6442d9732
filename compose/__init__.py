"""Running Kafka for rollout-journal: a local cluster without Docker (``rollout-journal kafka``),
the broker image and the compose file (see ``compose/README.md``).

The package exports nothing itself: its API is its modules (``cli``, ``local_broker``,
``compose_cluster``, ``cluster_handle``, ``scram_users``, ``broker``).
"""

__all__: list[str] = []
