"""Tiny model folders with real chat-template families, built in code.

No weights or tokenizers can be downloaded where the project is tested, yet token-in-token-out
must hold for the templates real models ship, not only for the embedded model's one-line
template. So this builds, per family, a folder in the standard Hugging Face layout like the
embedded model's (:mod:`rollout_journal.participants.model.tiny_model`: the same tiny Llama sizes
and weight draw), with a byte-level BPE trained offline that knows the family's special tokens
and the family's Jinja template (``templates/*.jinja``, written for this project in the spirit of
the originals):

``chatml``
    ``<|im_start|>role\\n...<|im_end|>\\n`` (Qwen2.5's spirit): tools as JSON lines inside
    ``<tools>`` in the system prompt, assistant calls as ``<tool_call>\\n{json}\\n</tool_call>``,
    runs of ``tool`` messages in one user turn as ``<tool_response>``. ``<tool_call>`` and the
    other tags are one token each and not special (``decode(skip_special_tokens=True)`` keeps them).
``chatml-think``
    The same template with ``drop_reasoning`` on (Qwen3's history rewrite: the ``<think>`` of
    assistant turns before the last user message is dropped from the render).
``llama3``
    ``<|begin_of_text|><|start_header_id|>role<|end_header_id|>\\n\\n...<|eot_id|>`` (Llama 3.1's
    spirit): tools as ``tojson(indent=4)`` in the system header, calls as bare
    ``{"name", "parameters"}`` JSON, results under the ``ipython`` header, text ``| trim``'d,
    a fixed date (no ``strftime_now``: a redone turn must render what the lost one did).

Folders are cached like the embedded model's (``family_model_dir``), under a name holding the
builder version, so a change of the builder never reuses an old folder.
"""

from __future__ import annotations

import json
import shutil
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from rollout_journal.participants.model.folders import model_cache_root
from rollout_journal.participants.model.tiny_model import _weights, llama_config
from rollout_journal.participants.model.tokenizer import DEFAULT_CORPUS

if TYPE_CHECKING:
    from tokenizers import Tokenizer

__all__ = ["FAMILIES", "Family", "build_family_model", "family_model_dir"]

FAMILY_BUILDER_VERSION = "family-v1"  # bump when a folder's content would change
# Longer than the embedded model's: a byte-level BPE of 640 ids spells a template's tool schemas in
# some 2,000 tokens, and a prompt beyond the context would be cut (the model would see less than the
# record says it saw). Rotary positions, so the weights are the same size.
FAMILY_MAX_POSITIONS = 8192
TEMPLATES = Path(__file__).parent / "templates"


@dataclass(frozen=True)
class Family:
    name: str
    template: str  # file in templates/
    special: tuple[str, ...]  # special tokens, ids 0.. in this order
    added: tuple[str, ...]  # non-special added tokens (one id each; decode keeps their text)
    bos: str | None
    eos: str
    pad: str
    extra_eos: tuple[str, ...] = ()  # generation_config's eos ids besides the tokenizer's eos
    template_defaults: tuple[tuple[str, bool], ...] = ()  # variables set at the template's top


_CHATML = Family(
    "chatml",
    "chatml.jinja",
    ("<|endoftext|>", "<|im_start|>", "<|im_end|>"),
    ("<tool_call>", "</tool_call>", "<tool_response>", "</tool_response>", "<think>", "</think>"),
    None,
    "<|im_end|>",
    "<|endoftext|>",
    ("<|endoftext|>",),
)
FAMILIES: dict[str, Family] = {
    "chatml": _CHATML,
    "chatml-think": Family(
        **{**_CHATML.__dict__, "name": "chatml-think", "template_defaults": (("drop_reasoning", True),)}
    ),
    "llama3": Family(
        "llama3",
        "llama3.jinja",
        (
            "<|begin_of_text|>",
            "<|end_of_text|>",
            "<|start_header_id|>",
            "<|end_header_id|>",
            "<|eot_id|>",
            "<|eom_id|>",
            "<|python_tag|>",
            "<|finetune_right_pad_id|>",
        ),
        (),
        "<|begin_of_text|>",
        "<|eot_id|>",
        "<|finetune_right_pad_id|>",
        ("<|end_of_text|>", "<|eom_id|>"),
    ),
}

