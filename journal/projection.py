"""Projected reads: decode only the fields a reader folds, step over the rest.

A full scan that keeps only bookkeeping (``replay list``) spent most of its time
having fastavro build every field of every record (messages, call ids, token
arrays) and the dataclasses around them. A projection names, per record type,
the fields a reader needs; for each writer schema that holds all of them with the
reader's own types it generates (once, like the codec's encoders) a reader that
decodes those fields from the Avro body and skips the others by their writer
types, down to the last byte. What it returns is the record's usual class with
every field left out set to ``None``: a reader that touches one fails loudly.

fastavro's own schema resolution (a reader schema without those fields) was
measured first: its per-record field matching made reads slower, not faster,
because the large fields are packed ``bytes`` that fastavro already skips
cheaply. Any record type the projection does not name, and any writer version
a generated reader cannot serve (a kept field missing, or of another type),
is decoded in full by :class:`~rollout_journal.journal.codec.Codec`. Full decoding stays what
restore, audit and export use.
"""

from __future__ import annotations

import dataclasses
import json
import struct
from collections.abc import Callable, Mapping
from typing import Any

import numpy as np

from rollout_journal.journal.codec import _DECODERS, _PLANS, MAGIC, PREFIX_LEN, Codec, _Kind, _read_long
from rollout_journal.journal.errors import CorruptRecordError, RecordLocation
from rollout_journal.journal.events import Record
from rollout_journal.schemas import SchemaVersion

_FIXED_WIDTH = {"null": 0, "boolean": 1, "float": 4, "double": 8}
_VARINT = frozenset({"int", "long", "enum"})


class _Unsupported(Exception):
    """A writer schema a generated reader does not serve: decode that version in full."""


class _Source:
    """Python source of one reader, with fresh local names."""

    def __init__(self) -> None:
        self.lines: list[str] = []
        self._names = 0

    def name(self, stem: str) -> str:
        self._names += 1
        return f"{stem}{self._names}"

    def emit(self, depth: int, line: str) -> None:
        self.lines.append("    " * depth + line)

    def read_long(self, depth: int, target: str) -> None:
        # One- and two-byte varints (most ints, lengths, counts) without a call; longer ones through the codec's.
        b = self.name("b")
        self.emit(depth, f"{b} = d[p]")
        self.emit(depth, f"if {b} < 128: {target} = ({b} >> 1) ^ -({b} & 1); p += 1")
        self.emit(depth, "elif d[p + 1] < 128:")  # two bytes: lengths of 64 to 8191 (digests, token arrays)
        self.emit(depth + 1, f"{b} = ({b} & 127) | (d[p + 1] << 7); {target} = ({b} >> 1) ^ -({b} & 1); p += 2")
        self.emit(depth, f"else: {target}, p = _read_long(d, p)")


