"""The workload a user writes (YAML or flags): what to roll out, with which
model, journaled where. Validated with pydantic so a typo is named at once.

Everything a workload names is checked here, where it enters, before anything
is built or created: a name the journal can key, environments that exist, a
journal location that can be written (a directory that is or can be made, or a
well-formed ``kafka://`` URL)."""

from __future__ import annotations

import difflib
import hashlib
import json
import os
from pathlib import Path
from typing import Any, Literal
from urllib.parse import urlsplit

import yaml
from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    ValidationError,
    field_validator,
    model_validator,
)

from rollout_journal.journal.errors import ConfigurationError
from rollout_journal.journal.open import is_kafka_url
from rollout_journal.journal.snapshots import BLOCK_BYTES, LEGACY_WORKLOAD_PREFIX, MIN_BLOCK_BYTES
from rollout_journal.participants.model.folders import BUILDER_VERSION


class ModelConfig(BaseModel):
    """The policy and where it runs. Every backend loads a model folder in the standard
    Hugging Face layout (``path``; by default the embedded tiny Llama built for
    ``weights_seed``) and builds prompts with that folder's chat template."""

    model_config = ConfigDict(extra="forbid")

    backend: Literal["torch", "vllm", "openai"] = Field(
        "torch",
        description="torch: transformers on CPU in this process; vllm: vLLM's engine in this process; "
        "openai: any OpenAI-compatible server (vLLM's api_server) at `url`",
    )
    path: str | None = Field(
        None,
        description="a Hugging Face model folder (config.json, weights, tokenizer.json, "
        "chat template); unset: the embedded tiny Llama",
    )
    weights_seed: int = Field(0, description="seed of the embedded model's weights (ignored with `path`)")
    url: str | None = Field(None, description="openai backend: the server's base URL, e.g. http://127.0.0.1:8000/v1")
    served_model: str | None = Field(
        None, description="openai backend: the model name the server serves (unset: the first one /v1/models lists)"
    )
    temperature: float = Field(1.0, ge=0.0)
    top_p: float = Field(1.0, gt=0.0, le=1.0)
    top_k: int = Field(-1, ge=-1, description="keep the k most likely tokens before top_p (-1: off)")
    max_tokens: int = Field(48, ge=1)
    reasoning_tokens: int = Field(
        0,
        ge=0,
        description="each turn first generates a free-form reasoning segment of "
        "up to this many tokens, then the tool call (0: no segment)",
    )
    max_concurrent_calls: int = Field(8, ge=1, description="admission gate: model calls in flight at once")
    torch_threads: int = Field(
        1,
        ge=1,
        description="intra-op threads for the torch backend: the tiny model is "
        "latency-bound, one thread leaves the other cores to the journal",
    )
    dtype: str = Field(
        "float32",
        description="vllm backend: the weights' dtype (float32 on CPU: bit-exact with "
        "the torch backend's arithmetic; auto/bfloat16 on a GPU)",
    )
    max_model_len: int = Field(2048, ge=16, description="vllm backend: the engine's context length")
    kv_cache_gib: float = Field(1.0, gt=0.0, description="vllm backend on CPU: KV cache size (VLLM_CPU_KVCACHE_SPACE)")
    request_timeout_s: float = Field(300.0, gt=0.0, description="openai backend: one request's time limit")
    history_policy: Literal["keep_sampled", "new_sequence", "fail"] = Field(
        "keep_sampled",
        description="a chat template that renders earlier turns differently once messages are added "
        "(Qwen3 dropping past reasoning): keep_sampled keeps the sampled ids and splices the new "
        "messages at end-of-turn tokens; new_sequence starts a new token sequence (the training "
        "record holds two); fail stops the rollout",
    )
    server_logprobs: Literal["processed", "accept_raw"] = Field(
        "processed",
        description="openai backend: processed refuses a server that reports raw logprobs (start vLLM "
        "with --logprobs-mode processed_logprobs); accept_raw journals them marked raw",
    )

    @field_validator("top_k")
    @classmethod
    def _top_k_not_zero(cls, value: int) -> int:
        if value == 0:
            raise ValueError("top_k 0 keeps no token; use -1 to turn top-k off")
        return value

    @field_validator("path")
    @classmethod
    def _model_folder_exists(cls, value: str | None) -> str | None:
        if value is not None and not (Path(value).expanduser() / "config.json").is_file():
            raise ValueError(
                f"model folder {value!r} has no config.json; point model.path at a Hugging Face "
                "model folder (config.json, weights, tokenizer.json, a chat template)"
            )
        return value

    @model_validator(mode="after")
    def _backend_settings(self) -> ModelConfig:
        if self.backend == "openai" and not self.url:
            raise ValueError(
                "model.backend openai needs model.url (the server's base URL, e.g. http://127.0.0.1:8000/v1)"
            )
        return self


