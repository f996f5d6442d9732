"""The Kafka backend's topics (events, snapshots, results, acks, workloads): created with the right configs,
checked at every open.

Durability settings are the cluster's unless the settings ask: a topic is
created with the broker's ``default.replication.factor`` (``replication_factor``
unset) and inherits the broker's ``min.insync.replicas`` (``min_insync_replicas``
unset). An asked ``min_insync_replicas`` only ever raises the topic's value: one
below the cluster's is not applied, and a warning names the value kept.

Every open (created or found) checks what the journal's guarantees rest on,
refusing with the exact setting where a commit could not work or would be
weaker than asked, warning where it is merely weak:

- refused: a missing topic (unless it may be created), a partition count other
  than ``partitions`` (the workloads topic: 1), a ``cleanup.policy`` other than ``delete``
  (events) / ``compact`` (snapshots, workloads), ``min.insync.replicas`` above the replication factor
  (every ``acks=all`` write would fail), fewer replicas than ``replication_factor``
  asks;
- warned: replication factor 1 on a cluster of several brokers, and
  ``min.insync.replicas=1`` with several replicas (an acknowledged commit may
  then live on one broker only).
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

from confluent_kafka import KafkaError, KafkaException
from confluent_kafka.admin import (
    AdminClient,
    AlterConfigOpType,
    ConfigEntry,
    ConfigResource,
    NewTopic,
    ResourceType,
)

from rollout_journal.journal.backend import summaries_partitions
from rollout_journal.journal.deadlines import Deadline
from rollout_journal.journal.errors import ClusterUnreachableError, ConfigurationError, JournalError
from rollout_journal.journal.kafka.access import CLUSTER, CLUSTER_TYPE, TOPIC, not_authorized, refusal
from rollout_journal.journal.kafka.config import KafkaSettings
from rollout_journal.journal.kafka.retry import Action, Role, classify

log = logging.getLogger(__name__)

BROKER_DEFAULT = -1  # NewTopic's replication factor: the broker's default.replication.factor
MIN_ISR = "min.insync.replicas"
CLIENT_MESSAGE_MAX_BYTES = 1_000_000  # librdkafka's default message.max.bytes
RECORD_FRAMING_BYTES = 8192  # room for the key, the record and batch framing, and compression's worst case
_UNREACHABLE_CODES = frozenset(
    {
        KafkaError._TIMED_OUT,
        KafkaError._TRANSPORT,
        KafkaError._ALL_BROKERS_DOWN,
        KafkaError.REQUEST_TIMED_OUT,
    }
)
_CONFIG_ERROR_CODES = frozenset(
    {
        KafkaError.INVALID_REPLICATION_FACTOR,
        KafkaError.INVALID_PARTITIONS,
        KafkaError.INVALID_CONFIG,
        KafkaError.POLICY_VIOLATION,
        KafkaError.TOPIC_AUTHORIZATION_FAILED,
        KafkaError.CLUSTER_AUTHORIZATION_FAILED,
        KafkaError.TOPIC_EXCEPTION,
        KafkaError.INVALID_REQUEST,
    }
)


@dataclass(frozen=True)
class TopicState:
    """What an open found out about one topic."""

    name: str
    partitions: int
    replicas: int  # the smallest replica count of any partition
    configs: dict[str, str]  # effective values, whatever their source

    @property
    def min_insync_replicas(self) -> int | None:
        value = self.configs.get(MIN_ISR)
        return None if value is None else int(value)

    @property
    def max_message_bytes(self) -> int | None:
        value = self.configs.get("max.message.bytes")
        return None if value is None else int(value)


def topic_partitions(settings: KafkaSettings, topic: str) -> int:
    """How many partitions ``topic`` has: the namespace's count, but one for the workloads topic
    (a worker follows it with one fetch stream, whatever the partition count) and one for every 8
    on the summaries topic (``summaries_partitions``)."""
    if topic == settings.workloads_topic:
        return 1
    if topic == settings.summaries_topic:
        return summaries_partitions(settings.partitions)
    return settings.partitions


def topic_configs(settings: KafkaSettings) -> dict[str, dict[str, str]]:
    """The configs the topics are created with (durability settings come from the cluster).
    The results topic keeps what the events topic keeps: a trainer may start late."""
    s = settings
    return {
        s.events_topic: {
            "cleanup.policy": "delete",
            "retention.ms": str(s.events_retention_ms),
        },
        s.results_topic: {
            "cleanup.policy": "delete",
            "retention.ms": str(s.events_retention_ms),
        },
        s.acks_topic: {  # applied by the owners; kept as long as the events, like the results they answer
            "cleanup.policy": "delete",
            "retention.ms": str(s.events_retention_ms),
        },
        s.snapshots_topic: {
            "cleanup.policy": "compact",
            "min.cleanable.dirty.ratio": str(s.snapshot_min_cleanable_dirty_ratio),
            "segment.ms": str(s.snapshot_segment_ms),
            "segment.bytes": str(s.snapshot_segment_bytes),
            "delete.retention.ms": str(s.snapshot_delete_retention_ms),
            "min.compaction.lag.ms": str(s.snapshot_min_compaction_lag_ms),
        },
        s.workloads_topic: {  # a few records, the newest registration per workload
            "cleanup.policy": "compact",
        },
        s.summaries_topic: {  # a listing reads it whole: kept near one record per rollout, as the snapshots
            "cleanup.policy": "compact",
            "min.cleanable.dirty.ratio": str(s.snapshot_min_cleanable_dirty_ratio),
            "segment.ms": str(s.snapshot_segment_ms),
            "segment.bytes": str(s.snapshot_segment_bytes),
            "delete.retention.ms": str(s.snapshot_delete_retention_ms),
        },
    }


def prepare_topics(admin: AdminClient, settings: KafkaSettings, *, create: bool) -> dict[str, TopicState]:
    """Create the topics if ``create`` (an existing one is fine), then check each; their states."""
    timeout_s = settings.operation_timeout_ms / 1000
    wanted = topic_configs(settings)
    if create:
        _create(admin, settings, wanted, timeout_s)
    else:
        if not topic_listed(admin, settings.summaries_topic, timeout_s, unsure=True):
            # Written before summaries: its listings fold every event.
            del wanted[settings.summaries_topic]
        if not topic_listed(admin, settings.results_topic, timeout_s, unsure=True):  # the describe below says why
            # A namespace written before results were published: its readers open it as it is.
            log.info("topic %s does not exist: this namespace publishes no results", settings.results_topic)
            del wanted[settings.results_topic]
        if not topic_listed(admin, settings.acks_topic, timeout_s, unsure=True):
            # Written before acknowledgements had a topic of their own: its readers open it as it is.
            del wanted[settings.acks_topic]
        if not topic_listed(admin, settings.workloads_topic, timeout_s, unsure=True):
            # Written before registrations had a topic of their own: they are on the snapshot topic.
            log.info(
                "topic %s does not exist: workload registrations are read from the snapshots", settings.workloads_topic
            )
            del wanted[settings.workloads_topic]
    brokers, states = _describe(admin, settings, wanted, timeout_s, just_created=create)
    for topic, state in states.items():
        states[topic] = _check(admin, settings, wanted[topic], state, brokers, timeout_s)
    return states


def record_limits(states: dict[str, TopicState], settings: KafkaSettings) -> tuple[int | None, int]:
    """(the topics' smallest ``max.message.bytes``, None if unknown; the largest record value the
    journal may write, which it chunks anything larger to fit): the topics' limit and the
    client's own, less room for framing."""
    topic_limits = [state.max_message_bytes for state in states.values() if state.max_message_bytes]
    client_limit = int(settings.librdkafka.get("message.max.bytes", CLIENT_MESSAGE_MAX_BYTES))
    return min(topic_limits, default=None), min([*topic_limits, client_limit]) - RECORD_FRAMING_BYTES


