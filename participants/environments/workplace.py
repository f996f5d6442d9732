"""A deterministic workplace-assistant environment (event_sourced): mail, calendar, CRM.

The task, drawn from ``task_seed``: a customer's contact asks by email to move
a meeting. The agent must read the request, cancel the old calendar event,
create the new one, email the contact a confirmation, update the CRM record's
next meeting, add the note "moved", mark the request read, and touch nothing
else. :meth:`WorkplaceEnvironment.verify` gives 1/7 per goal met, so partial
work earns partial reward. Every resource is a pure fold of its mutations.
"""

from __future__ import annotations

import copy
import random
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from rollout_journal.participants.environments.base import (
    SUBMIT,
    Environment,
    StepMutations,
    parse_kwargs,
    split_call,
)
from rollout_journal.participants.environments.tasks import Task
from rollout_journal.participants.resources import OperationRejectedError, Recovery, Resource

__all__ = [
    "Mailbox",
    "Calendar",
    "CustomerRecords",
    "WorkplaceTask",
    "WorkplaceEnvironment",
    "CUSTOMERS",
    "DAYS",
    "HOURS",
]

CUSTOMERS: dict[str, str] = {"acme": "alice", "globex": "bob", "initech": "carol", "umbrella": "dave", "hooli": "erin"}
DAYS: tuple[str, ...] = ("mon", "tue", "wed", "thu", "fri")
HOURS: tuple[int, ...] = tuple(range(9, 17))
CRM_FIELDS: tuple[str, ...] = ("next_meeting", "status")
NOTE_TEXTS: tuple[str, ...] = ("moved", "called")


def slot_name(day: str, hour: int) -> str:
    """``("tue", 10)`` -> ``"tue-10"``: the slot spelling used in subjects and the CRM."""
    return f"{day}-{hour}"


def _slot_order(slot: tuple[str, int]) -> tuple[int, int]:
    return DAYS.index(slot[0]), slot[1]


# ----------------------------------------------------------------- resources


# name, arguments, what it does: the functions its action strings call (submit() ends the episode)
WORKPLACE_TOOLS: tuple[tuple[str, tuple[str, ...], str], ...] = (
    ("mail.list", (), "List the inbox"),
    ("mail.search", ("q",), "Search mail by customer"),
    ("mail.read", ("id",), "Read one message"),
    ("mail.delete", ("id",), "Delete one message"),
    ("mail.send", ("to", "subject"), "Send a message"),
    ("calendar.list", (), "List the calendar's events"),
    ("calendar.free", ("day",), "Free hours of a day"),
    ("calendar.create", ("day", "hour", "with"), "Create an event"),
    ("calendar.cancel", ("id",), "Cancel an event"),
    ("crm.lookup", ("customer",), "Look up a customer record"),
    ("crm.update", ("customer", "next_meeting"), "Set a customer's next meeting"),
    ("crm.note", ("customer", "text"), "Add a note to a customer record"),
    ("submit", (), "End the task"),
)


def _tool(name: str, params: tuple[str, ...], doc: str) -> dict[str, Any]:
    return {
        "type": "function",
        "function": {
            "name": name,
            "description": doc,
            "parameters": {
                "type": "object",
                "properties": {p: {"type": "string"} for p in params},
                "required": list(params),
            },
        },
    }