class FailurePolicy(BaseModel):
    """What happens when a rollout fails on its infrastructure (a sandbox that died, a resource
    server lost for good, an environment's bug): never the policy's own mistakes, which the
    environment answers as observations. Not part of the topology: it decides what happens
    between attempts, never what one attempt samples."""

    model_config = ConfigDict(extra="forbid")

    max_failures: int = Field(
        3,
        ge=1,
        description="infrastructure failures (RolloutFailed) one rollout may have, over all its attempts; "
        "each one below it is retried at once as a new attempt (from the last committed turn, or turn 0 "
        "for a restart-only environment), the one that reaches it gives the rollout up (RolloutGivenUp)",
    )
    group: Literal["drop", "redispatch"] = Field(
        "drop",
        description="a prompt group with a given-up sibling: drop (the trainer feed drops the whole group and "
        "moves on) or redispatch (dropped too, and the workload runs a replacement group on the same task, "
        "<group>r<k>, with new samples)",
    )
    max_redispatches: int = Field(
        1,
        ge=1,
        description="redispatch: replacement groups per prompt group; a replacement given up past it is dropped",
    )


TOPOLOGY_FIELDS = frozenset({"environment", "seed", "model", "max_turns"})
# Settings that change what a rollout does, fingerprinted only when not at their default
# (so the journals written before they existed keep their fingerprint): setting -> default.
_OPTIONAL_TOPOLOGY: dict[str, object] = {"tasks": None, "constrained_actions": True}
# Model settings added later, fingerprinted only when not at their default: setting -> default.
_OPTIONAL_MODEL_TOPOLOGY: dict[str, object] = {
    "top_k": -1,
    "history_policy": "keep_sampled",
    "server_logprobs": "processed",
}
# Model settings that say where and how fast the policy runs, not what it samples.
DEPLOYMENT_FIELDS = frozenset(
    {
        "url",
        "served_model",
        "max_concurrent_calls",
        "torch_threads",
        "max_model_len",
        "kv_cache_gib",
        "request_timeout_s",
    }
)
EMBEDDED_MODEL = BUILDER_VERSION  # the embedded model's identity, in a topology fingerprint


def topology_settings(dump: dict[str, Any]) -> dict[str, Any]:
    """The settings of a config dump that determine a rollout's behaviour: the topology
    fields, without the model's deployment settings, naming the embedded model when no
    ``model.path`` is given (a resume after the embedded model changed is a topology change)."""
    out = {k: v for k, v in dump.items() if k in TOPOLOGY_FIELDS}
    model = out.get("model")
    if isinstance(model, dict):
        model = {
            k: v
            for k, v in model.items()
            if k not in DEPLOYMENT_FIELDS and not (k in _OPTIONAL_MODEL_TOPOLOGY and v == _OPTIONAL_MODEL_TOPOLOGY[k])
        }
        if model.get("path") is None:
            model["embedded"] = EMBEDDED_MODEL
        out["model"] = model
    return out


class TopologyChangedError(ConfigurationError):
    """A resume whose model, sampling, environment or ``max_turns`` differ from what the
    journal's rollouts ran with: continuing would mix two policies inside one rollout."""