def _create(admin: AdminClient, settings: KafkaSettings, wanted: dict[str, dict[str, str]], timeout_s: float) -> None:
    s = settings
    replication = BROKER_DEFAULT if s.replication_factor is None else s.replication_factor
    asked = "the broker's default" if s.replication_factor is None else str(s.replication_factor)
    new = [
        NewTopic(topic, num_partitions=topic_partitions(s, topic), replication_factor=replication, config=cfg)
        for topic, cfg in wanted.items()
    ]
    for topic, future in admin.create_topics(new, operation_timeout=timeout_s, request_timeout=timeout_s).items():
        try:
            future.result()
            log.info(
                "created topic %s (%d partitions, replication factor %s)", topic, topic_partitions(s, topic), asked
            )
        except KafkaException as exc:
            err = exc.args[0] if exc.args and isinstance(exc.args[0], KafkaError) else None
            if err is not None and err.code() == KafkaError.TOPIC_ALREADY_EXISTS:
                continue
            denied = refusal(s, err, {TOPIC: ("CREATE", topic), CLUSTER_TYPE: ("CREATE", CLUSTER)})
            if denied is not None:
                # KRaft answers a refused CREATE so even for a topic that exists: a worker whose
                # operator created the topics needs no CREATE right
                if topic_listed(admin, topic, timeout_s, unsure=False):
                    continue
                raise denied from None
            detail = f"{err.name()}: {err.str()}" if err is not None else repr(exc)
            if err is not None and err.code() in _UNREACHABLE_CODES:
                raise ClusterUnreachableError(
                    f"cannot reach the Kafka cluster at {s.bootstrap_servers}: creating topic {topic} got no answer "
                    f"within {timeout_s:g} s ({detail}); is it running, and is the address right?"
                ) from exc
            cls = ConfigurationError if err is None or err.code() in _CONFIG_ERROR_CODES else JournalError
            raise cls(
                f"cannot create topic {topic} ({topic_partitions(s, topic)} partitions, replication factor {asked}) "
                f"on {s.bootstrap_servers}: {detail}"
            ) from exc


