"""Settings of the Kafka backend: where the cluster is, how topics look, how clients talk.

Three ways to build them, all returning a validated :class:`KafkaSettings`:

- ``KafkaSettings(bootstrap_servers=..., namespace=..., transactional_id=...)``;
- ``KafkaSettings.from_url("kafka://h1:9092,h2:9092/ns?partitions=8&replication_factor=3&transactional_id=w0")``:
  the path is the namespace; a query key that is a setting sets it; a query key
  containing a dot (``security.protocol=SASL_SSL``) or prefixed ``librdkafka.``
  goes to the ``librdkafka`` passthrough; anything else is an error. Credentials
  do not belong in a URL, which travels into workload YAML and the journal
  (``user:pass@`` and secret properties such as ``sasl.password`` are refused):
  pass them by environment;
- ``KafkaSettings.from_env(namespace=..., transactional_id=...)``: the keyword
  arguments are defaults, ``ROLLOUT_JOURNAL_KAFKA_URL`` (when set) is parsed over
  them, then the variables below.

Environment overrides (``from_url`` and ``from_env`` apply them last, so they win;
pass ``env={}`` to ignore the process environment):

- ``KAFKA_BOOTSTRAP_SERVERS`` -> ``bootstrap_servers``;
- ``ROLLOUT_JOURNAL_KAFKA_<SETTING>`` -> that setting, upper-cased
  (``ROLLOUT_JOURNAL_KAFKA_PARTITIONS=16``, ``ROLLOUT_JOURNAL_KAFKA_TRANSACTIONAL_ID=worker-3``);
  it beats ``KAFKA_BOOTSTRAP_SERVERS``. An unknown ``ROLLOUT_JOURNAL_KAFKA_*`` name
  is an error, so a typo never goes unnoticed;
- ``ROLLOUT_JOURNAL_LIBRDKAFKA_<NAME>`` -> librdkafka property ``<name>`` lower-cased
  with ``_`` read as ``.`` and ``__`` as a literal ``_``
  (``ROLLOUT_JOURNAL_LIBRDKAFKA_SASL_PASSWORD`` -> ``sasl.password``).

The ``librdkafka`` dict is passed verbatim to every client (producer, consumers,
admin) after the backend's own settings, so it carries security and tuning
(``security.protocol``, ``sasl.mechanism``, ``sasl.username``, ``sasl.password``,
``ssl.ca.location``, ...). Properties that would break the journal's guarantees
(idempotence, ``acks``, the transactional id, read-committed isolation, auto
commit) are refused. Values that look secret are redacted in ``repr``/``str``.

Producer defaults, measured on the single-node dev broker (2 cores, shared) with
~6.2 KB ModelCall records (1,280 packed token ids + 256 logprobs):

- ``compression.type=lz4``: on uniformly random token ids it saves nothing (wire
  bytes = payload bytes) and costs no measurable commit throughput; on skewed
  (Zipf) token ids it sends 0.68 of the bytes. zstd sends 0.40-0.71 but cut
  200-record commit throughput by 35-50 % on this CPU; gzip is far slower.
- ``linger.ms=5``: a commit flushes at its end, so linger only lets the records
  of one commit leave in full batches; 0 and 5 measure the same within noise.
- ``batch.size=1000000``: librdkafka's default, under the broker's 1 MiB
  ``message.max.bytes``; a 200 x 6 KB commit spread over 8 partitions never
  fills it.
"""

from __future__ import annotations

import logging
import os
import re
from collections.abc import Mapping
from typing import Any, Literal
from urllib.parse import parse_qsl, urlsplit

from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator, model_validator

from rollout_journal.journal.errors import ConfigurationError
from rollout_journal.journal.whole_numbers import whole_number

ENV_BOOTSTRAP = "KAFKA_BOOTSTRAP_SERVERS"
ENV_PREFIX = "ROLLOUT_JOURNAL_KAFKA_"
ENV_URL = "ROLLOUT_JOURNAL_KAFKA_URL"
ENV_LIBRDKAFKA_PREFIX = "ROLLOUT_JOURNAL_LIBRDKAFKA_"

_log = logging.getLogger(__name__)