def name_problem(name: str) -> str | None:
    """Why ``name`` cannot name a workload (or a rollout: ids are ``<workload>-g<G>-s<S>``), or None.

    The journal keys its own records ``<rollout>/fence``, ``<workload>/workload`` and
    ``<rollout>/blob/...``: a name holding ``/`` would be read as one of those and never
    get a usable snapshot. Whitespace would break ``--progress-lines`` and ``show``'s
    arguments; ``workload:`` prefixed 0.1.0's registration keys."""
    if not name:
        return "is empty"
    if "/" in name:
        return "contains '/', which the journal reserves for its internal keys; use '-', '_' or '.' instead"
    if any(ch.isspace() or not ch.isprintable() for ch in name):
        return "contains whitespace or a control character"
    if name.startswith(LEGACY_WORKLOAD_PREFIX):
        return f"starts with {LEGACY_WORKLOAD_PREFIX!r}, which the journal reserves"
    return None


def check_journal_location(location: str) -> str:
    """``location`` if a workload can journal there, else ``ConfigurationError`` naming why.

    Only checks (nothing is created): a ``kafka://`` URL must parse (host, numeric port,
    namespace, settings); a directory must be one, or be creatable, and be writable."""
    if not location.strip():
        raise ConfigurationError("journal location is empty: name a directory or kafka://host:port/namespace")
    if is_kafka_url(location):
        from rollout_journal.journal.kafka.config import (
            KafkaSettings,  # pydantic only; no broker client
        )

        KafkaSettings.from_url(location)
        return location
    if "://" in location:
        raise ConfigurationError(
            f"journal location {location!r}: unknown scheme; use a directory path or kafka://host:port/namespace"
        )
    path = Path(location)
    existing = path
    while not existing.exists() and existing != existing.parent:  # the nearest part that exists
        if existing.is_symlink():
            raise ConfigurationError(f"journal {location}: {existing} is a dangling symbolic link")
        existing = existing.parent
    if not existing.is_dir():
        raise ConfigurationError(
            f"journal {location}: {existing} is not a directory; "
            "a file journal is a directory (or kafka://host:port/namespace)"
        )
    if not os.access(existing, os.W_OK | os.X_OK):
        what = "journal directory" if existing == path else "directory"
        raise ConfigurationError(f"journal {location}: the {what} {existing} is not writable")
    return location


