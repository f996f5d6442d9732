"""A fast Avro writer for flat records: the bytes fastavro writes, at a fraction of its cost.

A summary record is written with every append (:mod:`rollout_journal.journal.summary`), and
fastavro's generic writer (a type dispatch per field, a union resolved by validating each branch)
spent about 10 us on its 28 small fields, more than folding the events it summarizes. For a
schema whose fields are all primitives, nullable primitives or arrays of primitives, the writer
is generated here once from the schema (as ``codec`` generates its field-to-dict functions),
straight-line code that joins each field's bytes. It writes exactly what ``schemaless_writer``
writes for the same values (tests check it against fastavro); any other schema gets no writer
(:func:`flat_writer` returns None) and stays on fastavro.
"""

from __future__ import annotations

import functools
import struct
from collections.abc import Callable
from typing import Any

__all__ = ["FlatWriter", "flat_writer"]

FlatWriter = Callable[[tuple[Any, ...]], bytes]  # the field values in schema order -> the Avro body

_MIN_LONG, _MAX_LONG = -(1 << 63), (1 << 63) - 1
_ONE_BYTE = tuple(bytes((z,)) for z in range(0x80))
_pack_double = struct.Struct("<d").pack


# Memoized: a summary's numbers and strings mostly repeat from one append to the next (its rollout's
# ids, its first offset, small counts; its timestamp within a millisecond), and a lookup costs a
# tenth of writing a varint in Python. Values that compare equal write the same bytes (fastavro
# truncates a float), so sharing their entry is right.
@functools.lru_cache(maxsize=4096)
def _long(n: Any) -> bytes:
    """One Avro int or long (zig-zag varint); like fastavro, a float is truncated and a value out
    of 64 bits raises OverflowError (fastavro checks no int's 32 bits either)."""
    number: int = n if n.__class__ is int else int(n)
    if number < _MIN_LONG or number > _MAX_LONG:
        raise OverflowError(f"{number} does not fit an Avro long")
    z = (number << 1) ^ (number >> 63)
    if z < 0x80:
        return _ONE_BYTE[z]
    out = bytearray()
    while z > 0x7F:
        out.append(z & 0x7F | 0x80)
        z >>= 7
    out.append(z)
    return bytes(out)


MEMO_MAX_CHARS = 256
"""The longest string the memo keeps: ids and names repeat; a failure's message (megabytes of a
tool's output) would be kept alive by the memo long after its summary was written."""


def _string(s: str) -> bytes:
    if len(s) > MEMO_MAX_CHARS:
        return _string_bytes(s)
    return _short_string(s)


def _string_bytes(s: str) -> bytes:
    data = s.encode()
    return _long(len(data)) + data


_short_string = functools.lru_cache(maxsize=4096)(_string_bytes)


NULLABLE = ("string", "double")  # the nullable types written here; other unions stay on fastavro

_PRIMITIVES: dict[str, str] = {  # how each writes the value {0}; a boolean is its truth, as fastavro writes it
    "string": "_string({0})",
    "long": "_long({0})",
    "int": "_long({0})",
    "boolean": '(b"\\x01" if {0} else b"\\x00")',
    "double": "_pack_double({0})",
}


def _field_expr(avro_type: Any, ref: str) -> str | None:
    """An expression writing ``ref`` as ``avro_type``; None for a type this writer does not do."""
    if isinstance(avro_type, str):
        template = _PRIMITIVES.get(avro_type)
        return None if template is None else template.format(ref)
    if isinstance(avro_type, list) and len(avro_type) == 2 and avro_type[0] == "null":
        # Only where a value fastavro's union would not match cannot be written silently instead:
        # an int union would take a long's 2**40 (a peer refuses it), a long union 1.5 or True.
        inner = _field_expr(avro_type[1], ref) if avro_type[1] in NULLABLE else None
        # branch 0 (null) is the varint 0, branch 1 the varint 2
        return None if inner is None else f'(b"\\x00" if {ref} is None else b"\\x02" + {inner})'
    if isinstance(avro_type, dict) and avro_type.get("type") == "array" and isinstance(avro_type.get("items"), str):
        item = _field_expr(avro_type["items"], "_v")
        # one block of every item, then the empty block that ends an array (an empty array is that alone)
        return (
            None
            if item is None
            else f'(_long(len({ref})) + b"".join([{item} for _v in {ref}]) + b"\\x00" if len({ref}) else b"\\x00")'
        )
    return None


def flat_writer(schema: dict[str, Any], prefix: bytes = b"") -> FlatWriter | None:
    """The writer of ``schema`` (parsed or as written), a record of flat fields, its body after
    ``prefix`` (single-object encoding's magic and fingerprint); None for any other schema."""
    if schema.get("type") != "record" or not schema["fields"]:
        return None
    names, exprs = [], []
    for i, f in enumerate(schema["fields"]):
        expr = _field_expr(f["type"], f"v{i}")
        if expr is None:
            return None
        names.append(f"v{i}")
        exprs.append(expr)
    unpack = ", ".join(names) + ("," if len(names) == 1 else "")
    source = f"def write(values):\n    {unpack} = values\n    return b''.join((_prefix, {', '.join(exprs)}))\n"
    namespace: dict[str, Any] = {"_long": _long, "_string": _string, "_pack_double": _pack_double, "_prefix": prefix}
    exec(source, namespace)  # noqa: S102 - source built above from the schema's field types alone
    writer: FlatWriter = namespace["write"]
    return writer
