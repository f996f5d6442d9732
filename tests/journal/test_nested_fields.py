"""Which fields of a record hold nested records is read from each field's own type: a new record
may name a field as another record names its nested one (``attempts``, ``messages``) and hold
something else there, and the codec plans it as what it is."""

from __future__ import annotations

from dataclasses import dataclass

from rollout_journal.journal.codec import _Kind, _plan
from rollout_journal.journal.events import EVENT_TYPES, BlobRef, ChatMessage, FenceEntry, Header, nested_fields


@dataclass(frozen=True)
class _Probe:
    header: Header
    attempts: int  # FenceHistory's ``attempts`` is a list of FenceEntry: this one is a count
    blob: BlobRef | None
    messages: list[str]  # an event's ``messages`` are ChatMessages: these are strings
    entries: list[FenceEntry]


def test_nested_fields_come_from_each_fields_type_not_its_name() -> None:
    assert nested_fields(_Probe) == {"header": (Header, False), "blob": (BlobRef, False), "entries": (FenceEntry, True)}
    kinds = {plan.name: plan.kind for plan in _plan(_Probe)}
    assert kinds == {
        "header": _Kind.NESTED,
        "attempts": _Kind.PLAIN,
        "blob": _Kind.NESTED,
        "messages": _Kind.PLAIN,
        "entries": _Kind.NESTED_LIST,
    }


def test_every_record_keeps_the_nested_fields_its_schema_has() -> None:
    """The journal's own records: each nested field by its type (ChatMessage lists included)."""
    seen = {name: kind for cls in EVENT_TYPES for name, kind in nested_fields(cls).items()}
    assert seen["header"] == (Header, False) and seen["messages"] == (ChatMessage, True)
    assert seen["attempts"] == (FenceEntry, True)
