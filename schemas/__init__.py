"""Avro schemas of every journal record, every released version kept.

Files are named ``<Record>.v<N>.avsc``; the highest N is the reader schema.
Named types shared by records live in ``types/`` and are frozen once released:
changing one means adding a new named type, never editing the old file, so
that every kept writer schema keeps its fingerprint.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from functools import cache
from pathlib import Path

from fastavro import parse_schema
from fastavro.schema import fingerprint, to_parsing_canonical_form

SCHEMA_DIR = Path(__file__).parent
_FILE_NAME = re.compile(r"^(?P<name>[A-Za-z]+)\.v(?P<version>\d+)\.avsc$")


@dataclass(frozen=True)
class SchemaVersion:
    """One released writer schema of a record type."""

    record: str
    version: int
    parsed: dict
    fingerprint: bytes  # CRC-64-AVRO of the parsing canonical form, little-endian as in single-object encoding
    path: Path


def _named_types() -> dict:
    named: dict = {}
    for path in sorted((SCHEMA_DIR / "types").glob("*.avsc")):
        parse_schema(json.loads(path.read_text()), named_schemas=named)
    return named


@cache
def released_versions() -> dict[str, tuple[SchemaVersion, ...]]:
    """Every kept schema version per record name, oldest first."""
    found: dict[str, list[SchemaVersion]] = {}
    for path in sorted(SCHEMA_DIR.glob("*.avsc")):
        match = _FILE_NAME.match(path.name)
        if match is None:
            raise ValueError(f"schema file {path} is not named <Record>.v<N>.avsc")
        parsed = parse_schema(json.loads(path.read_text()), named_schemas=_named_types())
        canonical = to_parsing_canonical_form(parsed)
        fp = bytes.fromhex(fingerprint(canonical, "CRC-64-AVRO"))  # fastavro prints it in wire (little-endian) order
        version = SchemaVersion(match["name"], int(match["version"]), parsed, fp, path)
        found.setdefault(version.record, []).append(version)
    return {name: tuple(sorted(v, key=lambda s: s.version)) for name, v in found.items()}


def current(record: str) -> SchemaVersion:
    """The reader schema of a record type: its newest released version."""
    return released_versions()[record][-1]