def topic_listed(admin: AdminClient, topic: str, timeout_s: float, *, unsure: bool) -> bool:
    """Whether the cluster lists ``topic``; ``unsure`` when it cannot say (no answer, or an error
    other than "unknown topic", such as a refused describe). Each caller decides what an
    unsure answer means: go on and let a later call name the problem, or stop here."""
    try:
        meta = admin.list_topics(topic=topic, timeout=timeout_s).topics.get(topic)
    except KafkaException:
        return unsure
    if meta is None or meta.error is None:
        return meta is not None
    return False if meta.error.code() == KafkaError.UNKNOWN_TOPIC_OR_PART else unsure


def _describe(
    admin: AdminClient,
    settings: KafkaSettings,
    wanted: dict[str, dict[str, str]],
    timeout_s: float,
    *,
    just_created: bool,
) -> tuple[int, dict[str, TopicState]]:
    """(brokers in the cluster, each topic's partitions, replicas and effective configs)."""
    deadline = Deadline(timeout_s)
    layout: dict[str, tuple[int, int]] = {}
    brokers = 0
    for topic in wanted:
        while True:  # a just-created topic takes a moment to appear with leaders in metadata
            try:
                metadata = admin.list_topics(topic=topic, timeout=timeout_s)
            except KafkaException as exc:
                err = exc.args[0] if exc.args and isinstance(exc.args[0], KafkaError) else None
                if err is not None and err.code() in _UNREACHABLE_CODES:
                    raise ClusterUnreachableError(
                        f"cannot reach the Kafka cluster at {settings.bootstrap_servers}: reading the metadata of "
                        f"topic {topic} got no answer within {timeout_s:g} s ({err.name()}); is it running, and is "
                        "the address right?"
                    ) from exc
                if classify(err, Role.ADMIN) is Action.RETRY and not deadline.passed():
                    deadline.sleep(0.1)  # a broker gone or a leader moving while the worker opens
                    continue
                raise JournalError(
                    f"cannot read metadata of topic {topic} from {settings.bootstrap_servers}: {exc}"
                ) from exc
            meta = metadata.topics.get(topic)
            brokers = len(metadata.brokers)
            missing = meta is None or (meta.error is not None and meta.error.code() == KafkaError.UNKNOWN_TOPIC_OR_PART)
            ready = (
                meta is not None
                and not missing
                and meta.error is None
                and all(p.leader >= 0 for p in meta.partitions.values())
            )
            if ready or (missing and not just_created) or deadline.passed():
                break
            deadline.sleep(0.1)
        if missing or meta is None:
            raise ConfigurationError(
                f"topic {topic} does not exist on {settings.bootstrap_servers}; "
                "open the backend with create_topics=True or create it with the configs of topic_configs()"
            )
        if meta.error is not None:
            denied = refusal(settings, meta.error, {TOPIC: ("DESCRIBE", topic)})
            if denied is not None:
                raise denied
            raise JournalError(f"topic {topic} metadata error: {meta.error.name()}: {meta.error.str()}")
        layout[topic] = (len(meta.partitions), min(len(p.replicas) for p in meta.partitions.values()))
    states = {}
    for topic in wanted:
        try:
            configs = _configs(admin, topic, timeout_s)
        except KafkaException as exc:  # no DESCRIBE_CONFIGS right: the config checks cannot run
            err = exc.args[0] if exc.args and isinstance(exc.args[0], KafkaError) else None
            denied = refusal(settings, err, {TOPIC: ("DESCRIBE_CONFIGS", topic)})
            log.warning(
                "cannot describe configs of topic %s (%s); its cleanup policy and min.insync.replicas go unchecked",
                topic,
                denied or exc,
            )
            configs = {}
        states[topic] = TopicState(topic, *layout[topic], configs)
    return brokers, states


