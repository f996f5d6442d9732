"""Tokenizers: the embedded model's byte-level BPE, trained offline in code, and
``ChatTokenizer``, which reads any Hugging Face model folder's tokenizer.

Training: every process trains the embedded tokenizer from the same in-code corpus
with the same settings and gets the same vocabulary and merges, so the model folder
built from it (``rollout_journal.participants.model.tiny_model``, which imports this module and
never the other way round) is the same on every machine.

``ChatTokenizer`` loads ``tokenizer.json`` with ``tokenizers`` and renders the
folder's own Jinja chat template (``chat_template.jinja`` or the one inside
``tokenizer_config.json``) exactly as ``transformers``' ``apply_chat_template`` does
(messages as dicts with ``tool_calls``, ``tools=``, the named special tokens as template
variables, ``tojson`` with its keyword arguments, ``strftime_now``, ``raise_exception``),
without importing ``transformers``: reading a journal needs a tokenizer, not a model.
Token ids are ``np.int32`` arrays.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Iterable, Mapping, Sequence
from datetime import datetime
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol

import numpy as np
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

from rollout_journal.journal.errors import ConfigurationError

if TYPE_CHECKING:
    from jinja2 import Template

PAD, BOS, END = "<|pad|>", "<|bos|>", "<|end|>"
ROLE_TOKENS: dict[str, str] = {
    "system": "<|system|>",
    "user": "<|user|>",
    "assistant": "<|assistant|>",
    "tool": "<|tool|>",
}
# Order fixes the ids: <|pad|>=0, <|bos|>=1, <|end|>=2 (the eos: it ends every message), then the role tags.
SPECIAL_TOKENS: tuple[str, ...] = (PAD, BOS, END, *ROLE_TOKENS.values())
DEFAULT_VOCAB_SIZE = 512

# A message renders as <|role|> + content + <|end|>; the generation prompt is <|assistant|>.
# Appending a message only appends token ids (each message is closed by a special token,
# so BPE never merges across the boundary), and a reply generated after the generation
# prompt that ends in <|end|> is token for token the rendering of that reply.
CHAT_TEMPLATE = (
    "{%- for message in messages -%}"
    "{{ '<|' + message['role'] + '|>' + message['content'] + '<|end|>' }}"
    "{%- endfor -%}"
    "{%- if add_generation_prompt -%}{{ '<|assistant|>' }}{%- endif -%}"
)

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


def train_bpe(corpus: str = DEFAULT_CORPUS, vocab_size: int = DEFAULT_VOCAB_SIZE) -> Tokenizer:
    """Train the embedded byte-level BPE; the same corpus and size give the same JSON."""
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
    return tok


# What transformers (v5) passes a chat template besides messages and tools: the named special
# tokens that are set (``PreTrainedTokenizerBase.special_tokens_map``).
SPECIAL_TOKEN_ATTRIBUTES = (
    "bos_token",
    "eos_token",
    "unk_token",
    "sep_token",
    "pad_token",
    "cls_token",
    "mask_token",
)


class TemplateMessage(Protocol):
    """A message object the renderer accepts besides a plain dict (``ChatMessage``)."""

    def as_template_dict(self) -> dict[str, Any]: ...


class ModelFolderError(ConfigurationError):
    """A model folder lacks what a backend needs (a tokenizer, a chat template, a config)."""


class ChatTokenizer:
    """A model folder's tokenizer and chat template; ids are ``np.int32`` arrays.

    ``encode`` treats special-token strings inside text as plain bytes, so an action
    or a tool's output cannot forge a role tag. ``chat_prompt`` renders messages with
    the folder's chat template and tokenizes the text as the model's server does
    (special tokens recognised), so its ids equal what vLLM's chat endpoint builds.
    """

    def __init__(
        self,
        tokenizer_json: str,
        config: dict[str, Any],
        chat_template: str,
        source: str = "",
        generation_eos: Sequence[int] = (),
    ) -> None:
        """``generation_eos``: the model's end-of-generation ids besides the tokenizer's eos
        (``generation_config.json``'s ``eos_token_id`` list): a sample ending in one ends its turn."""
        self.source = source
        self._tok = Tokenizer.from_str(tokenizer_json)  # chat text: special tokens recognised
        self._plain = Tokenizer.from_str(tokenizer_json)  # plain text: special-token strings stay bytes
        self._plain.encode_special_tokens = True
        self._config = config
        self.chat_template = chat_template
        self.eos_token = _token_text(config.get("eos_token"))
        self.bos_token = _token_text(config.get("bos_token"))
        eos_id = None if self.eos_token is None else self._tok.token_to_id(self.eos_token)
        if eos_id is None:
            raise ModelFolderError(
                f"tokenizer of {source or 'the model'} names no eos token it knows "
                f"({self.eos_token!r}); set eos_token in tokenizer_config.json"
            )
        self.eos_id: int = eos_id
        self.eos_ids: frozenset[int] = frozenset({eos_id, *(int(i) for i in generation_eos)})
        self.vocab_size: int = self._tok.get_vocab_size(with_added_tokens=True)
        self.special_ids: frozenset[int] = frozenset(
            i for i, t in self._tok.get_added_tokens_decoder().items() if t.special
        )
        self.template_variables: dict[str, str] = {
            key: text for key in SPECIAL_TOKEN_ATTRIBUTES if (text := _token_text(config.get(key))) is not None
        }
        digest = hashlib.sha256(tokenizer_json.encode("utf-8"))
        digest.update(chat_template.encode("utf-8"))
        self.fingerprint: str = digest.hexdigest()
        self._template = _compile_template(chat_template)

    @classmethod
    def from_folder(cls, folder: str | Path) -> ChatTokenizer:
        """Read ``tokenizer.json``, ``tokenizer_config.json`` and the chat template of a model folder."""
        path = Path(folder)
        tokenizer_file, config_file = path / "tokenizer.json", path / "tokenizer_config.json"
        if not tokenizer_file.is_file():
            raise ModelFolderError(
                f"model folder {path} has no tokenizer.json (a fast tokenizer is needed; "
                "save one with PreTrainedTokenizerFast.save_pretrained)"
            )
        config = json.loads(config_file.read_text(encoding="utf-8")) if config_file.is_file() else {}
        template_file = path / "chat_template.jinja"
        template = template_file.read_text(encoding="utf-8") if template_file.is_file() else config.get("chat_template")
        if not isinstance(template, str) or not template:
            raise ModelFolderError(
                f"model folder {path} has no chat template (chat_template.jinja, or "
                "chat_template in tokenizer_config.json): prompts are built with it"
            )
        return cls(
            tokenizer_file.read_text(encoding="utf-8"),
            config,
            template,
            source=str(path),
            generation_eos=_generation_eos(path),
        )

    def encode(self, text: str) -> np.ndarray:
        """Token ids of plain text (no special tokens added or recognised)."""
        return np.asarray(self._plain.encode(text, add_special_tokens=False).ids, dtype=np.int32)

    def decode(self, ids: Sequence[int] | np.ndarray, skip_special_tokens: bool = True) -> str:
        plain = ids.tolist() if isinstance(ids, np.ndarray) else [int(i) for i in ids]  # tolist: C, not a loop
        return self._tok.decode(plain, skip_special_tokens=skip_special_tokens)

    def render(
        self,
        messages: Sequence[Mapping[str, Any] | TemplateMessage],
        tools: Sequence[Mapping[str, Any]] | None = None,
        add_generation_prompt: bool = True,
        **template_kwargs: Any,
    ) -> str:
        """The chat template's text for ``messages``, as ``transformers``'
        ``apply_chat_template(messages, tools=tools, add_generation_prompt=..., tokenize=False,
        **template_kwargs)`` renders it. A message is a dict in OpenAI's shape or a ``ChatMessage``."""
        return self._template.render(
            messages=[m.as_template_dict() if hasattr(m, "as_template_dict") else dict(m) for m in messages],
            tools=None if tools is None else [dict(t) for t in tools],
            documents=None,
            add_generation_prompt=add_generation_prompt,
            **(self.template_variables | template_kwargs),
        )

    def render_ids(
        self,
        messages: Sequence[Mapping[str, Any] | TemplateMessage],
        tools: Sequence[Mapping[str, Any]] | None = None,
        add_generation_prompt: bool = True,
        **template_kwargs: Any,
    ) -> np.ndarray:
        """Ids of :meth:`render`'s text, tokenized as the model's server does (special tokens in
        the template's text recognised): ``apply_chat_template(..., tokenize=True)``."""
        return self.chat_ids(self.render(messages, tools, add_generation_prompt, **template_kwargs))

    def chat_ids(self, text: str) -> np.ndarray:
        """Ids of template text (special-token strings recognised as the special tokens)."""
        return np.asarray(self._tok.encode(text, add_special_tokens=False).ids, dtype=np.int32)

    def render_chat(self, messages: Iterable[tuple[str, str]], add_generation_prompt: bool = True) -> str:
        """The chat template's text for ``(role, content)`` messages."""
        return self.render(
            [{"role": role, "content": content} for role, content in messages], None, add_generation_prompt
        )

    def chat_prompt(self, messages: Iterable[tuple[str, str]], add_generation_prompt: bool = True) -> np.ndarray:
        """Ids of the rendered chat of ``(role, content)`` messages (special tokens recognised)."""
        return self.chat_ids(self.render_chat(messages, add_generation_prompt))


def _token_text(value: object) -> str | None:
    """A special token as tokenizer_config.json writes it: a string or ``{"content": ...}``."""
    if isinstance(value, dict):
        value = value.get("content")
    return value if isinstance(value, str) else None


def _generation_eos(folder: Path) -> list[int]:
    """``eos_token_id`` of the folder's ``generation_config.json`` (else ``config.json``), as a list."""
    for name in ("generation_config.json", "config.json"):
        file = folder / name
        if file.is_file():
            try:
                eos = json.loads(file.read_text(encoding="utf-8")).get("eos_token_id")
            except ValueError:
                continue
            if eos is not None:
                return [int(i) for i in (eos if isinstance(eos, list) else [eos])]
    return []


def _compile_template(template: str) -> Template:
    """The template compiled as ``transformers`` compiles chat templates (sandboxed Jinja,
    ``trim_blocks``/``lstrip_blocks``, loop controls; ``raise_exception``, ``strftime_now`` and a
    ``tojson`` that does not escape HTML and takes ``ensure_ascii``, ``indent``, ``separators``,
    ``sort_keys``). A template that calls ``strftime_now`` renders another prompt on another day:
    templates shipped here take a fixed date instead, so a redone turn renders what the lost one did."""
    from jinja2.exceptions import TemplateError
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    def raise_exception(message: str) -> None:
        raise TemplateError(message)

    def tojson(
        value: object,
        ensure_ascii: bool = False,
        indent: int | None = None,
        separators: tuple[str, str] | None = None,
        sort_keys: bool = False,
    ) -> str:
        return json.dumps(value, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)

    def strftime_now(format: str) -> str:
        return datetime.now().strftime(format)

    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True, extensions=["jinja2.ext.loopcontrols"])
    env.filters["tojson"] = tojson
    env.globals["raise_exception"] = raise_exception
    env.globals["strftime_now"] = strftime_now
    return env.from_string(template)
