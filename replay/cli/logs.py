"""How the command line logs: every line has a UTC timestamp, a level, the logger and the message,
and the named fields a record carries (``extra={"fields": {...}}``), as logfmt text
(``ts=... level=info logger=... msg="..." key=value``) or, with ``--log-format json``, one JSON
object a line. ``-v`` / ``--verbose`` and ``--log-format`` are taken from anywhere on the command
line, before or after the command's name."""

from __future__ import annotations

import json
import logging
import sys
from datetime import UTC, datetime
from typing import Any

FORMATS = ("text", "json")
_PLAIN = frozenset(vars(logging.LogRecord("", 0, "", 0, "", None, None))) | {"message", "asctime", "fields"}


def split_logging_options(argv: list[str]) -> tuple[list[str], bool, str]:
    """``argv`` without ``-v``/``--verbose``/``--log-format F`` (wherever they stand, up to ``--``),
    and what they said: (rest, verbose, format)."""
    rest: list[str] = []
    verbose, form = False, "text"
    items = iter(enumerate(argv))
    for i, arg in items:
        if arg == "--":
            rest += argv[i:]
            break
        if arg in ("-v", "--verbose"):
            verbose = True
        elif arg == "--log-format":
            form = next(items, (0, "text"))[1]
        elif arg.startswith("--log-format="):
            form = arg.partition("=")[2]
        else:
            rest.append(arg)
    return rest, verbose, form


def _fields(record: logging.LogRecord) -> dict[str, Any]:
    fields = dict(getattr(record, "fields", None) or {})
    fields.update({k: v for k, v in vars(record).items() if k not in _PLAIN and not k.startswith("_")})
    return fields


def _timestamp(record: logging.LogRecord) -> str:
    return datetime.fromtimestamp(record.created, tz=UTC).strftime("%Y-%m-%dT%H:%M:%S.%f")[:-3] + "Z"


class LogfmtFormatter(logging.Formatter):
    """``ts=2026-12-01T21:40:00.123Z level=info logger=rollout_journal.x msg="..." key=value``."""

    def format(self, record: logging.LogRecord) -> str:
        parts = {
            "ts": _timestamp(record),
            "level": record.levelname.lower(),
            "logger": record.name,
            "msg": record.getMessage(),
        } | _fields(record)
        line = " ".join(f"{k}={_logfmt(v)}" for k, v in parts.items())
        if record.exc_info:
            line += " error=" + _logfmt(self.formatException(record.exc_info))
        return line


class JsonFormatter(logging.Formatter):
    """One JSON object a line: ``ts``, ``level``, ``logger``, ``msg`` and the record's fields."""

    def format(self, record: logging.LogRecord) -> str:
        doc = {
            "ts": _timestamp(record),
            "level": record.levelname.lower(),
            "logger": record.name,
            "msg": record.getMessage(),
        } | _fields(record)
        if record.exc_info:
            doc["error"] = self.formatException(record.exc_info)
        return json.dumps(doc, default=str)


def _logfmt(value: object) -> str:
    text = ",".join(map(str, value)) if isinstance(value, list | tuple) else str(value)
    if text and not any(c in text for c in ' ="\n\t'):
        return text
    return json.dumps(text)


def configure(verbose: bool, form: str) -> None:
    """Log to stderr at INFO (``verbose``) or WARNING, in ``form``; the worker's membership events
    (``rollout_journal.worker``) are shown without ``-v``, as a fleet operator wants them."""
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(JsonFormatter() if form == "json" else LogfmtFormatter())
    handler.set_name(_HANDLER)
    root = logging.getLogger()
    for old in [h for h in root.handlers if h.get_name() == _HANDLER]:  # ours from an earlier call, no other
        root.removeHandler(old)
    root.addHandler(handler)
    root.setLevel(logging.INFO if verbose else logging.WARNING)
    logging.getLogger(EVENTS).setLevel(logging.INFO)


EVENTS = "rollout_journal.worker"
_HANDLER = "rollout-journal"