class WorkloadConfig(BaseModel):
    model_config = ConfigDict(extra="forbid")

    name: str = "demo"
    groups: int = Field(3, ge=1, description="prompt groups (one task each)")
    siblings: int = Field(3, ge=1, description="rollouts per group (same task, different samples)")
    max_turns: int = Field(5, ge=1)
    environment: str = Field(
        "workplace", description="environment name, or names separated by commas (assigned to groups in turn)"
    )
    seed: int = 0
    model: ModelConfig = ModelConfig()
    journal: str = Field("runs/journal", description="a directory (file journal) or kafka://host:port/namespace")
    writer: str = Field("worker-0", description="stable worker slot name (Kafka transactional.id)")
    snapshot_every_turns: int = Field(4, ge=1)
    snapshot_max_bytes: int = Field(256 * 1024, ge=1, description="also snapshot once this many event bytes accrued")
    concurrency: int = Field(64, ge=1, description="rollouts in flight at once")
    journal_linger_ms: float = Field(
        50.0,
        ge=0.0,
        description="how long a commit waits for more turns when no "
        "agent waits for it yet (an agent that waits makes it commit at once)",
    )
    snapshot_block_bytes: int = Field(
        BLOCK_BYTES,
        ge=0,
        description="a snapshot's growing sections (the head of tokens, the conversation) are written in "
        "blocks of this size, each once, so snapshot bytes grow with a rollout's turns, not their square; "
        f"0 writes none (a version before blocks restores every snapshot); else at least {MIN_BLOCK_BYTES}",
    )

    @field_validator("snapshot_block_bytes")
    @classmethod
    def _blocks_worth_their_keys(cls, value: int) -> int:
        if 0 < value < MIN_BLOCK_BYTES:
            raise ValueError(f"blocks under {MIN_BLOCK_BYTES} bytes cost more in keys than they save; use 0 for none")
        return value

    turns_in_flight: int = Field(
        2,
        ge=1,
        description="a rollout's turns appended but not yet known durable: turn "
        "t+N starts once turn t is durable (1 = no pipelining)",
    )
    turn_delay_ms: float = Field(0.0, ge=0.0, description="simulated environment latency per turn")
    journaling: bool = Field(True, description="off only to measure journaling overhead")
    checkpoint_mode: Literal["snapshot", "coordinated"] = Field(
        "snapshot",
        description="snapshot: ride along with turn commits, never pause; coordinated: periodic "
        "stop-the-world checkpoints that export resource state living outside the journal",
    )
    coordinated_every_s: float = Field(1.0, gt=0.0)
    prepare_timeout_s: float = Field(2.0, gt=0.0, description="coordinated mode: skip a rollout not parked in time")
    allow_early_submit: bool = Field(True, description="let the model end a rollout before max_turns with submit()")
    progress_every_tokens: int = Field(
        32,
        ge=0,
        description="journal a free-form model call's progress every this "
        "many tokens, so a crash in the middle of a long generation continues it "
        "from there (0: off)",
    )
    progress_min_interval_ms: float = Field(
        50.0,
        ge=0.0,
        allow_inf_nan=False,
        description="no progress mark sooner than this many milliseconds after the call's last one: a mark costs "
        "the same whatever it covers, and what a crash loses is generation time; a fast model (a small "
        "one, a GPU) is marked by time, a slow one every progress_every_tokens (0: every "
        "progress_every_tokens exactly)",
    )
    durable_model_calls: Literal["auto", "always", "never"] = Field(
        "auto",
        description="journal each model call before its tool call, so a redone turn replays the journaled "
        "call instead of sampling another action under the same idempotency keys; auto: when the "
        "backend is not bit-deterministic (a remote server)",
    )
    # -- your own environments and tasks, and where resources run --------------------------------
    tasks: str | None = Field(
        None,
        description='a JSONL dataset of tasks ({"prompt": ..., "task": {...}} per '
        "line); group g takes row g mod N. Unset: tasks drawn from the seed",
    )
    constrained_actions: bool = Field(
        True,
        description="decode only tool calls of the environment's action list; "
        "false: the model answers freely (a JSON tool call is parsed, "
        "anything unusable becomes an observation)",
    )
    resource_servers: dict[str, str] = Field(
        default_factory=dict,
        description="environment name -> base URL of the "
        "resource server hosting it (rollout-journal serve-resources); the "
        "others run in process. The token comes from "
        "ROLLOUT_JOURNAL_RESOURCE_TOKEN",
    )
    resource_timeout_s: float = Field(30.0, gt=0.0, description="one request to a resource server")
    resource_server_wait_s: float = Field(
        60.0, gt=0.0, description="how long a rollout waits for a resource server that went away before it fails"
    )
    failure_policy: FailurePolicy = Field(
        default_factory=FailurePolicy,
        description="retries of infrastructure failures, giving a rollout up, and what the trainer does with "
        "the group of a given-up rollout",
    )

    @field_validator("name")
    @classmethod
    def _name_is_a_key(cls, value: str) -> str:
        problem = name_problem(value)
        if problem:
            raise ValueError(f"workload name {value!r} {problem}")
        return value

    @field_validator("writer")
    @classmethod
    def _writer_not_blank(cls, value: str) -> str:
        if not value.strip():
            raise ValueError("writer must not be blank: it names this worker's slot")
        return value

    @field_validator("environment")
    @classmethod
    def _environments_exist(cls, value: str) -> str:
        from rollout_journal.participants.environments import environment_class

        names = _split_names(value)
        if not names:
            raise ValueError(f"environment {value!r} names no environment")
        try:
            for name in names:
                environment_class(name)
        except LookupError as exc:
            raise ValueError(str(exc)) from None
        return value

    @field_validator("tasks")
    @classmethod
    def _tasks_readable(cls, value: str | None) -> str | None:
        if value is not None:
            from rollout_journal.participants.environments.tasks import load_tasks

            try:
                load_tasks(value)
            except ConfigurationError as exc:
                raise ValueError(str(exc)) from None
        return value

    @model_validator(mode="after")
    def _servers_name_environments(self) -> WorkloadConfig:
        for name, url in self.resource_servers.items():
            if name not in self.environments:
                raise ValueError(
                    f"resource_servers names environment {name!r}, which the workload does not run "
                    f"(environment: {self.environment})"
                )
            parsed = urlsplit(url)
            if parsed.scheme not in ("http", "https") or not parsed.hostname:
                raise ValueError(f"resource_servers[{name!r}] = {url!r} is no http(s)://host:port URL")
            try:
                _ = parsed.port  # raises ValueError for a port that is no number
            except ValueError:
                raise ValueError(f"resource_servers[{name!r}] = {url!r}: the port is no number") from None
        return self

    @field_validator("journal")
    @classmethod
    def _journal_usable(cls, value: str) -> str:
        try:
            return check_journal_location(value)
        except ConfigurationError as exc:  # a ValueError joins pydantic's report of every bad setting
            raise ValueError(str(exc)) from None

    @classmethod
    def load(cls, path: str | Path, **overrides: object) -> WorkloadConfig:
        """Read and validate a workload YAML; ``overrides`` (None: not given) win over the file.
        Any problem is a ``ConfigurationError`` of one line naming the file and the setting."""
        try:
            raw = yaml.safe_load(Path(path).read_text())
        except FileNotFoundError:
            raise ConfigurationError(f"workload config {path} does not exist") from None
        except (OSError, UnicodeDecodeError) as exc:
            raise ConfigurationError(f"workload config {path} cannot be read: {_reason(exc)}") from None
        except yaml.YAMLError as exc:
            raise ConfigurationError(f"workload config {path} is not valid YAML: {_yaml_problem(exc)}") from None
        if raw is None:
            raise ConfigurationError(
                f"workload config {path} is empty; write the workload's settings in it (see examples/demo.yaml)"
            )
        if not isinstance(raw, dict):
            raise ConfigurationError(
                f"workload config {path} must be a mapping of settings (name: demo, ...), not a {type(raw).__name__}"
            )
        raw.update({k: v for k, v in overrides.items() if v is not None})
        try:
            return cls.model_validate(raw)
        except ValidationError as exc:
            raise ConfigurationError(f"workload config {path}: {validation_problems(exc)}") from None

    @property
    def environments(self) -> list[str]:
        return _split_names(self.environment)

    def topology(self) -> str:
        """Fingerprint of what determines a rollout's behaviour (not where it is journaled)."""
        fields = topology_settings(self.model_dump(include=set(TOPOLOGY_FIELDS)))
        # Newer settings join the fingerprint only when set, so journals written before them resume.
        if self.tasks is not None:
            from rollout_journal.participants.environments.tasks import tasks_digest

            fields["tasks"] = tasks_digest(self.tasks)
        if not self.constrained_actions:
            fields["constrained_actions"] = False
        return hashlib.sha256(repr(sorted(fields.items())).encode()).hexdigest()[:16]

    def topology_diff(self, recorded_spec_json: str) -> list[str]:
        """The settings behind :meth:`topology` that differ from a recorded config (a workload
        registration's ``spec_json``), as ``model.weights_seed 0 -> 1``; empty if none can be told."""
        try:
            recorded = json.loads(recorded_spec_json)
        except ValueError:
            return []
        if not isinstance(recorded, dict):
            return []

        def behaviour(
            settings: dict[str, Any],
        ) -> dict[str, object]:  # the newer settings count only when set, as in topology()
            kept = topology_settings(settings)
            kept.update(
                {
                    k: settings[k]
                    for k, default in _OPTIONAL_TOPOLOGY.items()
                    if k in settings and settings[k] != default
                }
            )
            return _flatten(kept)

        old = behaviour(recorded)
        new = behaviour(self.model_dump(mode="json"))
        unset = "(unset)"
        return [
            f"{key} {json.dumps(old.get(key, unset))} -> {json.dumps(new.get(key, unset))}"
            for key in sorted(old.keys() | new.keys())
            if old.get(key, unset) != new.get(key, unset)
        ]

    def settings_diff(self, recorded_spec_json: str, ignore: tuple[str, ...] = ("journal", "writer")) -> list[str]:
        """Every setting (topology or not, ``ignore`` left out) that differs from a recorded config,
        as ``turn_delay_ms 800.0 -> 100.0``; empty when they agree or the record cannot be read."""
        try:
            recorded = json.loads(recorded_spec_json)
        except ValueError:
            return []
        if not isinstance(recorded, dict):
            return []
        old = {k: v for k, v in _flatten(recorded).items() if k.split(".")[0] not in ignore}
        new = {k: v for k, v in _flatten(self.model_dump(mode="json")).items() if k.split(".")[0] not in ignore}
        unset = "(unset)"
        return [
            f"{key} {json.dumps(old.get(key, unset))} -> {json.dumps(new.get(key, unset))}"
            for key in sorted(old.keys() | new.keys())
            if old.get(key, unset) != new.get(key, unset) and key in old  # a newer version's new field is no change
        ]


