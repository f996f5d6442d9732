"""The file formats of ``export-training``: each a small writer of :class:`TrainingRow` s.

- ``pt``: ``torch.save`` of ``{"format", "journal", "rollouts": [TrainingRow.tensors() per rollout]}``;
  ``torch.load(path, weights_only=True)`` reads it.
- ``parquet``: one row per rollout, :data:`SCHEMA`'s columns (verl reads Parquet).
- ``jsonl``: the same columns, one JSON object a line (OpenRLHF, TRL's ``load_dataset("json", ...)``).
- ``hf``: the same columns as a Hugging Face ``datasets`` folder (``datasets.load_from_disk``).

A writer writes beside ``out`` and moves its work into place when it closes without an error, so
a reader never sees half an export, and a failed one leaves ``out`` as it was (an earlier export
there is replaced only by a whole new one).
"""

from __future__ import annotations

import dataclasses
import json
import shutil
import typing
from pathlib import Path
from types import TracebackType
from typing import Any, Self

from rollout_journal.journal.errors import ConfigurationError
from rollout_journal.journal.events import SamplingParams
from rollout_journal.replay.training import CONTINUATION_COUNTERS, TRAINING_FORMAT, TrainingRow

FORMATS = ("pt", "parquet", "jsonl", "hf")
SUFFIXES = {".pt": "pt", ".parquet": "parquet", ".jsonl": "jsonl"}
_BATCH = 256  # rows per Parquet row group / Arrow batch


def format_for(out: str | Path, asked: str | None) -> str:
    """``asked``, or the format ``out``'s suffix names (``.pt``, ``.parquet``, ``.jsonl``)."""
    if asked is not None:
        return asked
    found = SUFFIXES.get(Path(out).suffix)
    if found is None:
        raise ConfigurationError(
            f"--out {out}: say which format to write with --format {'|'.join(FORMATS)} "
            f"(a suffix {', '.join(SUFFIXES)} names one; hf writes a folder)"
        )
    return found


class Writer:
    """Rows in, one file (or folder) out; a context manager that commits on a clean exit."""

    def __init__(self, out: Path, journal: str) -> None:
        self.out, self.journal = out, journal
        if out.is_dir() and not (out / "dataset_info.json").exists():
            raise ConfigurationError(
                f"--out {out} is a directory that holds no earlier export; name a file or a new folder"
            )
        out.parent.mkdir(parents=True, exist_ok=True)
        self.tmp = out.with_name(out.name + ".tmp")
        _remove(self.tmp)

    def add(self, row: TrainingRow) -> None:
        raise NotImplementedError

    def finish(self) -> None:
        """Write what is buffered to ``self.tmp``."""

    def __enter__(self) -> Self:
        return self

    def __exit__(self, kind: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None) -> None:
        try:
            if kind is None:
                self.finish()
                if self.out.is_dir():  # an earlier hf export: replaced whole
                    shutil.rmtree(self.out)
                self.tmp.replace(self.out)  # a reader never sees half an export
        finally:
            _remove(self.tmp)


class PtWriter(Writer):
    def __init__(self, out: Path, journal: str) -> None:
        super().__init__(out, journal)
        self.rows: list[dict[str, Any]] = []

    def add(self, row: TrainingRow) -> None:
        self.rows.append(row.tensors())

    def finish(self) -> None:
        import torch

        torch.save({"format": TRAINING_FORMAT, "journal": self.journal, "rollouts": self.rows}, self.tmp)


class JsonlWriter(Writer):
    def __init__(self, out: Path, journal: str) -> None:
        super().__init__(out, journal)
        self.file = self.tmp.open("w", encoding="utf-8")

    def add(self, row: TrainingRow) -> None:
        self.file.write(json.dumps(row.columns(), separators=(",", ":")) + "\n")

    def finish(self) -> None:
        self.file.close()

    def __exit__(self, kind: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None) -> None:
        self.file.close()
        super().__exit__(kind, exc, tb)