class _Generator:
    """Reader source from a self-contained writer schema (named types written out at first use)."""

    def __init__(self) -> None:
        self.src = _Source()
        self.named: dict[str, Any] = {}
        self.built: set[str] = set()  # targets read as instances of their class (not dicts)

    def define(self, schema: Any, namespace: str | None) -> Any:
        """``schema`` with named references resolved (definitions remembered as they appear)."""
        if isinstance(schema, str):
            if schema in _FIXED_WIDTH or schema in _VARINT or schema in ("bytes", "string"):
                return schema
            full = schema if "." in schema or not namespace else f"{namespace}.{schema}"
            if full not in self.named:
                raise _Unsupported(f"named type {schema} used before its definition")
            return self.named[full]
        if isinstance(schema, dict) and schema.get("type") in ("record", "error", "enum", "fixed"):
            name = schema["name"]
            ns = schema.get("namespace", namespace)
            self.named[name if "." in name or not ns else f"{ns}.{name}"] = schema
        return schema

    def skip(self, schema: Any, depth: int, namespace: str | None, seen: frozenset[int] = frozenset()) -> None:
        schema = self.define(schema, namespace)
        emit = self.src.emit
        if isinstance(schema, list):  # a union: skip the branch the index names
            index = self.src.name("u")
            self.src.read_long(depth, index)
            for i, branch in enumerate(schema):
                emit(depth, f"{'if' if i == 0 else 'elif'} {index} == {i}:")
                emit(depth + 1, "pass")
                self.skip(branch, depth + 1, namespace, seen)
            emit(depth, f"else: raise ValueError('union index ' + str({index}) + ' out of range')")
            return
        kind = schema if isinstance(schema, str) else schema["type"]
        if isinstance(kind, (dict, list)):  # {"type": {...}}: a wrapped type
            self.skip(kind, depth, namespace, seen)
            return
        if kind in _FIXED_WIDTH:
            if _FIXED_WIDTH[kind]:
                emit(depth, f"p += {_FIXED_WIDTH[kind]}")
        elif kind in _VARINT:
            self.src.read_long(depth, "_")
        elif kind in ("bytes", "string"):
            n = self.src.name("n")
            self.src.read_long(depth, n)
            emit(depth, f"if {n} < 0: raise ValueError('negative length')")
            emit(depth, f"p += {n}")
        elif kind == "fixed":
            emit(depth, f"p += {int(schema['size'])}")
        elif kind in ("record", "error"):
            if id(schema) in seen:
                raise _Unsupported(f"recursive type {schema['name']}")
            inner = schema.get("namespace", namespace)
            for f in schema["fields"]:
                self.skip(f["type"], depth, inner, seen | {id(schema)})
        elif kind in ("array", "map"):
            # Blocks of items until a zero count; a negative count is followed by the block's byte size.
            count = self.src.name("c")
            self.src.read_long(depth, count)
            emit(depth, f"while {count}:")
            emit(depth + 1, f"if {count} < 0:")
            emit(depth + 2, f"{count} = -{count}")
            self.src.read_long(depth + 2, "_")
            emit(depth + 1, f"for _ in range({count}):")
            emit(depth + 2, "pass")
            if kind == "map":
                self.skip("string", depth + 2, namespace, seen)
            self.skip(schema["items" if kind == "array" else "values"], depth + 2, namespace, seen)
            self.src.read_long(depth + 1, count)
        else:
            raise _Unsupported(f"Avro type {kind!r}")

    def read(self, schema: Any, depth: int, namespace: str | None, target: str, build: type | None = None) -> None:
        """Code that reads one value of ``schema`` into ``target``, as fastavro returns it (a record
        of plain fields that ``build`` has, in the same order: a ``build`` instance)."""
        schema = self.define(schema, namespace)
        emit = self.src.emit
        if isinstance(schema, list):
            index = self.src.name("u")
            self.src.read_long(depth, index)
            for i, branch in enumerate(schema):
                emit(depth, f"{'if' if i == 0 else 'elif'} {index} == {i}:")
                emit(depth + 1, "pass")
                self.read(branch, depth + 1, namespace, target, build)
            emit(depth, f"else: raise ValueError('union index ' + str({index}) + ' out of range')")
            return
        if isinstance(schema, dict) and schema.get("logicalType") not in (None, "int32-le", "float32-le"):
            raise _Unsupported(f"logical type {schema['logicalType']}")  # fastavro would convert it
        kind = schema if isinstance(schema, str) else schema["type"]
        if isinstance(kind, (dict, list)):
            self.read(kind, depth, namespace, target, build)
        elif kind == "null":
            emit(depth, f"{target} = None")
        elif kind == "boolean":
            emit(depth, f"{target} = d[p] == 1; p += 1")
        elif kind in ("int", "long"):
            self.src.read_long(depth, target)
        elif kind in ("float", "double"):
            fmt, width = ("_f4", 4) if kind == "float" else ("_f8", 8)
            emit(depth, f"{target} = {fmt}(d, p)[0]; p += {width}")
        elif kind in ("bytes", "string"):
            n = self.src.name("n")
            self.src.read_long(depth, n)
            emit(depth, f"if {n} < 0: raise ValueError('negative length')")
            value = f"d[p:p + {n}]" + (".decode()" if kind == "string" else "")
            emit(depth, f"{target} = {value}; p += {n}")
        elif kind == "record":
            inner = schema.get("namespace", namespace)
            parts = {}
            for f in schema["fields"]:
                parts[f["name"]] = self.src.name("v")
                self.read(f["type"], depth, inner, parts[f["name"]])
            plain = () if build is None else _PLANS.get(build, ())
            if (
                build is not None
                and [f.name for f in plain] == list(parts)
                and all(f.kind is _Kind.PLAIN for f in plain)
            ):
                # the class's own fields, in schema order: construct it without a dict in between
                emit(depth, _construct(build, target, list(parts.values())))
                self.built.add(target)
            else:
                emit(depth, f"{target} = {{{', '.join(f'{name!r}: {local}' for name, local in parts.items())}}}")
        else:  # arrays, maps, enums, fixed: no kept field has one yet
            raise _Unsupported(f"a kept field of Avro type {kind!r}")


def _construct(cls: type, target: str, args: list[str]) -> str:
    """A statement making ``target`` a ``cls`` of ``args`` (its fields in order). A frozen dataclass's
    ``__init__`` sets each field through ``object.__setattr__``, about as costly as reading the
    record: a plain one (no ``__post_init__``, no slots) gets its ``__dict__``
    filled at once instead, which is the same object."""
    names = [f.name for f in dataclasses.fields(cls)]
    if hasattr(cls, "__post_init__") or hasattr(cls, "__slots__") or "__dict__" not in dir(cls):
        return f"{target} = _{cls.__name__}({', '.join(args)})"
    items = ", ".join(f"{name!r}: {arg}" for name, arg in zip(names, args, strict=True))
    return f"{target} = _new(_{cls.__name__}); {target}.__dict__.update({{{items}}})"


