"""Plain-text tables for the terminal: columns as wide as their widest cell."""

from __future__ import annotations

from collections.abc import Collection, Iterator, Sequence


def table(headers: Sequence[str], rows: Sequence[Sequence[object]], numeric: Collection[int] = ()) -> Iterator[str]:
    """Lines of a table; columns whose index is in ``numeric`` are right-aligned."""
    cells = [[str(c) for c in row] for row in rows]
    widths = [max([len(h), *(len(r[i]) for r in cells)]) for i, h in enumerate(headers)]

    def line(values: Sequence[str]) -> str:
        parts = [v.rjust(w) if i in numeric else v.ljust(w) for i, (v, w) in enumerate(zip(values, widths))]
        return "  ".join(parts).rstrip()

    yield line(list(headers))
    yield line(["-" * w for w in widths])
    for row in cells:
        yield line(row)