class Mailbox(Resource):
    """Inbox and sent folder. Ops: send_email, delete_email, mark_read. Queries: list, search."""

    kind = "mailbox"
    recovery = Recovery.EVENT_SOURCED
    supports_export = True

    def __init__(self, resource_id: str, inbox: list[dict[str, Any]]) -> None:
        super().__init__(resource_id)
        self._initial = {"inbox": copy.deepcopy(inbox), "sent": [], "next_sent": 1}
        self._load_state(self._initial)

    @property
    def inbox(self) -> list[dict[str, Any]]:
        return copy.deepcopy(self._inbox)

    @property
    def sent(self) -> list[dict[str, Any]]:
        return copy.deepcopy(self._sent)

    def _find(self, op: str, email_id: str) -> dict[str, Any]:
        for email in self._inbox:
            if email["id"] == email_id:
                return email
        raise OperationRejectedError(
            f"mailbox {self.resource_id!r}: {op} found no inbox email {email_id!r}; list the inbox for valid ids"
        )

    def _apply(self, op: str, args: dict[str, Any]) -> dict[str, Any]:
        if op == "send_email":
            to, subject = self._arg(op, args, "to"), self._arg(op, args, "subject")
            body = self._arg(op, args, "body", str, default="")
            email_id = f"s{self._next_sent}"
            self._sent.append({"id": email_id, "to": to, "subject": subject, "body": body})
            self._next_sent += 1
            return {"id": email_id, "to": to, "subject": subject}
        if op == "delete_email":
            email = self._find(op, self._arg(op, args, "id"))
            self._inbox.remove(email)
            return {"id": email["id"], "deleted": True}
        if op == "mark_read":
            email = self._find(op, self._arg(op, args, "id"))
            email["read"] = True
            return {"id": email["id"], "read": True}
        raise self._unknown(op, ("send_email", "delete_email", "mark_read"))

    def _query(self, op: str, args: dict[str, Any]) -> dict[str, Any]:
        if op == "list":
            folder = self._arg(op, args, "folder", str, default="inbox")
            if folder not in ("inbox", "sent"):
                raise OperationRejectedError(f"mailbox {self.resource_id!r} has folders inbox and sent, not {folder!r}")
            return {"folder": folder, "emails": copy.deepcopy(self._inbox if folder == "inbox" else self._sent)}
        if op == "search":
            needle = self._arg(op, args, "q").lower()
            hits = [e for e in self._inbox + self._sent if any(needle in str(v).lower() for v in e.values())]
            return {"q": needle, "emails": copy.deepcopy(hits)}
        raise self._unknown(op, ("list", "search"))

    def _canonical_state(self) -> object:
        return {"inbox": self._inbox, "sent": self._sent, "next_sent": self._next_sent}

    def _load_state(self, state: Any) -> None:
        self._inbox = [dict(e) for e in state["inbox"]]
        self._sent = [dict(e) for e in state["sent"]]
        self._next_sent = int(state["next_sent"])

    def _reset(self) -> None:
        self._load_state(copy.deepcopy(self._initial))


class Calendar(Resource):
    """One work week of one-hour events. Ops: create_event, cancel_event. Queries: list, free."""

    kind = "calendar"
    recovery = Recovery.EVENT_SOURCED
    supports_export = True

    def __init__(self, resource_id: str, events: list[dict[str, Any]]) -> None:
        super().__init__(resource_id)
        self._initial = {"events": copy.deepcopy(events), "next_id": len(events) + 1}
        self._load_state(self._initial)

    @property
    def events(self) -> list[dict[str, Any]]:
        """All events in creation order, cancelled ones included."""
        return copy.deepcopy(self._events)

    def _confirmed(self) -> list[dict[str, Any]]:
        return sorted(
            (e for e in self._events if e["status"] == "confirmed"), key=lambda e: _slot_order((e["day"], e["hour"]))
        )

    def _apply(self, op: str, args: dict[str, Any]) -> dict[str, Any]:
        if op == "create_event":
            day, hour = self._arg(op, args, "day"), self._arg(op, args, "hour", int)
            who = self._arg(op, args, "with")
            title = self._arg(op, args, "title", str, default=f"meeting with {who}")
            if day not in DAYS or hour not in HOURS:
                raise OperationRejectedError(
                    f"calendar {self.resource_id!r}: {day} {hour}:00 is outside working hours ({DAYS[0]}-{DAYS[-1]}, {HOURS[0]}-{HOURS[-1]})"
                )
            if any(e["day"] == day and e["hour"] == hour for e in self._confirmed()):
                raise OperationRejectedError(
                    f"calendar {self.resource_id!r}: {day} {hour}:00 is already taken; query free slots first"
                )
            event = {
                "id": f"e{self._next_id}",
                "day": day,
                "hour": hour,
                "with": who,
                "title": title,
                "status": "confirmed",
            }
            self._events.append(event)
            self._next_id += 1
            return {"id": event["id"], "day": day, "hour": hour, "with": who}
        if op == "cancel_event":
            event_id = self._arg(op, args, "id")
            for event in self._events:
                if event["id"] == event_id and event["status"] == "confirmed":
                    event["status"] = "cancelled"
                    return {"id": event_id, "cancelled": True}
            raise OperationRejectedError(f"calendar {self.resource_id!r}: no confirmed event {event_id!r} to cancel")
        raise self._unknown(op, ("create_event", "cancel_event"))

    def _query(self, op: str, args: dict[str, Any]) -> dict[str, Any]:
        if op == "list":
            return {"events": copy.deepcopy(self._confirmed())}
        if op == "free":
            day = self._arg(op, args, "day")
            if day not in DAYS:
                raise OperationRejectedError(
                    f"calendar {self.resource_id!r}: unknown day {day!r}; use one of {', '.join(DAYS)}"
                )
            busy = {e["hour"] for e in self._confirmed() if e["day"] == day}
            return {"day": day, "free_hours": [h for h in HOURS if h not in busy]}
        raise self._unknown(op, ("list", "free"))

    def _canonical_state(self) -> object:
        return {"events": self._events, "next_id": self._next_id}

    def _load_state(self, state: Any) -> None:
        self._events = [dict(e) for e in state["events"]]
        self._next_id = int(state["next_id"])

    def _reset(self) -> None:
        self._load_state(copy.deepcopy(self._initial))