def _configs(admin: AdminClient, topic: str, timeout_s: float) -> dict[str, str]:
    """A topic's effective configs. A broker other than the one that answered the metadata may
    not know a just-created topic (or a just-altered config) yet: retried until the timeout."""
    deadline = Deadline(timeout_s)
    resource = ConfigResource(ResourceType.TOPIC, topic)
    while True:
        try:
            entries = admin.describe_configs([resource], request_timeout=timeout_s)[resource].result()
            return {name: entry.value for name, entry in entries.items() if entry.value is not None}
        except KafkaException as exc:
            err = exc.args[0] if exc.args and isinstance(exc.args[0], KafkaError) else None
            if classify(err, Role.ADMIN) is not Action.RETRY or deadline.passed():
                raise
            deadline.sleep(0.1)


def _check(
    admin: AdminClient,
    settings: KafkaSettings,
    wanted: dict[str, str],
    state: TopicState,
    brokers: int,
    timeout_s: float,
) -> TopicState:
    topic, s = state.name, settings
    if topic == s.workloads_topic and state.partitions != 1:
        raise ConfigurationError(
            f"topic {topic} has {state.partitions} partitions; it must have 1 (workers follow every "
            "registration on partition 0): delete it; the next submit creates it again and copies every "
            "registration from the snapshot topic, which keeps them too"
        )
    if topic != s.workloads_topic and state.partitions != topic_partitions(s, topic):
        raise ConfigurationError(
            f"topic {topic} has {state.partitions} partitions but settings.partitions is {s.partitions}, "
            f"so it must have {topic_partitions(s, topic)}: records are placed by partition_for(key, partitions)"
        )
    policy, expected = state.configs.get("cleanup.policy"), wanted["cleanup.policy"]
    if policy is not None and set(policy.split(",")) != {expected}:
        raise ConfigurationError(
            f"topic {topic} has cleanup.policy={policy}, expected {expected} "
            "(events must never be compacted, snapshots and workloads must be compacted and never expire)"
        )
    if s.replication_factor is not None and state.replicas < s.replication_factor:
        raise ConfigurationError(
            f"topic {topic} has replication factor {state.replicas} but replication_factor={s.replication_factor} "
            "is asked; reassign its partitions to more brokers, or use a new namespace"
        )
    state = _raise_min_isr(admin, s, state, timeout_s)
    min_isr = state.min_insync_replicas
    if min_isr is not None and min_isr > state.replicas:
        raise ConfigurationError(
            f"topic {topic} has {MIN_ISR}={min_isr} but replication factor {state.replicas}: every acks=all "
            f"commit would fail with NOT_ENOUGH_REPLICAS; set {MIN_ISR} of the topic to at most {state.replicas}"
        )
    if state.replicas == 1 and brokers > 1:
        log.warning(
            "topic %s has replication factor 1 on a cluster of %d brokers: losing one broker loses "
            "journal records; ask for replication_factor=3",
            topic,
            brokers,
        )
    elif min_isr == 1 and state.replicas > 1:
        log.warning(
            "topic %s has %s=1 (replication factor %d): a commit is acknowledged once one broker has it; "
            "set %s=2 on the topic, or ask for min_insync_replicas=2",
            topic,
            MIN_ISR,
            state.replicas,
            MIN_ISR,
        )
    return state


