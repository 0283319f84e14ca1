"""A replica that tokenizes with a model's own tokenizer and chat template (``kvroute sim
--tokenizer FOLDER``) instead of the pseudo-tokenizer of sim/tokenizer.py.

The engine model keeps working on 4-byte tokens: a prompt's bytes are its real token ids, one
little-endian ``uint32`` each, so token counts, block hashes, KV events and ``/tokenize`` carry the
real ids, and a router that tokenizes with the same folder (the per-model setting ``tokenizer``)
predicts exactly what the replica caches.  The rendering is api/local_tokens.py's, as vLLM 0.32
renders a request (tool calls and results included); what that module leaves to the engine
(media, ``continue_final_message``, a request's own ``chat_template``, ...) this replica answers
with a 400 that says so.  Replies are the simulator's filler text, counted at 4 bytes a token as
ever: their tokens are not the model's, as a real reply's re-tokenized next turn is not either.
"""

from __future__ import annotations

import struct
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from kvroute.api.local_tokens import ChatTokenizer
from kvroute.sim.tokenizer import PseudoTokens, RenderError, chat_template_options

_DECLINED = ("this request holds what the simulator's --tokenizer does not render (media or other "
             "non-text parts, continue_final_message, a request's own chat_template, ...)")


# Tokens decoded for the answers' question (which they look for in the last 512 bytes).
_TAIL_TOKENS = 256


def _packed(ids: Any) -> bytes:
    return struct.pack(f"<{len(ids)}I", *ids)


class RealTokens(PseudoTokens):
    """Prompts as a model's folder renders and tokenizes them, packed 4 bytes a token."""

    def __init__(self, folder: str | Path) -> None:
        self.folder = str(folder)
        self.tokenizer = ChatTokenizer(folder)

    def chat(self, body: Mapping[str, Any]) -> bytes:
        chat_template_options(body)  # vLLM's refusal of both at once, as the default renderer does
        add_special = body.get("add_special_tokens", False)
        text = self.tokenizer.render(body)
        if text is None or not isinstance(add_special, bool):
            raise RenderError(_DECLINED)
        return _packed(self.tokenizer.encode(text, add_special)[0])

    def anthropic(self, body: Mapping[str, Any]) -> bytes:
        chat = self.tokenizer.anthropic_chat(body)
        if chat is None:
            raise RenderError("the request is not one vLLM converts into a chat request (or names a "
                              "tool_use by its clock: one without an id)")
        return self.chat(chat)

    def completion(self, prompt: Any) -> bytes:
        if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], str | list):
            return self.completion(prompt[0])
        if isinstance(prompt, str):
            return _packed(self.tokenizer.prompt_tokens(prompt)[0])
        if isinstance(prompt, list) and prompt and all(isinstance(t, int) and 0 <= t < 2**32 for t in prompt):
            return _packed(prompt)
        raise RenderError("'prompt' must be a string or a list of token ids")

    def detokenize(self, ids: list[Any]) -> str:
        if not all(isinstance(t, int) and t >= 0 for t in ids):
            raise RenderError("invalid token id")
        return self.tokenizer.decode(ids)

    def token_strs(self, data: bytes) -> list[str]:
        ids = struct.unpack(f"<{len(data) // 4}I", data)
        return [self.tokenizer.decode([t]) for t in ids]

    def tail_text(self, prompt: bytes) -> bytes:
        tail = prompt[-4 * _TAIL_TOKENS:]
        return self.tokenizer.decode(struct.unpack(f"<{len(tail) // 4}I", tail)).encode()