class CustomerRecords(Resource):
    """A small CRM: one record per customer. Ops: update_record, add_note. Query: lookup."""

    kind = "crm"
    recovery = Recovery.EVENT_SOURCED
    supports_export = True

    def __init__(self, resource_id: str, records: dict[str, dict[str, Any]]) -> None:
        super().__init__(resource_id)
        self._initial = {"records": copy.deepcopy(records)}
        self._load_state(self._initial)

    @property
    def records(self) -> dict[str, dict[str, Any]]:
        return copy.deepcopy(self._records)

    def _record(self, op: str, customer: str) -> dict[str, Any]:
        if customer not in self._records:
            raise OperationRejectedError(
                f"crm {self.resource_id!r}: {op} found no customer {customer!r}; known: {', '.join(sorted(self._records))}"
            )
        return self._records[customer]

    def _apply(self, op: str, args: dict[str, Any]) -> dict[str, Any]:
        if op == "update_record":
            customer, field, value = (self._arg(op, args, n) for n in ("customer", "field", "value"))
            record = self._record(op, customer)
            if field not in CRM_FIELDS:
                raise OperationRejectedError(
                    f"crm {self.resource_id!r}: field {field!r} cannot be updated; updatable: {', '.join(CRM_FIELDS)}"
                )
            old = record[field]
            record[field] = value
            return {"customer": customer, "field": field, "old": old, "new": value}
        if op == "add_note":
            customer, text = self._arg(op, args, "customer"), self._arg(op, args, "text")
            record = self._record(op, customer)
            record["notes"].append(text)
            return {"customer": customer, "notes": len(record["notes"])}
        raise self._unknown(op, ("update_record", "add_note"))

    def _query(self, op: str, args: dict[str, Any]) -> dict[str, Any]:
        if op == "lookup":
            customer = self._arg(op, args, "customer")
            return {"customer": customer, "record": copy.deepcopy(self._record(op, customer))}
        raise self._unknown(op, ("lookup",))

    def _canonical_state(self) -> object:
        return {"records": self._records}

    def _load_state(self, state: Any) -> None:
        self._records = {k: {**v, "notes": list(v["notes"])} for k, v in state["records"].items()}

    def _reset(self) -> None:
        self._load_state(copy.deepcopy(self._initial))


# ----------------------------------------------------------------- the task