# Lines the families' templates and tool calls write, so their BPE has merges for them.
_CHAT_CORPUS = (
    "\n".join(
        [
            '{"name": "mail.send", "arguments": {"to": "alice", "subject": "meeting"}}',
            '{"name": "calendar.create", "parameters": {"day": "tue", "hour": 10}}',
            '{"type": "function", "function": {"name": "records.get", "description": "Look up a record", '
            '"parameters": {"type": "object", "properties": {"id": {"type": "integer"}}, "required": ["id"]}}}',
            "Environment: ipython\nCutting Knowledge Date: December 2023\nToday Date: 26 Jul 2024",
            "You may call one or more functions. Their signatures are inside",
        ]
    )
    + "\n"
)


def family_template(family: Family) -> str:
    """The family's chat template as its folder holds it."""
    template = (TEMPLATES / family.template).read_text(encoding="utf-8")
    defaults = "".join(
        "{%- set " + k + " = " + ("true" if v else "false") + " %}\n" for k, v in family.template_defaults
    )
    return defaults + template


def _train_bpe(family: Family, vocab_size: int = 640) -> Tokenizer:
    from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        min_frequency=2,
        special_tokens=list(family.special),
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator((DEFAULT_CORPUS + _CHAT_CORPUS).splitlines(keepends=True), trainer=trainer)
    if family.added:
        tok.add_tokens([AddedToken(t, special=False, normalized=False) for t in family.added])
    return tok


def build_family_model(out: Path, family_name: str, weights_seed: int = 0) -> Path:
    """Write the folder of ``family_name`` into ``out`` (created if missing); returns ``out``."""
    import torch
    from safetensors.torch import save_file

    family = FAMILIES[family_name]
    out.mkdir(parents=True, exist_ok=True)
    tok = _train_bpe(family)
    tok.save(str(out / "tokenizer.json"))
    ids = {t: tok.token_to_id(t) for t in family.special}
    others = [t for t in family.special if t not in (family.eos, family.pad, family.bos)]
    tokenizer_config = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "eos_token": family.eos,
        "pad_token": family.pad,
        "bos_token": family.bos,
        "additional_special_tokens": others,
        "model_max_length": FAMILY_MAX_POSITIONS,
        "clean_up_tokenization_spaces": False,
    }
    (out / "tokenizer_config.json").write_text(json.dumps(tokenizer_config, indent=2))
    (out / "chat_template.jinja").write_text(family_template(family))
    eos_ids = [ids[family.eos], *(ids[t] for t in family.extra_eos)]
    bos_id = ids[family.bos] if family.bos else None
    config = llama_config(
        tok.get_vocab_size(with_added_tokens=True), FAMILY_MAX_POSITIONS, bos_id, eos_ids, ids[family.pad]
    )
    (out / "config.json").write_text(json.dumps(config, indent=2))
    generation = {"eos_token_id": eos_ids, "pad_token_id": ids[family.pad], "bos_token_id": bos_id}
    (out / "generation_config.json").write_text(json.dumps(generation, indent=2))
    generator = torch.Generator().manual_seed(weights_seed)
    save_file(_weights(config, generator), str(out / "model.safetensors"), metadata={"format": "pt"})
    return out


def family_model_dir(family_name: str, weights_seed: int = 0, root: str | Path | None = None) -> Path:
    """The folder of ``family_name`` for ``weights_seed``, built on first use (as ``tiny_model_dir``)."""
    if family_name not in FAMILIES:
        raise KeyError(f"no template family {family_name!r}; families: {', '.join(sorted(FAMILIES))}")
    cache = Path(root) if root is not None else model_cache_root()
    folder = cache / f"{FAMILY_BUILDER_VERSION}-{family_name}-seed{weights_seed}"
    if (folder / "config.json").is_file():
        return folder
    cache.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix=f".{folder.name}-", dir=cache))
    try:
        build_family_model(staging, family_name, weights_seed)
        try:
            staging.rename(folder)
        except OSError:
            if not (folder / "config.json").is_file():  # not another process's finished build
                raise
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    return folder
