"""Avro single-object encoding of journal records.

Wire format (Avro spec): ``C3 01`` + 8-byte little-endian CRC-64-AVRO
fingerprint of the writer schema's Parsing Canonical Form + the Avro binary
body, exactly as Avro's own single-object encoders write it (any Avro
implementation given ``SchemaVersion.schema_json`` decodes the journal). The
fingerprint names the writer schema without a registry; the reader resolves
any kept writer version to the current reader schema of that record type.
Records written by 0.1.0 carry non-standard fingerprints (``rollout_journal.schemas.legacy``):
they are read, never written.
"""

from __future__ import annotations

import dataclasses
import io
from collections.abc import Iterator
from dataclasses import dataclass
from enum import Enum
from typing import Any

import numpy as np
from fastavro import schemaless_reader, schemaless_writer

from rollout_journal import schemas
from rollout_journal.journal.errors import CorruptRecordError, RecordLocation, UnknownSchemaError
from rollout_journal.journal.events import EVENT_TYPES, NESTED_RECORDS, Record, nested_fields
from rollout_journal.journal.flat_avro import FlatWriter, flat_writer
from rollout_journal.schemas import SchemaVersion

MAGIC = b"\xc3\x01"
PREFIX_LEN = 10


class _Kind(Enum):
    PLAIN = 0
    PACKED = 1
    NESTED = 2
    NESTED_LIST = 3


@dataclass(frozen=True)
class _FieldPlan:
    name: str
    kind: _Kind
    dtype: str | None = None
    cls: type | None = None
    has_default: bool = False  # a packed field added later: an old writer's record reads its Avro default

    @property
    def nested(self) -> type:
        """The record class of a NESTED or NESTED_LIST field."""
        if self.cls is None:
            raise TypeError(f"field {self.name} ({self.kind.name}) holds no nested record")
        return self.cls


def _plan(cls: type) -> tuple[_FieldPlan, ...]:
    plans = []
    nested = nested_fields(cls)  # by each field's own type, not its name
    for f in dataclasses.fields(cls):
        if "dtype" in f.metadata:
            has_default = f.default_factory is not dataclasses.MISSING
            plans.append(_FieldPlan(f.name, _Kind.PACKED, dtype=f.metadata["dtype"], has_default=has_default))
        elif f.name in nested:
            inner, is_list = nested[f.name]
            plans.append(_FieldPlan(f.name, _Kind.NESTED_LIST if is_list else _Kind.NESTED, cls=inner))
        else:
            plans.append(_FieldPlan(f.name, _Kind.PLAIN))
    return tuple(plans)


_PLANS: dict[type, tuple[_FieldPlan, ...]] = {cls: _plan(cls) for cls in (*EVENT_TYPES, *NESTED_RECORDS)}


def _pack(value: Any, dtype: str) -> bytes:
    if isinstance(value, np.ndarray) and value.dtype == dtype:
        return value.tobytes()  # already packed: one memcpy, no per-element work
    return np.ascontiguousarray(value, dtype=dtype).tobytes()


def _encoder_source(cls: type) -> str:
    """Source of a function turning one ``cls`` into the dict fastavro writes.

    Generated once per record type (as ``dataclasses`` generates ``__init__``):
    encoding is the journal's hot path and a generic field loop costs about as
    much as the Avro write itself.
    """
    items = []
    for p in _PLANS[cls]:
        ref = f"o.{p.name}"
        if p.kind is _Kind.PACKED:
            expr = f"_pack({ref}, {p.dtype!r})"
        elif p.kind is _Kind.NESTED:
            expr = f"(None if {ref} is None else _encode_{p.nested.__name__}({ref}))"
        elif p.kind is _Kind.NESTED_LIST:
            expr = f"[_encode_{p.nested.__name__}(v) for v in {ref}]"
        else:
            expr = ref
        items.append(f"{p.name!r}: {expr}")
    return f"def _encode_{cls.__name__}(o):\n    return {{{', '.join(items)}}}\n"


_ENCODERS: dict[type, Any] = {}
_namespace: dict[str, Any] = {"_pack": _pack}
for _cls in sorted(_PLANS, key=lambda c: c not in NESTED_RECORDS):  # nested types first
    exec(_encoder_source(_cls), _namespace)  # noqa: S102 - source built above from our own field names
    _ENCODERS[_cls] = _namespace[f"_encode_{_cls.__name__}"]


def _decoder_source(cls: type) -> str:
    """Source of the inverse of the encoder: dict from fastavro -> ``cls``; packed
    arrays become read-only views over the record's bytes (no copy)."""
    args = []
    for p in _PLANS[cls]:
        ref = f"d[{p.name!r}]"
        if p.kind is _Kind.PACKED and p.has_default:
            expr = f"_frombuffer(_default_bytes({ref}), {p.dtype!r})"
        elif p.kind is _Kind.PACKED:
            expr = f"_frombuffer({ref}, {p.dtype!r})"
        elif p.kind is _Kind.NESTED:
            expr = f"(None if {ref} is None else _decode_{p.nested.__name__}({ref}))"
        elif p.kind is _Kind.NESTED_LIST:
            expr = f"[_decode_{p.nested.__name__}(v) for v in {ref}]"
        else:
            expr = ref
        args.append(expr)
    return f"def _decode_{cls.__name__}(d):\n    return _{cls.__name__}({', '.join(args)})\n"


def _default_bytes(value: bytes | str) -> bytes:
    """fastavro fills a bytes field an old writer lacked with its JSON default, a str whose code
    points are the bytes (the Avro specification's rule for bytes defaults)."""
    return value.encode("latin-1") if isinstance(value, str) else value