def schema() -> Any:
    """The Arrow schema of the table formats (``pyarrow.Schema``): fixed, so an export with no row,
    or with only unfinished rows, has the same columns and types as any other."""
    import pyarrow as pa

    ids, mask, logprobs = pa.list_(pa.int32()), pa.list_(pa.int8()), pa.list_(pa.float32())
    kinds = {float: pa.float64(), int: pa.int64(), bool: pa.bool_(), str: pa.string()}
    sampling = []
    for f in dataclasses.fields(SamplingParams):  # whatever a model call's sampling records, nullable
        hint = typing.get_type_hints(SamplingParams)[f.name]
        base = next((t for t in typing.get_args(hint) if t is not type(None)), hint)
        sampling.append(pa.field(f.name, kinds.get(base, pa.string())))
    segment = pa.struct(
        [
            pa.field("start", pa.int32()),
            pa.field("end", pa.int32()),
            pa.field("generated", pa.bool_()),
            pa.field("attempt", pa.int32()),
            pa.field("turn", pa.int32()),
            pa.field("call_id", pa.string()),
            pa.field("policy_version", pa.string()),
            pa.field("logprob_mode", pa.string()),
            pa.field("renormalized", pa.bool_()),
            pa.field("constrained", pa.bool_()),
            *sampling,
        ]
    )
    return pa.schema(
        [
            pa.field("rollout_id", pa.string()),
            pa.field("group_id", pa.string()),
            pa.field("finished", pa.bool_()),
            pa.field("reward_score", pa.float64()),  # null: unfinished
            pa.field("attempts", pa.int32()),
            pa.field("num_turns", pa.int32()),
            pa.field("prompt_ids", ids),
            pa.field("response_ids", ids),
            pa.field("response_mask", mask),
            pa.field("response_logprobs", logprobs),
            pa.field("input_ids", ids),
            pa.field("assistant_masks", mask),
            pa.field("logprobs", logprobs),
            pa.field("policy_versions", pa.list_(pa.string())),
            pa.field("segments", pa.list_(segment)),
            pa.field("status", pa.string()),
            pa.field("sequence_starts", ids),
            *(pa.field(name, pa.int32()) for name in CONTINUATION_COUNTERS),
        ],
        metadata={"format": TRAINING_FORMAT},
    )


class _ArrowWriter(Writer):
    """Buffers rows into Arrow record batches of :func:`schema`."""

    def __init__(self, out: Path, journal: str) -> None:
        super().__init__(out, journal)
        self.schema = schema()
        self.pending: list[dict[str, Any]] = []

    def add(self, row: TrainingRow) -> None:
        self.pending.append(row.columns())
        if len(self.pending) >= _BATCH:
            self.batch(self._take())

    def _take(self) -> Any:
        import pyarrow as pa

        rows, self.pending = self.pending, []
        return pa.RecordBatch.from_pylist(rows, schema=self.schema)

    def batch(self, batch: Any) -> None:
        raise NotImplementedError


class ParquetWriter(_ArrowWriter):
    def __init__(self, out: Path, journal: str) -> None:
        import pyarrow.parquet as pq

        super().__init__(out, journal)
        self.file = pq.ParquetWriter(str(self.tmp), self.schema)

    def batch(self, batch: Any) -> None:
        self.file.write_batch(batch)

    def finish(self) -> None:
        if self.pending:
            self.batch(self._take())
        self.file.close()

    def __exit__(self, kind: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None) -> None:
        if kind is not None:
            self.file.close()
        super().__exit__(kind, exc, tb)


class HfWriter(_ArrowWriter):
    """A ``datasets.Dataset`` saved with ``save_to_disk`` (the rows are held until the end: the
    dataset is built from one Arrow table)."""

    def __init__(self, out: Path, journal: str) -> None:
        super().__init__(out, journal)
        self.batches: list[Any] = []

    def batch(self, batch: Any) -> None:
        self.batches.append(batch)

    def finish(self) -> None:
        import datasets
        import pyarrow as pa

        if self.pending:
            self.batch(self._take())
        table = pa.Table.from_batches(self.batches, schema=self.schema)
        info = datasets.DatasetInfo(description=f"{TRAINING_FORMAT} training rows exported from {self.journal}")
        datasets.Dataset(table, info=info).save_to_disk(str(self.tmp))


WRITERS: dict[str, type[Writer]] = {"pt": PtWriter, "parquet": ParquetWriter, "jsonl": JsonlWriter, "hf": HfWriter}


def writer_for(format: str, out: Path, journal: str) -> Writer:
    """The writer of ``format`` (one of :data:`FORMATS`) into ``out``."""
    if format not in WRITERS:
        raise ConfigurationError(f"no training format {format!r}: one of {', '.join(FORMATS)}")
    if format in ("parquet", "hf"):
        _needs("pyarrow", "datasets" if format == "hf" else None)
    return WRITERS[format](out, journal)


def _needs(*modules: str | None) -> None:
    import importlib.util

    missing = [m for m in modules if m is not None and importlib.util.find_spec(m) is None]
    if missing:
        raise ConfigurationError(
            f"export-training needs {' and '.join(missing)} for this format: pip install 'rollout-journal[export]'"
        )


def _remove(path: Path) -> None:
    if path.is_dir():
        shutil.rmtree(path)
    elif path.exists():
        path.unlink()