MAX_TOPIC_LEN = 249
_TOPIC_CHARS = re.compile(r"^[A-Za-z0-9._-]+$")
_SECRET_WORDS = ("password", "secret", "token", "key", "credential", "jaas", "oauthbearer.config")
# Owned by the backend: letting a user override them would silently break atomicity or fencing.
RESERVED_LIBRDKAFKA = frozenset(
    {
        "enable.idempotence",
        "acks",
        "request.required.acks",
        "transactional.id",
        "isolation.level",
        "enable.auto.commit",
        "enable.partition.eof",
    }
)
REDACTED = "**********"


def is_secret_property(name: str) -> bool:
    """Whether a librdkafka property's value must never be shown (passwords, keys, tokens)."""
    lowered = name.lower()
    return any(word in lowered for word in _SECRET_WORDS)


def redact_config(config: Mapping[str, Any]) -> dict[str, Any]:
    """A copy of a client config safe to log: secret values replaced, callables named."""
    out: dict[str, Any] = {}
    for name, value in config.items():
        if is_secret_property(name):
            out[name] = REDACTED
        elif callable(value) or not isinstance(value, (str, int, float, bool)):
            out[name] = f"<{type(value).__name__}>"
        else:
            out[name] = value
    return out


class KafkaSettings(BaseModel):
    """Where the journal lives on Kafka and how its topics and clients are configured."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    bootstrap_servers: str = Field(min_length=1)
    namespace: str
    """Topic prefix: topics are ``<namespace>.events`` and ``<namespace>.snapshots``."""
    partitions: int = Field(8, ge=1)
    replication_factor: int | None = Field(None, ge=1)
    """None: the broker's ``default.replication.factor``. An existing topic with fewer replicas is refused."""
    min_insync_replicas: int | None = Field(None, ge=1)
    """None: the cluster's. An asked value above the topic's is applied to it; one below is never applied
    (rollout-journal never lowers ``min.insync.replicas``)."""
    transactional_id: str | None = None
    """The worker's stable slot name (``worker-0``). Required to commit; readers leave it unset
    so they never fence the worker that owns the slot. The producer's ``transactional.id`` is
    ``<namespace>.<slot>`` (:attr:`producer_transactional_id`)."""
    transaction_timeout_ms: int = Field(10_000, ge=1000, le=900_000)
    """A transaction older than this is aborted by the broker. A worker's transaction lives one commit
    (milliseconds), so this bounds how long a take waits behind a crashed owner's open transaction
    (Kafka Streams' exactly-once default); a stalled one is healed (see ``journal.kafka.writer``)."""
    events_retention_ms: int = Field(-1, ge=-1)
    """-1 keeps events forever: they are the audit trail."""

    snapshot_segment_ms: int = Field(60_000, ge=1)
    """Roll the snapshot topic's active segment after this long: only rolled segments compact, and
    a restore reads the active segment whole. One minute keeps what a restore reads near the live
    rollouts' newest states (with turns of seconds to minutes, a minute holds a few snapshots of a
    rollout), where Kafka's 7 days, or the hour this was before, let every snapshot of the last
    hour be read again. The cleaner merges small cleaned segments up to
    ``snapshot_segment_bytes``, so the files per partition do not grow with it. Applied when the
    topic is created; an existing topic keeps its value (``kafka-configs --alter`` changes it)."""
    snapshot_segment_bytes: int = Field(64 * 1024 * 1024, ge=1)
    """Kafka 4 refuses less than 1 MiB."""
    snapshot_min_cleanable_dirty_ratio: float = Field(0.25, gt=0.0, le=1.0)
    """Lower than Kafka's 0.5: restore reads the whole snapshot topic, so keep garbage low."""
    snapshot_min_compaction_lag_ms: int = Field(0, ge=0)
    snapshot_delete_retention_ms: int = Field(600_000, ge=0)
    """How long a tombstone stays readable after compaction. Every take reads the two slot tombstones
    of each rollout acknowledged on its partition within this span: with Kafka's day, a take's cost
    grew with a day of history; with ten minutes, only the last ten count. A read that outlasts it may see
    a slot's value and miss its tombstone: that value lies before the rollout's acknowledged fence
    (one transaction wrote both), so readers ignore it (``journal.snapshots``). Applied when the
    topic is created; an existing topic keeps its value (``kafka-configs --alter`` changes it)."""

    linger_ms: int = Field(5, ge=0)
    batch_size: int = Field(1_000_000, ge=1)
    compression_type: Literal["none", "gzip", "snappy", "lz4", "zstd"] = "lz4"
    operation_timeout_ms: int = Field(30_000, ge=100)
    """Bound on admin requests, offset queries and a read that makes no progress."""
    cluster_unavailable_timeout_ms: int = Field(120_000, ge=1_000)
    """How long transient client errors (a broker gone, leadership or a coordinator moving, every
    broker down) are retried before the call fails (``journal.kafka.retry``): a replicated cluster
    that loses one broker settles within seconds; this is for a whole cluster restarting."""
    group_protocol: Literal["classic", "consumer"] = "classic"
    """The worker group's rebalance protocol. ``classic`` (with ``cooperative-sticky``) lets the
    client set the session timeout below; ``consumer`` (KIP-848) takes it from the broker's group
    config (45 s by default). See docs/design-notes.md for the measured failover of each."""
    group_session_timeout_ms: int = Field(6_000, ge=1_000)
    """Classic protocol: a worker silent for this long loses its partitions to the others (the
    broker's ``group.min.session.timeout.ms``, 6 s by default, is the floor)."""
    stable_read_timeout_ms: int = Field(10_000, ge=0)
    """How long a writer's read (restore) waits for another producer's open transaction to end before
    it refuses, naming the partition, rather than read a prefix that lacks later commits."""

    librdkafka: dict[str, str] = Field(default_factory=dict)

    def __init__(self, **data: Any) -> None:
        try:
            super().__init__(**data)
        except ValidationError as exc:
            raise ConfigurationError(f"invalid Kafka settings: {_problems(exc)}") from None

    @field_validator("namespace")
    @classmethod
    def _namespace_is_topic_prefix(cls, value: str) -> str:
        if not _TOPIC_CHARS.match(value) or value in (".", ".."):
            raise ValueError(
                f"namespace {value!r} is not a legal Kafka topic prefix: use letters, digits, '.', '_' and '-'"
            )
        if len(value) + len(".snapshots") > MAX_TOPIC_LEN:
            raise ValueError(
                f"namespace {value[:40]!r}... is too long: topic names are limited to {MAX_TOPIC_LEN} chars"
            )
        return value

    @field_validator("bootstrap_servers")
    @classmethod
    def _bootstrap_ports_are_numbers(cls, value: str) -> str:
        # librdkafka reads a bad port as port 0 and retries until a timeout: refuse it here, at once
        for server in (s.strip() for s in value.split(",")):
            if not server:
                raise ValueError(f"bootstrap servers {value!r} hold an empty entry")
            host, port = _host_and_port(server.split("://", 1)[-1])
            number = None if port is None else whole_number(port)
            if port is not None and not (number is not None and 1 <= number <= 65535):
                raise ValueError(f"bootstrap server {server!r}: port {port!r} is not a number in 1-65535")
            if not host:
                raise ValueError(f"bootstrap server {server!r} names no host")
        return value

    @field_validator("transactional_id")
    @classmethod
    def _transactional_id_not_blank(cls, value: str | None) -> str | None:
        if value is not None and not value.strip():
            raise ValueError("transactional_id must not be blank; leave it unset for a read-only backend")
        return value

    @field_validator("librdkafka", mode="before")
    @classmethod
    def _librdkafka_as_strings(cls, value: Any) -> Any:
        if not isinstance(value, Mapping):
            return value
        out: dict[str, str] = {}
        for name, item in value.items():
            if isinstance(item, bool):
                item = "true" if item else "false"
            elif isinstance(item, (int, float)):
                item = str(item)
            out[str(name)] = item
        return out

    @field_validator("librdkafka")
    @classmethod
    def _librdkafka_not_reserved(cls, value: dict[str, str]) -> dict[str, str]:
        reserved = sorted(RESERVED_LIBRDKAFKA.intersection(value))
        if reserved:
            raise ValueError(
                f"librdkafka properties {reserved} are set by the backend (atomic commits, fencing, "
                "read_committed reads) and cannot be overridden"
            )
        return value

    @model_validator(mode="after")
    def _isr_fits_replicas(self) -> KafkaSettings:
        if (
            self.min_insync_replicas is not None
            and self.replication_factor is not None
            and self.min_insync_replicas > self.replication_factor
        ):
            raise ValueError(
                f"min_insync_replicas={self.min_insync_replicas} exceeds replication_factor="
                f"{self.replication_factor}: every acks=all write would fail"
            )
        return self

    # -- names -------------------------------------------------------------------------------

    @property
    def events_topic(self) -> str:
        return f"{self.namespace}.events"

    @property
    def snapshots_topic(self) -> str:
        return f"{self.namespace}.snapshots"

    @property
    def results_topic(self) -> str:
        """Finished rollouts' training records, written in the same transaction as their final turn."""
        return f"{self.namespace}.results"

    @property
    def acks_topic(self) -> str:
        """The trainer's acknowledgements (``RolloutAcknowledged``), for each partition's owner to apply
        in its own transaction: the trainer never writes an owner's partitions."""
        return f"{self.namespace}.acks"

    @property
    def workloads_topic(self) -> str:
        """Every workload registration (``WorkloadRegistered``, key = workload name), one partition,
        compacted: what a fleet's workers follow to learn of workloads, never the snapshots."""
        return f"{self.namespace}.workloads"

    @property
    def summaries_topic(self) -> str:
        """Each rollout's ``RolloutSummary`` (key ``<rollout>/e<epoch>``), compacted, written in the
        same transaction as the events it folds: what ``replay list`` reads instead of every event."""
        return f"{self.namespace}.summaries"

    @property
    def producer_transactional_id(self) -> str | None:
        """``<namespace>.<slot>``: Kafka fences by ``transactional.id`` across the whole cluster,
        so a bare slot name (``worker-0``) would let a job in another namespace fence this one.
        (Group members use ``<namespace>.w.<name>.<boot>``; older fleets used ``<namespace>.p<N>``.)"""
        return None if self.transactional_id is None else f"{self.namespace}.{self.transactional_id}"

    @property
    def group_id(self) -> str:
        """``<namespace>.workers``: the consumer group whose assignment says which worker owns which partition."""
        return f"{self.namespace}.workers"

    # -- secrets stay out of repr/str/logs ---------------------------------------------------

    def __repr_args__(self) -> Any:
        for name, value in super().__repr_args__():
            if name == "librdkafka":
                value = redact_config(value)
            yield name, value

    # -- construction from a URL and the environment ------------------------------------------

    @classmethod
    def from_url(cls, url: str, *, env: Mapping[str, str] | None = None) -> KafkaSettings:
        """Settings from ``kafka://host:port[,host2:port]/namespace?setting=value&...``, then env overrides."""
        values = _parse_url(url)
        _warn_if_env_redirects(values["bootstrap_servers"], os.environ if env is None else env)
        return cls._build(values, env)

    @classmethod
    def from_env(cls, env: Mapping[str, str] | None = None, **defaults: Any) -> KafkaSettings:
        """Settings from ``defaults``, then ``ROLLOUT_JOURNAL_KAFKA_URL`` if set, then env overrides."""
        source = os.environ if env is None else env
        values: dict[str, Any] = dict(defaults)
        if source.get(ENV_URL):
            parsed = _parse_url(source[ENV_URL])
            _warn_if_env_redirects(parsed["bootstrap_servers"], source)
            extra = parsed.pop("librdkafka", {})
            values.update(parsed)
            values["librdkafka"] = {**values.get("librdkafka", {}), **extra}
        return cls._build(values, env)

    @classmethod
    def _build(cls, values: dict[str, Any], env: Mapping[str, str] | None) -> KafkaSettings:
        _apply_env(values, os.environ if env is None else env)
        return cls(**values)