@dataclass(frozen=True)
class WorkplaceTask:
    """Everything ``task_seed`` decides; the initial world is derived from it."""

    customer: str
    contact: str
    other_customer: str
    other_contact: str
    old_slot: tuple[str, int]
    new_slot: tuple[str, int]
    candidate_slots: tuple[tuple[str, int], ...]  # new slot + two distractors, in week order
    old_event_id: str
    request_email_id: str
    inbox: list[dict[str, Any]]  # handed out as copies only
    events: list[dict[str, Any]]
    records: dict[str, dict[str, Any]]

    @classmethod
    def from_seed(cls, task_seed: int) -> WorkplaceTask:
        rng = random.Random(task_seed)
        customer, other_customer = rng.sample(sorted(CUSTOMERS), 2)
        contact, other_contact = CUSTOMERS[customer], CUSTOMERS[other_customer]
        slots = [(d, h) for d in DAYS for h in HOURS]
        old, new, dist_a, dist_b, busy_a, busy_b = rng.sample(slots, 6)
        others = [c for c in sorted(CUSTOMERS) if c != customer]

        drafts: list[dict[str, Any]] = [
            {"with": customer, "slot": old},
            {"with": other_customer, "slot": busy_a},
            {"with": rng.choice(others), "slot": busy_b},
        ]
        rng.shuffle(drafts)
        events, old_event_id = [], ""
        for i, d in enumerate(drafts, start=1):
            events.append(
                {
                    "id": f"e{i}",
                    "day": d["slot"][0],
                    "hour": d["slot"][1],
                    "with": d["with"],
                    "title": f"meeting with {d['with']}",
                    "status": "confirmed",
                }
            )
            if d["slot"] == old:
                old_event_id = f"e{i}"

        mails: list[dict[str, Any]] = [
            {
                "from": contact,
                "subject": f"Moving our {customer} meeting",
                "body": f"Hi, can we move our {customer} meeting from {slot_name(*old)} to {slot_name(*new)}? Thanks, {contact}",
                "request": True,
            },
            {
                "from": other_contact,
                "subject": "Invoice question",
                "body": f"{other_customer} has a question about the last invoice; could we meet {slot_name(*dist_a)}?",
            },
            {"from": "hr", "subject": "Team lunch", "body": f"Team lunch is at {slot_name(*dist_b)}."},
        ]
        rng.shuffle(mails)
        inbox, request_id = [], ""
        for i, m in enumerate(mails, start=1):
            inbox.append({"id": f"m{i}", "from": m["from"], "subject": m["subject"], "body": m["body"], "read": False})
            if m.get("request"):
                request_id = f"m{i}"

        meetings = {d["with"]: slot_name(*d["slot"]) for d in drafts}
        records = {
            c: {"contact": CUSTOMERS[c], "next_meeting": meetings.get(c, "none"), "status": "active", "notes": []}
            for c in sorted(CUSTOMERS)
        }
        return cls(
            customer=customer,
            contact=contact,
            other_customer=other_customer,
            other_contact=other_contact,
            old_slot=old,
            new_slot=new,
            candidate_slots=tuple(sorted((new, dist_a, dist_b), key=_slot_order)),
            old_event_id=old_event_id,
            request_email_id=request_id,
            inbox=inbox,
            events=events,
            records=records,
        )

    def initial_inbox(self) -> list[dict[str, Any]]:
        return copy.deepcopy(self.inbox)

    def initial_events(self) -> list[dict[str, Any]]:
        return copy.deepcopy(self.events)

    def initial_records(self) -> dict[str, dict[str, Any]]:
        return copy.deepcopy(self.records)


# ----------------------------------------------------------------- the environment


