"""The embedded model: a tiny Llama in the standard Hugging Face layout, built in code.

``config.json`` (``LlamaForCausalLM``), ``model.safetensors`` with weights drawn from a
``torch.Generator`` seeded with ``weights_seed`` (not from ``transformers``' own
initialisation, which may change between versions), ``generation_config.json``, and a
byte-level BPE tokenizer trained offline (``tokenizer.json``, ``tokenizer_config.json``,
``chat_template.jinja``). The torch backend, vLLM in process and vLLM's server all load
this folder, exactly as they load a user's own model folder (``model.path``).

Built once per cache folder and reused: ``$ROLLOUT_JOURNAL_MODEL_CACHE`` if set (the
tests point it at one folder per test session), else the user's cache
(``$XDG_CACHE_HOME/rollout-journal/models``). A build goes to a temporary folder that
is renamed into place, so a process never sees half a model, and two processes building
at once both end with the same folder.
"""

from __future__ import annotations

import functools
import json
import shutil
import tempfile
from pathlib import Path
from typing import TYPE_CHECKING, Any

from rollout_journal.participants.model.folders import embedded_model_path
from rollout_journal.participants.model.tokenizer import (
    BOS,
    CHAT_TEMPLATE,
    END,
    PAD,
    ROLE_TOKENS,
    ChatTokenizer,
    train_bpe,
)

if TYPE_CHECKING:
    import torch

    from rollout_journal.participants.workload.config import ModelConfig


# Sizes the note on vLLM's CPU build measured: head size 32 is one vLLM's CPU attention supports.
HIDDEN, INTERMEDIATE, LAYERS, HEADS, KV_HEADS, MAX_POSITIONS = 128, 256, 2, 4, 2, 2048
INIT_STD = 0.2  # large enough that the argmax is rarely a near-tie between two tokens
# The output head's: logits of std ~1 (hidden states leave the final norm at unit scale), so
# sampled rollouts of one prompt still differ (0.2 here made nearly every seed pick one action).
HEAD_STD = 0.08


def model_folder(model: ModelConfig) -> Path:
    """The model folder every backend of a workload loads: ``model.path``, else the embedded
    model of its ``weights_seed`` (built on first use). Here, not on the config: the config is
    read back offline, and building the embedded model takes torch."""
    if model.path is not None:
        return Path(model.path).expanduser()
    return tiny_model_dir(model.weights_seed)


def tiny_model_dir(weights_seed: int = 0, root: str | Path | None = None) -> Path:
    """The embedded model's folder for ``weights_seed``, built on first use."""
    folder = embedded_model_path(weights_seed, root)
    if (folder / "config.json").is_file():
        return folder
    cache = folder.parent
    cache.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix=f".{folder.name}-", dir=cache))
    try:
        build_tiny_model(staging, weights_seed)
        try:
            staging.rename(folder)
        except OSError:
            if not (folder / "config.json").is_file():  # not another process's finished build
                raise
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    return folder


@functools.cache
def default_tokenizer() -> ChatTokenizer:
    """The embedded model's tokenizer (its folder is built and cached on first use)."""
    return ChatTokenizer.from_folder(tiny_model_dir())


