"""Routing settings as plain, validated data: one ``ModelPolicy`` per model plus index-wide limits.

A ``ModelPolicy`` is one instance of every registered settings block (routing/settings.py): the
placement rules every policy shares, the learned figures, and each policy's own block (``auto``'s
cost weights).  It reads flat (``policy.stay_tokens``) so that configuration files, the virtual-time
cluster's sweeps and the dashboard name a setting the same way, whichever block declares it.
"""

from __future__ import annotations

import dataclasses
import textwrap
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

from kvroute.routing.policies import BLOCKS, POLICIES
from kvroute.routing.settings import B, PlacementSettings, help_of


@dataclass(frozen=True, slots=True)
class SettingInfo:
    """One per-model setting: its name, the block that declares it, default and help."""

    name: str
    block: type
    default: Any
    help: str


def setting_infos() -> list[SettingInfo]:
    """Every per-model setting of every registered block, in declaration order."""
    return [SettingInfo(f.name, kind, f.default, help_of(f))
            for kind in BLOCKS for f in dataclasses.fields(kind)]


_index_cache: tuple[int, dict[str, type]] = (0, {})


def _field_index() -> dict[str, type]:
    global _index_cache
    if _index_cache[0] != len(BLOCKS):
        index: dict[str, type] = {}
        for kind in BLOCKS:
            for f in dataclasses.fields(kind):
                if f.name in index:
                    raise TypeError(f"setting {f.name!r} is declared by both {index[f.name].__name__} "
                                    f"and {kind.__name__}")
                index[f.name] = kind
        _index_cache = (len(BLOCKS), index)
    return _index_cache[1]


def policy_names() -> tuple[str, ...]:
    """The registered policies' names."""
    return tuple(POLICIES)


def policies_help() -> str:
    """One line per registered policy: its name and what it does (CLI help, docs)."""
    return "; ".join(f"{p.name}: {p.summary}" if p.summary else p.name for p in POLICIES.values())


def settings_markdown() -> str:
    """The per-model routing settings as the Markdown table docs/server.md shows (a test keeps the
    page equal to this)."""
    rows = ["| setting | default | declared by | meaning |", "|---|---|---|---|"]
    for i in setting_infos():
        default = "none" if i.default is None else (
            f"`{list(i.default)}`" if isinstance(i.default, tuple) else f"`{i.default!r}`".replace("'", '"'))
        rows.append(f"| `{i.name}` | {default} | `{i.block.__name__}` | {i.help} |")
    return "\n".join(rows) + "\n"


def settings_help(width: int = 100) -> str:
    """Every per-model routing setting with its default and what it does, under a heading per
    settings block (its docstring's first line), wrapped at ``width`` (``kvroute serve
    --help-settings``)."""
    lines: list[str] = []
    block: type | None = None
    for i in setting_infos():
        if i.block is not block:
            block = i.block
            title = (block.__doc__ or block.__name__).strip().splitlines()[0].replace("``", "")
            heading = textwrap.fill(title, width=width)
            lines += ["", heading] if lines else [heading]
        lines.append(textwrap.fill(f"{i.name} = {_toml_value(i.default)}: {i.help}", width=width,
                                   initial_indent="  ", subsequent_indent="      ", break_on_hyphens=False))
    return "\n".join(lines)


def _toml_value(value: Any) -> str:
    """A default as a config file spells it (``true``, ``"auto"``, ``[1, 2]``; none: no value)."""
    if value is None:
        return "none"
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, str):
        return f'"{value}"'
    if isinstance(value, tuple | list):
        return "[" + ", ".join(_toml_value(v) for v in value) + "]"
    return repr(value)


class ModelPolicy:
    """How requests for one model are routed: one validated instance of every settings block.

    ``ModelPolicy(policy="session", overflow=4)`` sets fields by name whatever block declares
    them; unknown names and invalid values raise ValueError naming them.  ``block(AutoSettings)``
    is what a stage reads; ``policy.stay_tokens`` reads any field flat.
    """

    __slots__ = ("_blocks", "placement")
    _blocks: dict[type, Any]
    placement: PlacementSettings

    def __init__(self, **settings: Any) -> None:
        index = _field_index()
        grouped: dict[type, dict[str, Any]] = {}
        for name, value in settings.items():
            kind = index.get(name)
            if kind is None:
                raise ValueError(f"unknown routing setting {name!r}")
            value = tuple(value) if isinstance(value, list) else value
            _check_kind(_fields_of(kind)[name], value)
            grouped.setdefault(kind, {})[name] = value
        blocks: dict[type, Any] = {}
        for kind in BLOCKS:
            try:
                blocks[kind] = kind(**grouped.get(kind, {}))
            except TypeError as exc:
                raise ValueError(str(exc)) from None
        placement: PlacementSettings = blocks[PlacementSettings]
        if placement.policy not in POLICIES:
            raise ValueError(f"unknown policy {placement.policy!r}; expected one of {', '.join(POLICIES)}")
        object.__setattr__(self, "_blocks", blocks)
        object.__setattr__(self, "placement", placement)

    def block(self, kind: type[B]) -> B:
        """This model's settings block ``kind`` (its defaults for a block registered later)."""
        found = self._blocks.get(kind)
        if found is None:
            found = self._blocks[kind] = kind()
        return found

    def __getattr__(self, name: str) -> Any:
        kind = _field_index().get(name)
        if kind is None:
            raise AttributeError(name)
        return getattr(self.block(kind), name)

    def __setattr__(self, name: str, value: Any) -> None:
        raise AttributeError("ModelPolicy is immutable; use replace()")

    def items(self) -> Iterator[tuple[str, Any]]:
        """(name, value) of every setting."""
        for kind in BLOCKS:
            block: Any = self.block(kind)
            for f in dataclasses.fields(kind):
                yield f.name, getattr(block, f.name)

    def as_dict(self) -> dict[str, Any]:
        """Every setting by name."""
        return dict(self.items())

    def replace(self, **changes: Any) -> ModelPolicy:
        """A copy with some settings changed (validated)."""
        return ModelPolicy(**{**self.as_dict(), **changes})

    def __eq__(self, other: object) -> bool:
        return isinstance(other, ModelPolicy) and self.as_dict() == other.as_dict()

    def __hash__(self) -> int:
        return hash(tuple(self.items()))

    def __repr__(self) -> str:
        changed = ", ".join(f"{k}={v!r}" for k, v in self.items() if v != _DEFAULTS.get(k, v))
        return f"ModelPolicy({changed})"

    def overflow_threshold(self, worker_max_num_seqs: int | None) -> int:
        """The placement block's overflow threshold for one worker."""
        return self.placement.overflow_threshold(worker_max_num_seqs)

    def slack_for(self, est_tokens: int) -> int:
        """The placement block's prompt-size slack."""
        return self.placement.slack_for(est_tokens)