def _raise_min_isr(admin: AdminClient, settings: KafkaSettings, state: TopicState, timeout_s: float) -> TopicState:
    """Apply an asked ``min_insync_replicas`` that is above the topic's; never lower it."""
    asked, current = settings.min_insync_replicas, state.min_insync_replicas
    if asked is None or current is None or asked == current:
        return state
    if asked < current:
        log.warning(
            "topic %s keeps %s=%d although min_insync_replicas=%d is asked: rollout-journal never lowers "
            "it below the cluster's",
            state.name,
            MIN_ISR,
            current,
            asked,
        )
        return state
    if asked > state.replicas:
        raise ConfigurationError(
            f"min_insync_replicas={asked} is asked but topic {state.name} has replication factor {state.replicas}: "
            "every acks=all commit would fail"
        )
    resource = ConfigResource(
        ResourceType.TOPIC,
        state.name,
        incremental_configs=[ConfigEntry(MIN_ISR, str(asked), incremental_operation=AlterConfigOpType.SET)],
    )
    try:
        admin.incremental_alter_configs([resource], request_timeout=timeout_s)[resource].result()
    except KafkaException as exc:
        err = exc.args[0] if exc.args and isinstance(exc.args[0], KafkaError) else None
        if err is not None and err.code() == KafkaError.TOPIC_AUTHORIZATION_FAILED:
            raise not_authorized(settings, "ALTER_CONFIGS", TOPIC, state.name) from None
        raise ConfigurationError(
            f"cannot raise {MIN_ISR} of topic {state.name} from {current} to the asked "
            f"{asked}: {exc}; raise it on the topic yourself"
        ) from exc
    deadline = Deadline(timeout_s)
    while _configs(admin, state.name, timeout_s).get(MIN_ISR) != str(asked):  # in effect on every broker we ask
        if deadline.passed():
            raise ConfigurationError(
                f"{MIN_ISR} of topic {state.name} was set to {asked} but the cluster still "
                f"reports another value after {timeout_s:.0f} s"
            )
        deadline.sleep(0.1)
    log.info("raised %s of topic %s from %d to the asked %d", MIN_ISR, state.name, current, asked)
    return TopicState(state.name, state.partitions, state.replicas, {**state.configs, MIN_ISR: str(asked)})