def _field_types(schema_json: str) -> dict[str, str]:
    """Each top-level field's type, as canonical JSON with every named type written out."""
    gen = _Generator()
    schema = json.loads(schema_json)
    namespace = schema.get("namespace")

    def expand(s: Any) -> Any:
        s = gen.define(s, namespace)
        if isinstance(s, list):
            return [expand(branch) for branch in s]
        if isinstance(s, str):
            return s
        out = {k: v for k, v in s.items() if k not in ("doc", "default", "aliases")}
        if "fields" in out:
            out["fields"] = [{"name": f["name"], "type": expand(f["type"])} for f in out["fields"]]
        for key in ("items", "values"):
            if key in out:
                out[key] = expand(out[key])
        if not isinstance(out["type"], str):
            out["type"] = expand(out["type"])
        return out

    return {f["name"]: json.dumps(expand(f["type"]), sort_keys=True) for f in schema["fields"]}


def _reader_source(cls: type, writer: SchemaVersion, reader: SchemaVersion, kept: frozenset[str]) -> str:
    """Source of ``_project(d) -> cls``: the kept fields decoded, the rest stepped over, ``None`` in their place."""
    writer_types, reader_types = _field_types(writer.schema_json), _field_types(reader.schema_json)
    for name in kept:
        if writer_types.get(name) is None or writer_types[name] != reader_types.get(name):
            raise _Unsupported(f"field {name} of {writer.path.name} is missing or not of the reader's type")
    gen = _Generator()
    schema = json.loads(writer.schema_json)
    namespace = schema.get("namespace")
    gen.src.emit(1, f"p = {PREFIX_LEN}")
    nested = {plan.name: plan.cls for plan in _PLANS[cls]}
    for f in schema["fields"]:
        if f["name"] in kept:
            gen.read(f["type"], 1, namespace, f"k_{f['name']}", nested.get(f["name"]))
        else:
            gen.skip(f["type"], 1, namespace)
    gen.src.emit(1, "if p != len(d): raise ValueError(f'{len(d) - p} bytes left after the body')")
    args = []
    for plan in _PLANS[cls]:
        if plan.name not in kept:
            args.append("None")
        elif plan.kind is _Kind.PACKED:
            args.append(f"_frombuffer(k_{plan.name}, {plan.dtype!r})")
        elif plan.kind is _Kind.NESTED and f"k_{plan.name}" in gen.built:
            args.append(f"k_{plan.name}")
        elif plan.kind is _Kind.NESTED and plan.cls is not None:  # a dict: the codec's decoder makes the instance
            args.append(f"(None if k_{plan.name} is None else _decode_{plan.cls.__name__}(k_{plan.name}))")
        elif plan.kind is not _Kind.PLAIN:
            raise _Unsupported(f"kept list of records {plan.name}")
        else:
            args.append(f"k_{plan.name}")
    gen.src.emit(1, _construct(cls, "o", args))
    gen.src.emit(1, "return o")
    return "def _project(d):\n" + "\n".join(gen.src.lines) + "\n"


class Projection:
    """Decodes records keeping only the fields named in ``fields`` (record class -> field names);
    other record types in full. Same errors as :meth:`Codec.decode`."""

    def __init__(self, codec: Codec, fields: Mapping[type, tuple[str, ...]]) -> None:
        self.codec = codec
        for cls, names in fields.items():
            unknown = set(names) - {f.name for f in dataclasses.fields(cls)}
            if unknown:
                raise ValueError(f"projection of {cls.__name__} names fields it lacks: {sorted(unknown)}")
        self._readers: dict[
            bytes, tuple[Callable[[bytes], Record], str]
        ] = {}  # writer fingerprint -> (generated reader, its version)
        self._served: set[type] = set()
        for fp, cls, writer, current in codec.writer_versions():
            if cls not in fields:
                continue
            try:
                source = _reader_source(cls, writer, current, frozenset(fields[cls]))
            except _Unsupported:
                continue  # this writer version is decoded in full
            namespace: dict[str, Any] = {
                "_read_long": _read_long,
                "_frombuffer": np.frombuffer,
                "_f4": struct.Struct("<f").unpack_from,
                "_f8": struct.Struct("<d").unpack_from,
                **{f"_decode_{c.__name__}": d for c, d in _DECODERS.items()},
                **{f"_{c.__name__}": c for c in _DECODERS},
                "_new": object.__new__,
            }
            exec(source, namespace)  # noqa: S102 - source built above from our own schemas' field names
            self._readers[fp] = namespace["_project"], f"{writer.record} v{writer.version}"
            self._served.add(cls)

    def serves(self, cls: type) -> bool:
        """Whether some writer version of ``cls`` is read projected (tests use this)."""
        return cls in self._served

    def decode(self, data: bytes, location: RecordLocation) -> Record:
        """One record, projected if its writer version is served, else in full."""
        if len(data) < PREFIX_LEN or data[:2] != MAGIC:
            return self.codec.decode(data, location)  # it names what is wrong
        fp = bytes(data[2:PREFIX_LEN])
        found = self._readers.get(fp)
        if found is None:  # a record type or writer version read in full (the codec names an unknown one)
            return self.codec.decode(data, location)
        reader, version = found
        try:
            return reader(data)
        except (IndexError, ValueError, UnicodeDecodeError) as exc:  # as the full decode words it
            raise CorruptRecordError(location, f"Avro body of {version} unreadable: {exc!r}") from exc