def _flatten(settings: dict[str, Any], prefix: str = "") -> dict[str, object]:
    out: dict[str, object] = {}
    for key, value in settings.items():
        if isinstance(value, dict):
            out.update(_flatten(value, f"{prefix}{key}."))
        else:
            out[f"{prefix}{key}"] = value
    return out


def _split_names(value: str) -> list[str]:
    return [name.strip() for name in value.split(",") if name.strip()]


def validation_problems(exc: ValidationError) -> str:
    """A pydantic error report as one line: ``setting 'model.max_tokens': <why> (got 0); ...``."""
    problems = []
    for error in exc.errors():
        where = ".".join(str(part) for part in error["loc"]) or "settings"
        message = error["msg"].removeprefix("Value error, ")
        if error["type"] == "extra_forbidden":  # a typo: name the setting meant
            message = "no such setting" + _did_you_mean(exc.title, error["loc"])
        got = "" if error["type"] == "value_error" else f" (got {json.dumps(error.get('input'), default=repr)[:60]})"
        problems.append(f"setting {where!r}: {message}{got}")
    return "; ".join(problems)


def _did_you_mean(title: str, loc: tuple[int | str, ...]) -> str:
    """``; did you mean 'temperature'?`` for an unknown setting at ``loc`` of the model named ``title``."""
    models: dict[str, type[BaseModel]] = {"WorkloadConfig": WorkloadConfig, "ModelConfig": ModelConfig}
    model = models.get(title)
    for part in loc[:-1]:
        field = model.model_fields.get(str(part)) if model is not None else None
        inner = field.annotation if field is not None else None
        if not (isinstance(inner, type) and issubclass(inner, BaseModel)):
            return ""
        model = inner
    if model is None:
        return ""
    close = difflib.get_close_matches(str(loc[-1]), list(model.model_fields), n=1, cutoff=0.6)
    return f"; did you mean {close[0]!r}?" if close else f" (the settings here: {', '.join(model.model_fields)})"


def _yaml_problem(exc: yaml.YAMLError) -> str:
    mark = getattr(exc, "problem_mark", None)
    problem = getattr(exc, "problem", None) or str(exc).splitlines()[0]
    return f"{problem} at line {mark.line + 1}, column {mark.column + 1}" if mark is not None else problem


def _reason(exc: BaseException) -> str:
    return exc.strerror if isinstance(exc, OSError) and exc.strerror else str(exc)
