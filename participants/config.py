"""The workload a user writes (YAML or flags): what to roll out, with which
model, journaled where. Validated with pydantic so a typo is named at once."""

from __future__ import annotations

import hashlib
from pathlib import Path
from typing import Literal

import yaml
from pydantic import BaseModel, ConfigDict, Field, ValidationError

from journal.errors import ConfigurationError


class ModelConfig(BaseModel):
    model_config = ConfigDict(extra="forbid")

    backend: Literal["torch"] = "torch"
    weights_seed: int = 0
    temperature: float = Field(1.0, ge=0.0)
    top_p: float = Field(1.0, gt=0.0, le=1.0)
    max_tokens: int = Field(48, ge=1)
    max_concurrent_calls: int = Field(8, ge=1, description="admission gate: model calls in flight at once")
    torch_threads: int = Field(1, ge=1, description="intra-op threads for the torch policy: the tiny model is "
                                                   "latency-bound, one thread leaves the other cores to the journal")


class WorkloadConfig(BaseModel):
    model_config = ConfigDict(extra="forbid")

    name: str = "demo"
    groups: int = Field(3, ge=1, description="prompt groups (one task each)")
    siblings: int = Field(3, ge=1, description="rollouts per group (same task, different samples)")
    max_turns: int = Field(5, ge=1)
    environment: str = Field("workplace", description="environment name, or names separated by commas (assigned to groups in turn)")
    seed: int = 0
    model: ModelConfig = ModelConfig()
    journal: str = Field("runs/journal", description="a directory (file journal) or kafka://host:port/namespace")
    writer: str = Field("worker-0", description="stable worker slot name (Kafka transactional.id)")
    snapshot_every_turns: int = Field(4, ge=1)
    snapshot_max_bytes: int = Field(256 * 1024, ge=1, description="also snapshot once this many event bytes accrued")
    concurrency: int = Field(64, ge=1, description="rollouts in flight at once")
    journal_linger_ms: float = Field(50.0, ge=0.0, description="how long a commit waits for more turns when no "
                                     "agent waits for it yet (an agent that waits makes it commit at once)")
    turns_in_flight: int = Field(2, ge=1, description="a rollout's turns appended but not yet known durable: turn "
                                                      "t+N starts once turn t is durable (1 = no pipelining)")
    turn_delay_ms: float = Field(0.0, ge=0.0, description="simulated environment latency per turn")
    journaling: bool = Field(True, description="off only to measure journaling overhead")
    checkpoint_mode: Literal["snapshot", "coordinated"] = Field(
        "snapshot", description="snapshot: ride along with turn commits, never pause; coordinated: periodic "
                                "stop-the-world checkpoints that export resource state living outside the journal")
    coordinated_every_s: float = Field(1.0, gt=0.0)
    prepare_timeout_s: float = Field(2.0, gt=0.0, description="coordinated mode: skip a rollout not parked in time")
    allow_early_submit: bool = Field(True, description="let the model end a rollout before max_turns with submit()")

    @classmethod
    def load(cls, path: str | Path, **overrides: object) -> "WorkloadConfig":
        try:
            raw = yaml.safe_load(Path(path).read_text()) or {}
        except FileNotFoundError:
            raise ConfigurationError(f"workload config {path} does not exist") from None
        except yaml.YAMLError as exc:
            raise ConfigurationError(f"workload config {path} is not valid YAML: {exc}") from None
        raw.update({k: v for k, v in overrides.items() if v is not None})
        try:
            return cls.model_validate(raw)
        except ValidationError as exc:
            raise ConfigurationError(f"workload config {path}: {exc}") from None

    @property
    def environments(self) -> list[str]:
        return [name.strip() for name in self.environment.split(",") if name.strip()]

    def topology(self) -> str:
        """Fingerprint of what determines a rollout's behaviour (not where it is journaled)."""
        fields = self.model_dump(include={"environment", "seed", "model", "max_turns"})
        return hashlib.sha256(repr(sorted(fields.items())).encode()).hexdigest()[:16]
