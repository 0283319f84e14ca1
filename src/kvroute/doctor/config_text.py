"""Reading vLLM's textual renderings of its configuration.

vLLM prints settings in three shapes: Prometheus info labels (``enable_prefix_caching="True"``,
``num_cpu_blocks="None"``), the ``str(VllmConfig)`` dump (``model='x', kv_cache_dtype=fp8,
enable_prefix_caching=False, compilation_config={...}``) in its startup log and ``/server_info``,
and the ``non-default args: {...}`` Python dict at startup.  All three end up as a flat
name -> raw value mapping.
"""

from __future__ import annotations

import ast

_OPEN = "([{"
_CLOSE = ")]}"


def parse_bool(raw: object) -> bool | None:
    """``True``/``true``/``1`` -> True, ``False``/``false``/``0`` -> False, anything else None."""
    if isinstance(raw, bool):
        return raw
    text = str(raw).strip().strip("'\"").lower()
    if text in ("true", "1", "yes", "on"):
        return True
    if text in ("false", "0", "no", "off"):
        return False
    return None


def parse_int(raw: object) -> int | None:
    """An integer from ``1600``, ``"1,600"``, ``1600.0``; None for ``None``/empty/garbage."""
    if isinstance(raw, bool):
        return None
    if isinstance(raw, int):
        return raw
    text = str(raw).strip().strip("'\"").replace(",", "").replace("_", "")
    try:
        value = float(text)
    except ValueError:
        return None
    return int(value) if value.is_integer() else None


def parse_text(raw: object) -> str | None:
    """A setting as text, with vLLM's spellings of "unset" (``None``, ``null``, empty) as None."""
    if raw is None:
        return None
    text = str(raw).strip().strip("'\"")
    return None if text in ("", "None", "none_", "null") else text


def split_config_dump(text: str) -> dict[str, str]:
    """Top-level ``key=value`` pairs of a ``str(VllmConfig)`` rendering.

    Commas inside brackets or quotes do not split; nested values are returned as raw text.
    """
    pairs: dict[str, str] = {}
    depth = 0
    quote: str | None = None
    start = 0
    for i, ch in enumerate(text):
        if quote:
            if ch == quote:
                quote = None
        elif ch in "'\"":
            quote = ch
        elif ch in _OPEN:
            depth += 1
        elif ch in _CLOSE:
            depth = max(0, depth - 1)
        elif ch == "," and depth == 0:
            _add_pair(pairs, text[start:i])
            start = i + 1
    _add_pair(pairs, text[start:])
    return pairs


def _add_pair(pairs: dict[str, str], chunk: str) -> None:
    key, sep, value = chunk.partition("=")
    key = key.strip()
    if sep and key.isidentifier():
        pairs[key] = value.strip()


def parse_python_dict(text: str) -> dict[str, object] | None:
    """A Python dict literal as logged by vLLM (``non-default args: {...}``); None if not one."""
    try:
        value = ast.literal_eval(text.strip())
    except (ValueError, SyntaxError, MemoryError, RecursionError):
        return None
    return value if isinstance(value, dict) else None