def build_tiny_model(out: Path, weights_seed: int) -> None:
    """Write the tiny model's files into ``out`` (an existing, empty folder)."""
    import torch
    from safetensors.torch import save_file

    tokenizer = train_bpe()
    vocab = tokenizer.get_vocab_size(with_added_tokens=True)
    ids = {name: tokenizer.token_to_id(name) for name in (PAD, BOS, END)}
    tokenizer.save(str(out / "tokenizer.json"))
    tokenizer_config = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "bos_token": BOS,
        "eos_token": END,
        "pad_token": PAD,
        "additional_special_tokens": list(ROLE_TOKENS.values()),
        "model_max_length": MAX_POSITIONS,
        "clean_up_tokenization_spaces": False,
    }
    (out / "tokenizer_config.json").write_text(json.dumps(tokenizer_config, indent=2))
    (out / "special_tokens_map.json").write_text(
        json.dumps(
            {
                "bos_token": BOS,
                "eos_token": END,
                "pad_token": PAD,
                "additional_special_tokens": list(ROLE_TOKENS.values()),
            },
            indent=2,
        )
    )
    (out / "chat_template.jinja").write_text(CHAT_TEMPLATE)
    config = llama_config(vocab, MAX_POSITIONS, ids[BOS], ids[END], ids[PAD])
    (out / "config.json").write_text(json.dumps(config, indent=2))
    (out / "generation_config.json").write_text(
        json.dumps({"bos_token_id": ids[BOS], "eos_token_id": ids[END], "pad_token_id": ids[PAD]}, indent=2)
    )
    generator = torch.Generator().manual_seed(weights_seed)
    save_file(_weights(config, generator), str(out / "model.safetensors"), metadata={"format": "pt"})


def llama_config(
    vocab: int, max_positions: int, bos_id: int | None, eos_id: int | None | list[int | None], pad_id: int | None
) -> dict[str, Any]:
    """The transformers config of every embedded model (the tiny one and the chat-template
    families): a small Llama of this module's shape, its special ids its tokenizer's."""
    return {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "vocab_size": vocab,
        "hidden_size": HIDDEN,
        "intermediate_size": INTERMEDIATE,
        "num_hidden_layers": LAYERS,
        "num_attention_heads": HEADS,
        "num_key_value_heads": KV_HEADS,
        "head_dim": HIDDEN // HEADS,
        "max_position_embeddings": max_positions,
        "hidden_act": "silu",
        "rms_norm_eps": 1e-6,
        "rope_theta": 10000.0,
        "attention_bias": False,
        "mlp_bias": False,
        "tie_word_embeddings": False,
        "initializer_range": INIT_STD,
        "torch_dtype": "float32",
        "dtype": "float32",
        "use_cache": True,
        "bos_token_id": bos_id,
        "eos_token_id": eos_id,
        "pad_token_id": pad_id,
    }


def _weights(config: dict[str, Any], generator: torch.Generator) -> dict[str, torch.Tensor]:
    """Every tensor of ``LlamaForCausalLM`` for ``config``, in a fixed order, from ``generator``:
    norms are ones, every matrix is normal(0, ``INIT_STD``), the output head normal(0, ``HEAD_STD``)."""
    import torch

    h, inter, vocab = config["hidden_size"], config["intermediate_size"], config["vocab_size"]
    head_dim = config["head_dim"]
    q_out, kv_out = config["num_attention_heads"] * head_dim, config["num_key_value_heads"] * head_dim

    def matrix(rows: int, cols: int, std: float = INIT_STD) -> torch.Tensor:
        return torch.empty(rows, cols).normal_(0.0, std, generator=generator)

    tensors = {"model.embed_tokens.weight": matrix(vocab, h)}
    for i in range(config["num_hidden_layers"]):
        p = f"model.layers.{i}."
        tensors |= {
            p + "self_attn.q_proj.weight": matrix(q_out, h),
            p + "self_attn.k_proj.weight": matrix(kv_out, h),
            p + "self_attn.v_proj.weight": matrix(kv_out, h),
            p + "self_attn.o_proj.weight": matrix(h, q_out),
            p + "mlp.gate_proj.weight": matrix(inter, h),
            p + "mlp.up_proj.weight": matrix(inter, h),
            p + "mlp.down_proj.weight": matrix(h, inter),
            p + "input_layernorm.weight": torch.ones(h),
            p + "post_attention_layernorm.weight": torch.ones(h),
        }
    tensors["model.norm.weight"] = torch.ones(h)
    tensors["lm_head.weight"] = matrix(vocab, h, HEAD_STD)
    return tensors
