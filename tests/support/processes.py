"""The processes a test started, as /proc lists them (Linux): tests that kill or count children."""

from __future__ import annotations

from pathlib import Path


def children_of(pid: int, *, cmdline_holds: bytes = b"") -> set[int]:
    """Pids whose parent is ``pid`` (and whose command line holds ``cmdline_holds``, if given)."""
    found = set()
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            if int(stat.read_text().rsplit(")", 1)[1].split()[1]) != pid:
                continue
            if cmdline_holds and cmdline_holds not in (stat.parent / "cmdline").read_bytes():
                continue
        except (OSError, IndexError, ValueError):  # gone meanwhile
            continue
        found.add(int(stat.parent.name))
    return found
