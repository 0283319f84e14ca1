"""A small real tokenizer folder for the local tokenizer's tests: a byte-level BPE trained here on a
few sentences (so merges cross word pieces as real ones do), ChatML's special tokens, and a chat
template that uses what transformers gives templates (tools through ``tojson``, ``bos_token``,
``raise_exception``)."""

from __future__ import annotations

import json
from pathlib import Path

CORPUS = [
    "The storage engine keeps pages in a buffer pool and writes a log before each page.",
    "You review pull requests for a storage engine; be terse and exact.",
    "What is the capital of France? Paris. And of Italy? Rome. 12345 67890",
    "def route(request): return min(workers, key=lambda w: w.load)  # tools, calls, results",
]

TEMPLATE = (
    "{{ bos_token }}"
    "{% if tools %}<|im_start|>system\nTools: {{ tools | tojson }}<|im_end|>\n{% endif %}"
    "{% for message in messages %}"
    "{% if message['role'] not in ['system', 'user', 'assistant', 'tool'] %}"
    "{{ raise_exception('unknown role ' + message['role']) }}{% endif %}"
    "<|im_start|>{{ message['role'] }}\n{{ message['content'] }}<|im_end|>\n"
    "{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


def write_tokenizer(folder: Path, template: str = TEMPLATE) -> Path:
    """The folder, holding ``tokenizer.json`` and ``tokenizer_config.json`` (with ``template``)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=400,
                                  special_tokens=["<|endoftext|>", "<|im_start|>", "<|im_end|>"],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    tokenizer.train_from_iterator(CORPUS * 4, trainer)
    folder.mkdir(parents=True, exist_ok=True)
    tokenizer.save(str(folder / "tokenizer.json"))
    config = {"bos_token": "<|im_start|>", "eos_token": {"content": "<|im_end|>", "special": True},
              "unk_token": "<|endoftext|>", "chat_template": template}
    (folder / "tokenizer_config.json").write_text(json.dumps(config))
    return folder