_DEFAULTS: dict[str, Any] = {i.name: i.default for i in setting_infos()}


def _fields_of(kind: type) -> dict[str, dataclasses.Field[Any]]:
    return {f.name: f for f in dataclasses.fields(kind)}


def _check_kind(f: dataclasses.Field[Any], value: Any) -> None:
    """A number where the default is a number, a boolean where it is one, None only where the
    field allows it (each block checks its own ranges)."""
    default, name = f.default, f.name
    if value is None:
        if default is not None and "None" not in str(f.type):
            raise ValueError(f"{name} must be set")
    elif isinstance(default, bool):
        if not isinstance(value, bool):
            raise ValueError(f"{name} must be true or false, got {value!r}")
    elif isinstance(default, int | float) and (isinstance(value, bool) or not isinstance(value, int | float)):
        raise ValueError(f"{name} must be a number, got {value!r}")


@dataclass(frozen=True, slots=True)
class RoutingConfig:
    """Index, session-table and hashing limits shared by every model, plus per-model policies.

    ``window_bytes`` is the indexed window: every block in it is indexed.  With ``hash_beyond_window``
    the rest of the prompt (up to ``max_hash_bytes``) is hashed too, and a bounded sample of its
    blocks is stored: ``anchors_per_octave`` positions per doubling of the prompt length plus the
    last ``tail_blocks``; that is what tells apart conversations whose first 32 KB are identical.
    """

    default: ModelPolicy = field(default_factory=ModelPolicy)
    models: dict[str, ModelPolicy] = field(default_factory=dict)
    index_max_blocks: int = 200_000
    index_max_age_s: float = 5400.0
    block_bytes: int = 512
    window_bytes: int = 32768
    hash_beyond_window: bool = True
    max_hash_bytes: int = 4 * 1024 * 1024
    anchors_per_octave: int = 8
    tail_blocks: int = 16
    session_ttl_s: float = 3600.0
    session_max: int = 100_000
    seed: int = 0
    # Fleets larger than this are decided over the few workers that can win (routing/loadbook.py,
    # ``Pruning``); smaller ones look at every worker.
    prune_above: int = 64
    # The token-exact index (routing/exact_index.py), for workers whose engines publish KV events:
    # how long a just-routed prompt counts as held before the engine's events confirm it, and how
    # long events may be overdue before the worker falls back to the approximate index.
    kv_speculative_ttl_s: float = 2.0
    kv_events_stale_s: float = 5.0

    def __post_init__(self) -> None:
        positive = ("index_max_blocks", "block_bytes", "window_bytes", "max_hash_bytes", "session_max",
                    "prune_above")
        for name in positive:
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
                raise ValueError(f"{name} must be a positive integer")
        for name in ("index_max_age_s", "session_ttl_s", "kv_speculative_ttl_s", "kv_events_stale_s"):
            value = getattr(self, name)
            if not isinstance(value, int | float) or not value > 0:
                raise ValueError(f"{name} must be a positive number of seconds")
        if self.anchors_per_octave < 1 or self.tail_blocks < 1:
            raise ValueError("anchors_per_octave and tail_blocks must be at least 1")
        if not isinstance(self.default, ModelPolicy):
            raise ValueError("default must be a ModelPolicy")
        for model, pol in self.models.items():
            if not isinstance(pol, ModelPolicy):
                raise ValueError(f"models[{model!r}] must be a ModelPolicy")

    def policy_for(self, model: str) -> ModelPolicy:
        """The policy for ``model``, falling back to the default."""
        return self.models.get(model, self.default)

    @property
    def window_blocks(self) -> int:
        """How many leading blocks are always indexed (the 32 KB window)."""
        return self.window_bytes // self.block_bytes
