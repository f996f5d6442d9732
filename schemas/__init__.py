"""Avro schemas of every journal record, every released version kept.

Files are named ``<Record>.v<N>.avsc``; the highest N is the reader schema.
Named types shared by records live in ``types/`` and are frozen once released:
changing one means adding a new named type, never editing the old file, so
that every kept writer schema keeps its fingerprint.

A record file refers to a shared type by name only. What a peer decodes with,
and what the fingerprint is taken of, is the record's *self-contained* schema:
each named type written out in full at its first use, as the Avro
specification defines the Parsing Canonical Form. That makes the fingerprint
the one every Avro implementation computes (Java's
``SchemaNormalization.parsingFingerprint64``), so their single-object decoders
read the journal.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from functools import cache
from pathlib import Path
from typing import Any

from fastavro import parse_schema
from fastavro.schema import fingerprint, to_parsing_canonical_form

from rollout_journal.schemas import legacy

SCHEMA_DIR = Path(__file__).parent
_FILE_NAME = re.compile(r"^(?P<name>[A-Za-z]+)\.v(?P<version>\d+)\.avsc$")
_PRIMITIVES = frozenset({"null", "boolean", "int", "long", "float", "double", "bytes", "string"})

__all__ = [
    "SCHEMA_DIR",
    "SchemaVersion",
    "current",
    "released_versions",
    "self_contained",
    "shared_types",
    "standard_fingerprint",
]


@dataclass(frozen=True)
class SchemaVersion:
    """One released writer schema of a record type."""

    record: str
    version: int
    schema_json: str  # self-contained: every named type written out at its first use; hand it to any Avro peer
    parsed: dict[str, Any]
    fingerprint: bytes  # CRC-64-AVRO of the Parsing Canonical Form, little-endian as in single-object encoding
    legacy_fingerprint: bytes | None  # what rollout-journal 0.1.0 wrote for this version (None: released later)
    path: Path


def _full_name(name: str, namespace: str | None) -> str:
    return name if "." in name or not namespace else f"{namespace}.{name}"


def shared_types() -> dict[str, dict[str, Any]]:
    """The shared named types of ``types/``, by full name, as written in their files."""
    types: dict[str, dict[str, Any]] = {}
    for path in sorted((SCHEMA_DIR / "types").glob("*.avsc")):
        schema = json.loads(path.read_text())
        types[_full_name(schema["name"], schema.get("namespace"))] = schema
    return types


def self_contained(
    schema: Any, types: dict[str, dict[str, Any]], namespace: str | None = None, defined: set[str] | None = None
) -> Any:
    """``schema`` (JSON) with each reference to a type of ``types`` replaced by its
    definition at the first use; later uses stay names, as the spec requires.

    Everything else (docs, defaults, logical types) is kept as written, so the
    result is the schema itself, not just its canonical form.
    """
    defined = set() if defined is None else defined
    if isinstance(schema, list):
        return [self_contained(s, types, namespace, defined) for s in schema]
    if isinstance(schema, str):
        if schema in _PRIMITIVES:
            return schema
        name = _full_name(schema, namespace)
        if name in defined or name not in types:
            return schema  # a later use, or a name parse_schema will reject with its own message
        return self_contained(types[name], types, namespace, defined)
    kind = schema["type"]
    if kind in ("record", "error", "enum", "fixed"):
        name = _full_name(schema["name"], schema.get("namespace", namespace))
        defined.add(name)
        inner = name.rpartition(".")[0] or None
        if kind in ("enum", "fixed"):
            return schema
        fields = [{**f, "type": self_contained(f["type"], types, inner, defined)} for f in schema["fields"]]
        return {**schema, "fields": fields}
    if kind == "array":
        return {**schema, "items": self_contained(schema["items"], types, namespace, defined)}
    if kind == "map":
        return {**schema, "values": self_contained(schema["values"], types, namespace, defined)}
    return {**schema, "type": self_contained(kind, types, namespace, defined)}


def standard_fingerprint(schema_json: str) -> bytes:
    """CRC-64-AVRO of the Parsing Canonical Form of a self-contained schema, in
    wire order (little-endian, as Avro Java writes it after ``C3 01``)."""
    canonical = to_parsing_canonical_form(parse_schema(json.loads(schema_json)))
    return bytes.fromhex(fingerprint(canonical, "CRC-64-AVRO"))  # fastavro prints it in wire order


@cache
def released_versions() -> dict[str, tuple[SchemaVersion, ...]]:
    """Every kept schema version per record name, oldest first (computed once)."""
    types = shared_types()
    found: dict[str, list[SchemaVersion]] = {}
    for path in sorted(SCHEMA_DIR.glob("*.avsc")):
        match = _FILE_NAME.match(path.name)
        if match is None:
            raise ValueError(f"schema file {path} is not named <Record>.v<N>.avsc")
        record, number = match["name"], int(match["version"])
        schema_json = json.dumps(self_contained(json.loads(path.read_text()), types))
        parsed = parse_schema(json.loads(schema_json))
        if not isinstance(parsed, dict) or parsed["type"] != "record":
            raise ValueError(f"schema file {path} does not hold a record schema")
        version = SchemaVersion(
            record,
            number,
            schema_json,
            parsed,
            standard_fingerprint(schema_json),
            legacy.FINGERPRINTS_0_1_0.get((record, number)),
            path,
        )
        found.setdefault(record, []).append(version)
    return {name: tuple(sorted(v, key=lambda s: s.version)) for name, v in found.items()}


def current(record: str) -> SchemaVersion:
    """The reader schema of a record type: its newest released version."""
    return released_versions()[record][-1]