_DECODERS: dict[type, Any] = {}
_namespace.update(
    {"_frombuffer": np.frombuffer, "_default_bytes": _default_bytes}, **{f"_{c.__name__}": c for c in _PLANS}
)
for _cls in sorted(_PLANS, key=lambda c: c not in NESTED_RECORDS):
    exec(_decoder_source(_cls), _namespace)  # noqa: S102 - source built above from our own field names
    _DECODERS[_cls] = _namespace[f"_decode_{_cls.__name__}"]


def _read_long(data: bytes, pos: int) -> tuple[int, int]:
    """One Avro zig-zag varint at ``pos``: (value, position after it)."""
    byte = data[pos]
    value, shift, pos = byte & 0x7F, 7, pos + 1
    while byte & 0x80:
        byte = data[pos]
        value |= (byte & 0x7F) << shift
        shift, pos = shift + 7, pos + 1
    return (value >> 1) ^ -(value & 1), pos


def peek_seq(data: bytes) -> int:
    """The ``header.seq`` of an encoded rollout event, without decoding the rest.

    Every event schema (every kept version) starts with the frozen Header type:
    rollout_id, group_id (strings), attempt (int), epoch (long), turn (int), seq
    (long). Restore uses this to step over events a snapshot already covers.
    Raises IndexError/ValueError on garbage: decode the record to learn why.
    """
    pos = PREFIX_LEN
    for _ in range(2):  # rollout_id, group_id
        length, pos = _read_long(data, pos)
        pos += length
    for _ in range(3):  # attempt, epoch, turn
        _, pos = _read_long(data, pos)
    seq, pos = _read_long(data, pos)
    if pos > len(data):
        raise ValueError("record shorter than its header")
    return seq


class Codec:
    """Encodes records with their current schema; decodes any kept version."""

    def __init__(self) -> None:
        self._types = {cls.RECORD: cls for cls in EVENT_TYPES}
        self._current: dict[type, SchemaVersion] = {}
        self._by_fingerprint: dict[bytes, tuple[type[Record], SchemaVersion]] = {}
        for name, versions in schemas.released_versions().items():
            cls = self._types.get(name)
            if cls is None:
                raise RuntimeError(f"schema {versions[-1].path} has no event class in journal.events")
            self._current[cls] = versions[-1]
            for version in versions:
                for fp in (version.fingerprint, version.legacy_fingerprint):  # legacy: journals written by 0.1.0
                    if fp is None:
                        continue
                    other = self._by_fingerprint.setdefault(fp, (cls, version))[1]
                    if other is not version:
                        raise RuntimeError(f"schemas {other.path} and {version.path} share fingerprint {fp.hex()}")

    def writer_versions(self) -> Iterator[tuple[bytes, type, SchemaVersion, SchemaVersion]]:
        """(fingerprint, record class, writer schema, current reader schema) of every version read."""
        for fp, (cls, writer) in self._by_fingerprint.items():
            yield fp, cls, writer, self._current[cls]

    def encode(self, record: Record) -> bytes:
        return self.encode_with(record, self._current[type(record)])

    def values_encoder(self, cls: type) -> FlatWriter | None:
        """An encoder of a ``cls`` record from its field values (a tuple, in field order) that writes
        exactly what :meth:`encode` writes of it, skipping the record and fastavro's generic writer
        (for the summary each append writes); None where ``cls``'s current schema is not flat or its
        fields are not the schema's, in order."""
        version = self._current[cls]
        names = [f.name for f in dataclasses.fields(cls)]
        if names != [f["name"] for f in version.parsed["fields"]]:
            return None
        return flat_writer(version.parsed, MAGIC + version.fingerprint)

    def encode_with(self, record: Record, version: SchemaVersion) -> bytes:
        """Encode with a given (possibly old) writer schema, under its standard
        fingerprint; fields it lacks are dropped."""
        buf = io.BytesIO()
        buf.write(MAGIC + version.fingerprint)
        schemaless_writer(buf, version.parsed, _ENCODERS[type(record)](record))
        return buf.getvalue()

    def record_class(self, data: bytes | None) -> type | None:
        """The record class whose schema ``data``'s fingerprint names; None for anything else."""
        if data is None or len(data) < PREFIX_LEN or data[:2] != MAGIC:
            return None
        found = self._by_fingerprint.get(bytes(data[2:PREFIX_LEN]))
        return None if found is None else found[0]

    def decode(self, data: bytes, location: RecordLocation) -> Record:
        """Decode one record; errors name ``location``."""
        if data[:2] != MAGIC:
            raise CorruptRecordError(location, f"bad magic {bytes(data[:2]).hex() or 'empty'} (expected c301)")
        if len(data) < PREFIX_LEN:
            raise CorruptRecordError(location, f"{len(data)} bytes, shorter than the {PREFIX_LEN}-byte Avro prefix")
        fp = bytes(data[2:PREFIX_LEN])
        found = self._by_fingerprint.get(fp)
        if found is None:
            raise UnknownSchemaError(location, fp)
        cls, writer = found
        current = self._current[cls]
        reader = None if writer is current else current.parsed
        body = io.BytesIO(data)
        body.seek(PREFIX_LEN)
        try:
            raw = schemaless_reader(body, writer.parsed, reader)
        except Exception as exc:  # fastavro raises several types on garbage input
            raise CorruptRecordError(
                location, f"Avro body of {cls.RECORD} v{writer.version} unreadable: {exc!r}"
            ) from exc
        if body.tell() != len(data):
            raise CorruptRecordError(location, f"{len(data) - body.tell()} trailing bytes after {cls.RECORD} body")
        record: Record = _DECODERS[cls](raw)  # the generated decoder of a record class builds one
        return record
