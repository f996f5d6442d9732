"""The non-standard fingerprints rollout-journal 0.1.0 wrote, kept so its journals still decode.

0.1.0 took the Parsing Canonical Form of each record with its shared named
types (``types/``) left as bare names, so 9 of its 10 fingerprints differ from
the ones every Avro implementation computes. Records are now written with the
standard fingerprint only; a reader maps these old ones to the same schema
versions. The table is frozen like the schema files (journals on disk do not
change when fastavro does); :func:`fingerprint_by_the_0_1_0_rule` is that rule,
which ``tests/schemas/test_schemas.py`` checks the table against.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from fastavro import parse_schema
from fastavro.schema import fingerprint, to_parsing_canonical_form

# (record, version) -> 8-byte fingerprint in wire order, as 0.1.0 wrote it after C3 01.
FINGERPRINTS_0_1_0: dict[tuple[str, int], bytes] = {
    ("AttemptFenced", 1): bytes.fromhex("28907b4433bfef4c"),
    ("AttemptStarted", 1): bytes.fromhex("4ac57d493a8b2b8d"),
    ("BlobChunk", 1): bytes.fromhex("b7045a2445318d95"),  # no named type: already the standard one
    ("ModelCall", 1): bytes.fromhex("38fd590aa9a3a74d"),
    ("ResourceMutation", 1): bytes.fromhex("20271073aa0c3b2e"),
    ("RolloutAcknowledged", 1): bytes.fromhex("8f41f783bdf6022c"),
    ("RolloutFinished", 1): bytes.fromhex("1314892d618d0575"),
    ("Snapshot", 1): bytes.fromhex("3b56b18a3c598208"),
    ("TurnCompleted", 1): bytes.fromhex("08c4b598ff937794"),
    ("TurnCompleted", 2): bytes.fromhex("b500b96dae80643e"),
}


def fingerprint_by_the_0_1_0_rule(record_file: Path) -> bytes:
    """The fingerprint 0.1.0 computed for a record file: fastavro's canonical form
    of the record parsed against the shared types, which leaves them bare names."""
    named: dict[str, Any] = {}
    for path in sorted((record_file.parent / "types").glob("*.avsc")):
        parse_schema(json.loads(path.read_text()), named_schemas=named)
    parsed = parse_schema(json.loads(record_file.read_text()), named_schemas=named)
    return bytes.fromhex(fingerprint(to_parsing_canonical_form(parsed), "CRC-64-AVRO"))
