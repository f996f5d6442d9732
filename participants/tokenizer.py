"""The embedded chat tokenizer: a small byte-level BPE trained offline, in code.

Every process trains it from the same in-code corpus with the same settings and
gets the same vocabulary and merges (the suite checks this across processes), so
token ids written to a journal by one worker mean the same thing to the worker
that restores them. Training takes tens of milliseconds, so there is no disk
cache to go stale: ``default_tokenizer()`` trains once per process and memoises.

Chat rendering is prefix-stable by construction: a message renders as
``<|role|> + encode(content) + <eos>`` and a conversation is the concatenation
of its rendered messages, so appending a message only appends token ids. An
assistant reply generated after ``generation_prompt()`` and ending in ``<eos>``
is token-for-token the rendering of that reply as a message.
"""

from __future__ import annotations

import functools
import hashlib
import json
from collections.abc import Iterable, Sequence
from pathlib import Path

import numpy as np
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

PAD, BOS, EOS = "<pad>", "<bos>", "<eos>"
ROLE_TOKENS: dict[str, str] = {
    "system": "<|system|>",
    "user": "<|user|>",
    "assistant": "<|assistant|>",
    "tool": "<|tool|>",
}
# Order fixes the ids: <pad>=0, <bos>=1, <eos>=2, then the role tags.
SPECIAL_TOKENS: tuple[str, ...] = (PAD, BOS, EOS, *ROLE_TOKENS.values())
DEFAULT_VOCAB_SIZE = 512

_PROSE = """\
You are a workplace assistant. You can read and send mail, manage the calendar,
and look up or update customer records. Use exactly one tool call per turn.
When the task is done, reply with a short summary for the user.

Mail: the inbox holds messages with an id, a sender, a subject and a body.
Alice asked to move the weekly meeting to Thursday at 10:00. Bob sent the
quarterly report and wants feedback before Friday. Carol forwarded an invoice
from the customer Acme Corp; the amount is 1250.00 and it is due on 2024-03-15.
Please reply to Dave with the agenda for the project review. Archive the
newsletter and flag the message from the support team as important.

Calendar: events have a title, a start time, an end time and a list of
attendees. Schedule a meeting with Alice and Bob tomorrow at 14:30 for one hour.
Cancel the standup on Monday. Find a free slot next week for the design review.
The room booking for the all-hands meeting is confirmed for 09:00 on Tuesday.

Customer records: each customer has an id, a name, an email address, a phone
number, a status (active, paused or closed) and a balance. Update the email of
customer 42 to carol@example.com. Look up the record for Acme Corp and check
whether the account is active. Set the status of customer 17 to paused and add
a note that the invoice was disputed. Search records where the balance is above
1000 and the region is north.

The user says: I missed the meeting yesterday, can you send me the notes?
The assistant says: I found the notes in the mail from Bob and forwarded them.
The tool returned: ok, message sent, id 318.
The tool returned: error, no such customer, id 999.
The tool returned: 3 events found between 2024-03-11 and 2024-03-15.
"""

_PYTHON = '''\
def send_mail(to: str, subject: str, body: str = "") -> dict:
    """Send one message and return its id."""
    message = {"to": to, "subject": subject, "body": body}
    return {"status": "ok", "id": len(outbox) + 1}


class Calendar:
    def __init__(self) -> None:
        self.events: list[dict] = []

    def add_event(self, title: str, start: str, end: str) -> int:
        self.events.append({"title": title, "start": start, "end": end})
        return len(self.events) - 1

    def find_free_slot(self, day: str, minutes: int = 30) -> str | None:
        for event in sorted(self.events, key=lambda e: e["start"]):
            if event["start"].startswith(day):
                continue
        return None


def update_record(records: dict, customer_id: int, **fields) -> dict:
    record = records[customer_id]
    for key, value in fields.items():
        if key not in record:
            raise KeyError(f"unknown field {key!r} for customer {customer_id}")
        record[key] = value
    return record

import json
result = json.loads(response)
if result["status"] != "ok":
    raise RuntimeError(result.get("error", "tool call failed"))
'''

_PEOPLE = ("alice", "bob", "carol", "dave", "erin", "frank")
_SUBJECTS = ("meeting", "report", "invoice", "agenda", "notes", "review")
_DAYS = ("monday", "tuesday", "wednesday", "thursday", "friday")


def _tool_call_lines() -> list[str]:
    """Templated tool calls, in a fixed order so the corpus never varies."""
    lines: list[str] = []
    for i, person in enumerate(_PEOPLE):
        subject = _SUBJECTS[i % len(_SUBJECTS)]
        day = _DAYS[i % len(_DAYS)]
        lines += [
            f"mail.send(to={person}, subject={subject})",
            f"mail.read(id={i + 1})",
            f"mail.reply(id={i + 3}, body=thanks {person})",
            f"mail.search(sender={person})",
            f"calendar.create(title={subject}, day={day}, time=1{i}:00)",
            f"calendar.list(day={day})",
            f"calendar.cancel(id={i + 10})",
            f"records.get(id={40 + i})",
            f"records.update(id={40 + i}, status=active)",
            f"records.search(name={person})",
            f'{{"tool": "mail.send", "args": {{"to": "{person}", "subject": "{subject}"}}}}',
        ]
    lines += ["submit()", "done()", "noop()"]
    return lines


