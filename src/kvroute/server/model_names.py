"""The answer to an aliased request names the model the client asked for; an unknown model's 404
lists what is served and is logged.

An alias (api/model_aliases.py) sends ``claude-sonnet-…`` to a worker as ``qwen3-4b``; the worker
answers ``"model":"qwen3-4b"``.  ``AnswerRename`` puts the asked name back, only on requests an
alias or the default model changed (others pay nothing):

* an event stream is relayed in whole events; in each, ``"model":"<served>"`` (and the one-space
  form ``"model": "<served>"``) becomes the asked name.  Inside a JSON string quotes are escaped,
  so the sequence can only be a ``model`` key with exactly that value: the chunk's or message's
  model (OpenAI chunks, Anthropic ``message_start``, Responses ``response.*`` events), never text.
* a plain JSON answer is read whole, its top-level ``model`` replaced, and sent with its new length.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Iterable

import orjson

# A 404's list of served models stops here (a fleet with many LoRA adapters serves hundreds).
_MAX_LISTED = 20
_MAX_NAME = 100


class AnswerRename:
    """Rewrites a worker's answer for ``target`` to name ``asked`` instead."""

    __slots__ = ("_compact", "_compact_to", "_spaced", "_spaced_to", "asked", "target")

    def __init__(self, asked: str, target: str) -> None:
        self.asked = asked
        self.target = target
        quoted_target, quoted_asked = orjson.dumps(target), orjson.dumps(asked)
        self._compact = b'"model":' + quoted_target
        self._compact_to = b'"model":' + quoted_asked
        self._spaced = b'"model": ' + quoted_target
        self._spaced_to = b'"model": ' + quoted_asked

    def events(self, chunk: bytes) -> bytes:
        """Whole SSE events with every ``model`` field naming the target renamed."""
        return chunk.replace(self._compact, self._compact_to).replace(self._spaced, self._spaced_to)

    def document(self, body: bytes) -> bytes:
        """A whole JSON answer with its top-level ``model`` renamed; anything else (not JSON,
        another model, an error body) unchanged."""
        try:
            doc = orjson.loads(body)
        except orjson.JSONDecodeError:
            return body
        if not isinstance(doc, dict) or doc.get("model") != self.target:
            return body
        doc["model"] = self.asked
        try:
            return orjson.dumps(doc)
        except orjson.JSONEncodeError:  # nested deeper than orjson writes: leave it as it came
            return body


def served_models(model_sets: Iterable[Iterable[str]]) -> list[str]:
    """The names workers list as served, sorted, each once."""
    return sorted({m for models in model_sets for m in models})


def unknown_model_message(asked: str, target: str, served: list[str]) -> str:
    """The 404's message: the name asked (and what an alias made of it), and what is served."""
    shown = ", ".join(f"`{m}`" for m in served[:_MAX_LISTED])
    if len(served) > _MAX_LISTED:
        shown += f" and {len(served) - _MAX_LISTED} more"
    mapped = f" (mapped to `{target}`)" if target != asked else ""
    return (f"The model `{asked}`{mapped} does not exist. This router serves: {shown or 'no model yet'} "
            "(GET /v1/models).")


class UnknownModelLog:
    """One warning line for a request naming a model nothing serves, at most every ``interval_s``
    (the rest counted into the next line): the operator learns which names clients ask for without
    a flood.  Never the prompt; the name is shortened."""

    def __init__(self, logger: logging.Logger, interval_s: float = 10.0,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self._log = logger
        self._interval = interval_s
        self._clock = clock
        self._next = 0.0
        self._quiet = 0

    def unknown(self, route: str, asked: str, target: str, served: list[str]) -> None:
        """A request on ``route`` for ``asked`` (``target`` after the aliases) was answered 404."""
        now = self._clock()
        if now < self._next:
            self._quiet += 1
            return
        self._next = now + self._interval
        more = f"; {self._quiet} more such requests since the last line" if self._quiet else ""
        self._quiet = 0
        mapped = f" (mapped to {target[:_MAX_NAME]!r})" if target != asked else ""
        self._log.warning(
            "unknown model %r%s on %s answered 404: no worker serves it (served: %s)%s; map it with "
            "--model-alias PATTERN=MODEL or default_model", asked[:_MAX_NAME], mapped, route,
            ", ".join(served[:_MAX_LISTED]) or "none yet", more)