def _host_and_port(address: str) -> tuple[str, str | None]:
    """``host:port``, ``[v6]:port`` or a bare host (librdkafka's default port)."""
    if address.startswith("["):
        host, _, rest = address[1:].partition("]")
        return host, rest[1:] if rest.startswith(":") else None
    host, sep, port = address.rpartition(":")
    return (host, port) if sep else (address, None)


def _problems(exc: ValidationError) -> str:
    # input values are left out on purpose: they may be secrets
    return "; ".join(f"{'.'.join(str(p) for p in e['loc']) or 'settings'}: {e['msg']}" for e in exc.errors())


_FIELDS = frozenset(KafkaSettings.model_fields) - {"librdkafka"}


def _parse_url(url: str) -> dict[str, Any]:
    parts = urlsplit(url)
    if parts.scheme != "kafka":
        raise ConfigurationError(f"Kafka URL {url!r} must start with kafka://")
    if "@" in parts.netloc:
        raise ConfigurationError(
            "Kafka URL must not carry credentials; set ROLLOUT_JOURNAL_LIBRDKAFKA_SASL_USERNAME / _SASL_PASSWORD"
        )
    if not parts.netloc:
        raise ConfigurationError(f"Kafka URL {url!r} names no bootstrap servers (kafka://host:port/namespace)")
    namespace = parts.path.strip("/")
    if not namespace:
        raise ConfigurationError(f"Kafka URL {url!r} names no namespace (kafka://host:port/namespace)")
    values: dict[str, Any] = {"bootstrap_servers": parts.netloc, "namespace": namespace}
    passthrough: dict[str, str] = {}
    for name, value in parse_qsl(parts.query, keep_blank_values=True, strict_parsing=False):
        bare = name.removeprefix("librdkafka.")
        if is_secret_property(bare) and not bare.endswith(".location"):  # a file's path is no secret
            # a URL travels: into workload YAML, `submit`'s registration in the journal, shell history
            raise ConfigurationError(
                f"Kafka URL must not carry the secret property {bare}; set it in the environment as "
                f"ROLLOUT_JOURNAL_LIBRDKAFKA_{bare.replace('_', '__').replace('.', '_').upper()}"
            )
        if name.startswith("librdkafka."):
            passthrough[name.removeprefix("librdkafka.")] = value
        elif "." in name:
            passthrough[name] = value
        elif name in _FIELDS:
            values[name] = value
        else:
            raise ConfigurationError(
                f"Kafka URL query parameter {name!r} is neither a setting ({', '.join(sorted(_FIELDS))}) "
                "nor a dotted librdkafka property"
            )
    if passthrough:
        values["librdkafka"] = passthrough
    return values