DEFAULT_CORPUS: str = "\n".join([_PROSE, _PYTHON, *_tool_call_lines()]) + "\n"


class ChatTokenizer:
    """Byte-level BPE tokenizer with role tags; ids are ``np.int32`` arrays.

    Special tokens appearing literally inside message text are encoded as plain
    bytes, never as control tokens, so user or tool text cannot forge a role
    tag or end a message early.
    """

    def __init__(self, tokenizer_json: str) -> None:
        self._json = tokenizer_json
        self._tok = Tokenizer.from_str(tokenizer_json)
        self._tok.encode_special_tokens = True
        ids = {name: self._tok.token_to_id(name) for name in SPECIAL_TOKENS}
        missing = [name for name, i in ids.items() if i is None]
        if missing:
            raise ValueError(f"tokenizer JSON lacks special tokens {missing}; build it with ChatTokenizer.train")
        self.pad_id: int = ids[PAD]
        self.bos_id: int = ids[BOS]
        self.eos_id: int = ids[EOS]
        self.role_ids: dict[str, int] = {role: ids[tag] for role, tag in ROLE_TOKENS.items()}
        self.vocab_size: int = self._tok.get_vocab_size(with_added_tokens=True)
        self.fingerprint: str = hashlib.sha256(tokenizer_json.encode("utf-8")).hexdigest()

    @classmethod
    def train(cls, corpus: str = DEFAULT_CORPUS, vocab_size: int = DEFAULT_VOCAB_SIZE) -> ChatTokenizer:
        """Train a fresh tokenizer; the same corpus and size give the same JSON."""
        tok = Tokenizer(models.BPE())
        tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
        tok.decoder = decoders.ByteLevel()
        trainer = trainers.BpeTrainer(
            vocab_size=vocab_size,
            min_frequency=2,
            special_tokens=list(SPECIAL_TOKENS),
            initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
            show_progress=False,
        )
        tok.train_from_iterator(corpus.splitlines(keepends=True), trainer=trainer)
        return cls(tok.to_str())

    def encode(self, text: str) -> np.ndarray:
        """Token ids of plain text (no special tokens added or recognised)."""
        return np.asarray(self._tok.encode(text, add_special_tokens=False).ids, dtype=np.int32)

    def decode(self, ids: Sequence[int] | np.ndarray, skip_special_tokens: bool = True) -> str:
        return self._tok.decode([int(i) for i in ids], skip_special_tokens=skip_special_tokens)

    def generation_prompt(self, role: str = "assistant") -> np.ndarray:
        """Ids that open a message for the model to complete (just the role tag)."""
        return np.asarray([self._role_id(role)], dtype=np.int32)

    def render_message(self, role: str, content: str) -> np.ndarray:
        """``<|role|> + encode(content) + <eos>``; the eos ends the message."""
        return np.concatenate(
            [self.generation_prompt(role), self.encode(content), np.asarray([self.eos_id], dtype=np.int32)]
        )

    def render_conversation(self, messages: Iterable[tuple[str, str]]) -> np.ndarray:
        """Concatenation of ``render_message`` over ``(role, content)`` pairs."""
        parts = [self.render_message(role, content) for role, content in messages]
        return np.concatenate(parts) if parts else np.zeros(0, dtype=np.int32)

    def to_hf_json(self) -> str:
        """The ``tokenizer.json`` text that HF ``tokenizers`` / vLLM load as is."""
        return self._json

    def save_hf(self, directory: str | Path, model_max_length: int = 2048) -> Path:
        """Write ``tokenizer.json`` + ``tokenizer_config.json`` for HF / vLLM loaders."""
        out = Path(directory)
        out.mkdir(parents=True, exist_ok=True)
        (out / "tokenizer.json").write_text(self._json, encoding="utf-8")
        config = {
            "tokenizer_class": "PreTrainedTokenizerFast",
            "bos_token": BOS,
            "eos_token": EOS,
            "pad_token": PAD,
            "model_max_length": model_max_length,
            "additional_special_tokens": list(ROLE_TOKENS.values()),
        }
        (out / "tokenizer_config.json").write_text(json.dumps(config, indent=2), encoding="utf-8")
        return out

    def _role_id(self, role: str) -> int:
        try:
            return self.role_ids[role]
        except KeyError:
            raise ValueError(f"unknown chat role {role!r}; expected one of {sorted(self.role_ids)}") from None


@functools.cache
def default_tokenizer() -> ChatTokenizer:
    """The process-wide default tokenizer, trained on first use."""
    return ChatTokenizer.train()