class WorkplaceEnvironment(Environment):
    """Mail + calendar + CRM; every resource event-sourced. ~35 actions at the start."""

    name = "workplace"
    GOALS: tuple[str, ...] = (
        "old event cancelled",
        "new event created",
        "contact emailed",
        "crm next_meeting set",
        "crm note 'moved' added",
        "request marked read",
        "nothing else changed",
    )

    def __init__(self, rollout_id: str, task: Task | int) -> None:
        super().__init__(rollout_id, task)
        self.world = WorkplaceTask.from_seed(self.task_seed)
        self.mail = Mailbox(self.resource_id("mail"), self.world.initial_inbox())
        self.calendar = Calendar(self.resource_id("calendar"), self.world.initial_events())
        self.crm = CustomerRecords(self.resource_id("crm"), self.world.initial_records())
        for resource in (self.mail, self.calendar, self.crm):
            self._add_resource(resource)
        self._handlers: dict[str, Callable[[dict[str, str], StepMutations], str]] = {
            "mail.list": self._mail_list,
            "mail.search": self._mail_search,
            "mail.read": self._mail_read,
            "mail.delete": self._mail_delete,
            "mail.send": self._mail_send,
            "calendar.list": self._calendar_list,
            "calendar.free": self._calendar_free,
            "calendar.create": self._calendar_create,
            "calendar.cancel": self._calendar_cancel,
            "crm.lookup": self._crm_lookup,
            "crm.update": self._crm_update,
            "crm.note": self._crm_note,
        }

    def tools(self) -> list[dict[str, Any]]:
        """Its functions as JSON schemas (string arguments, as its action strings spell them)."""
        return [_tool(name, params, doc) for name, params, doc in WORKPLACE_TOOLS]

    def task_prompt(self) -> str:
        t = self.world
        return (
            f"{t.contact} from {t.customer} emailed you asking to move your {t.customer} meeting. "
            f"Read the request, then: cancel the old calendar event and create the new one with {t.customer}; "
            f"email {t.contact} a confirmation with subject meeting-<day>-<hour> of the new time; "
            f"set {t.customer}'s next_meeting in the CRM to the new time and add the note 'moved'; "
            f"mark {t.contact}'s email as read. Change nothing else, then call submit()."
        )

    def action_space(self) -> list[str]:
        t = self.world
        customers = sorted((t.customer, t.other_customer))
        contacts = sorted((t.contact, t.other_contact))
        inbox = self.mail._inbox
        confirmed = [e for e in self.calendar._events if e["status"] == "confirmed"]
        busy = {(e["day"], e["hour"]) for e in confirmed}
        days = sorted({d for d, _ in t.candidate_slots}, key=DAYS.index)
        actions = ["mail.list()"]
        actions += [f"mail.search(q={c})" for c in customers]
        actions += [f"mail.read(id={e['id']})" for e in inbox if not e["read"]]
        actions += [f"mail.delete(id={e['id']})" for e in inbox]
        actions += [f"mail.send(to={c}, subject=meeting-{slot_name(*s)})" for c in contacts for s in t.candidate_slots]
        actions += ["calendar.list()"]
        actions += [f"calendar.free(day={d})" for d in days]
        actions += [
            f"calendar.create(day={d}, hour={h}, with={t.customer})" for d, h in t.candidate_slots if (d, h) not in busy
        ]
        actions += [f"calendar.cancel(id={e['id']})" for e in confirmed]
        actions += [f"crm.lookup(customer={c})" for c in customers]
        actions += [f"crm.update(customer={t.customer}, next_meeting={slot_name(*s)})" for s in t.candidate_slots]
        actions += [f"crm.note(customer={c}, text={n})" for c in customers for n in NOTE_TEXTS]
        actions.append(SUBMIT)
        return actions

    def _perform(self, action: str, mutations: StepMutations) -> str:
        name, inner = split_call(action)
        return self._handlers[name](parse_kwargs(inner), mutations)

    # -- handlers ----------------------------------------------------------------
    @staticmethod
    def _render_email(e: dict[str, Any]) -> str:
        if "from" in e:
            flag = "read" if e["read"] else "unread"
            return f"{e['id']} [{flag}] from {e['from']}: {e['subject']} -- {e['body']}"
        return f"{e['id']} [sent] to {e['to']}: {e['subject']}"

    def _mail_list(self, kw: dict[str, str], m: StepMutations) -> str:
        emails = self.mail.query("list", {"folder": "inbox"})["emails"]
        return "\n".join(self._render_email(e) for e in emails) or "The inbox is empty."

    def _mail_search(self, kw: dict[str, str], m: StepMutations) -> str:
        emails = self.mail.query("search", {"q": kw["q"]})["emails"]
        return "\n".join(self._render_email(e) for e in emails) or f"No email mentions {kw['q']}."

    def _mail_read(self, kw: dict[str, str], m: StepMutations) -> str:
        m.apply(self.mail, "mark_read", {"id": kw["id"]})
        return f"Marked {kw['id']} as read."

    def _mail_delete(self, kw: dict[str, str], m: StepMutations) -> str:
        m.apply(self.mail, "delete_email", {"id": kw["id"]})
        return f"Deleted {kw['id']}."

    def _mail_send(self, kw: dict[str, str], m: StepMutations) -> str:
        result = m.apply(
            self.mail, "send_email", {"to": kw["to"], "subject": kw["subject"], "body": f"Confirming {kw['subject']}."}
        )
        return f"Sent {result['id']} to {kw['to']} with subject {kw['subject']}."

    def _calendar_list(self, kw: dict[str, str], m: StepMutations) -> str:
        events = self.calendar.query("list", {})["events"]
        return "\n".join(f"{e['id']}: {e['day']} {e['hour']}:00 with {e['with']}" for e in events) or "No events."

    def _calendar_free(self, kw: dict[str, str], m: StepMutations) -> str:
        free = self.calendar.query("free", {"day": kw["day"]})["free_hours"]
        return f"Free on {kw['day']}: " + ", ".join(f"{h}:00" for h in free)

    def _calendar_create(self, kw: dict[str, str], m: StepMutations) -> str:
        result = m.apply(self.calendar, "create_event", {"day": kw["day"], "hour": int(kw["hour"]), "with": kw["with"]})
        return f"Created {result['id']}: {kw['day']} {kw['hour']}:00 with {kw['with']}."

    def _calendar_cancel(self, kw: dict[str, str], m: StepMutations) -> str:
        m.apply(self.calendar, "cancel_event", {"id": kw["id"]})
        return f"Cancelled {kw['id']}."

    def _crm_lookup(self, kw: dict[str, str], m: StepMutations) -> str:
        r = self.crm.query("lookup", {"customer": kw["customer"]})["record"]
        notes = ", ".join(r["notes"]) or "none"
        return f"{kw['customer']}: contact {r['contact']}, next_meeting {r['next_meeting']}, status {r['status']}, notes: {notes}"

    def _crm_update(self, kw: dict[str, str], m: StepMutations) -> str:
        result = m.apply(
            self.crm,
            "update_record",
            {"customer": kw["customer"], "field": "next_meeting", "value": kw["next_meeting"]},
        )
        return f"{kw['customer']}.next_meeting: {result['old']} -> {result['new']}."

    def _crm_note(self, kw: dict[str, str], m: StepMutations) -> str:
        m.apply(self.crm, "add_note", {"customer": kw["customer"], "text": kw["text"]})
        return f"Added note {kw['text']!r} to {kw['customer']}."

    # -- reward ------------------------------------------------------------------
    def goals(self) -> dict[str, bool]:
        """Which task goals the current state meets (the reward's breakdown)."""
        t = self.world
        new = slot_name(*t.new_slot)
        subject = f"meeting-{new}"
        events = {e["id"]: e for e in self.calendar._events}
        initial_events = {e["id"] for e in t.initial_events()}
        inbox = {e["id"]: e for e in self.mail._inbox}
        record = self.crm._records[t.customer]

        def is_new_meeting(e: dict[str, Any]) -> bool:
            return e["with"] == t.customer and slot_name(e["day"], e["hour"]) == new

        initial_records = t.initial_records()
        untouched = (
            all(i in inbox for i in (m["id"] for m in t.initial_inbox()))
            and all(
                e["status"] == "confirmed" for i, e in events.items() if i in initial_events and i != t.old_event_id
            )
            and all(
                is_new_meeting(e) for i, e in events.items() if i not in initial_events and e["status"] == "confirmed"
            )
            and all(s["to"] == t.contact and s["subject"] == subject for s in self.mail._sent)
            and all(self.crm._records[c] == initial_records[c] for c in initial_records if c != t.customer)
        )
        met = [
            events[t.old_event_id]["status"] == "cancelled",
            any(e["status"] == "confirmed" and is_new_meeting(e) for e in events.values()),
            any(s["to"] == t.contact and s["subject"] == subject for s in self.mail._sent),
            record["next_meeting"] == new,
            "moved" in record["notes"],
            bool(inbox.get(t.request_email_id, {}).get("read")),
            untouched,
        ]
        return dict(zip(self.GOALS, met))

    def verify(self) -> float:
        met = self.goals()
        return sum(met.values()) / len(met)

    def solution(self) -> list[str]:
        """A shortest action sequence that earns reward 1.0 from the initial state."""
        t = self.world
        new = slot_name(*t.new_slot)
        return [
            f"mail.read(id={t.request_email_id})",
            f"calendar.cancel(id={t.old_event_id})",
            f"calendar.create(day={t.new_slot[0]}, hour={t.new_slot[1]}, with={t.customer})",
            f"mail.send(to={t.contact}, subject=meeting-{new})",
            f"crm.update(customer={t.customer}, next_meeting={new})",
            f"crm.note(customer={t.customer}, text=moved)",
            SUBMIT,
        ]