def _warn_if_env_redirects(named: str, env: Mapping[str, str]) -> None:
    """Say so when the environment sends a URL's clients to other servers than the URL names.

    The environment wins by design (a deployment points every command at its cluster), but a user
    who types ``replay list --journal kafka://other:9092/ns`` in a shell that exported
    ``KAFKA_BOOTSTRAP_SERVERS`` would otherwise read the exported cluster without a word.
    """
    for name in (ENV_PREFIX + "BOOTSTRAP_SERVERS", ENV_BOOTSTRAP):  # the order _apply_env gives them
        chosen = env.get(name)
        if chosen:
            if chosen != named:
                _log.warning("%s=%s overrides the bootstrap servers %s named by the Kafka URL", name, chosen, named)
            return


def _librdkafka_name(env_suffix: str) -> str:
    return env_suffix.lower().replace("__", "\0").replace("_", ".").replace("\0", "_")


def _apply_env(values: dict[str, Any], env: Mapping[str, str]) -> None:
    if env.get(ENV_BOOTSTRAP):
        values["bootstrap_servers"] = env[ENV_BOOTSTRAP]
    passthrough = dict(values.get("librdkafka") or {})
    for name, value in env.items():
        if name.startswith(ENV_LIBRDKAFKA_PREFIX):
            passthrough[_librdkafka_name(name.removeprefix(ENV_LIBRDKAFKA_PREFIX))] = value
        elif name.startswith(ENV_PREFIX) and name != ENV_URL:
            field = name.removeprefix(ENV_PREFIX).lower()
            if field not in _FIELDS:
                raise ConfigurationError(
                    f"environment variable {name} names no Kafka setting; known: "
                    + ", ".join(ENV_PREFIX + f.upper() for f in sorted(_FIELDS))
                )
            values[field] = value
    if passthrough:
        values["librdkafka"] = passthrough
