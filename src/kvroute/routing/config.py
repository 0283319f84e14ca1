"""Routing settings as plain, validated data: one ``ModelSettings`` per model plus index-wide limits.

A ``ModelSettings`` holds one instance of every settings block a model carries (routing/settings.py):
the placement rules every policy shares, the learned figures, flow control's, each policy's own
block (``auto``'s cost weights) and, built by ``router_settings``, the fleet guard's.  It reads flat
(``settings.stay_tokens``) so that configuration files, the virtual-time cluster's sweeps and the
dashboard name a setting the same way, whichever block declares it.

The listing functions take the settings groups to list (``router_settings.settings_groups()`` for
everything a router carries); without them they list the routing core's (``routing_groups()``).
"""

from __future__ import annotations

import dataclasses
import functools
import textwrap
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from kvroute.routing.policies import POLICIES, routing_groups
from kvroute.routing.settings import BlockT, PlacementSettings, SettingsGroup, help_of, takes_none


@dataclass(frozen=True, slots=True)
class SettingInfo:
    """One per-model setting: its name, its group, the block that declares it, default and help."""

    name: str
    group: SettingsGroup
    block: type
    default: Any
    help: str


def setting_infos(groups: Sequence[SettingsGroup] | None = None) -> list[SettingInfo]:
    """Every per-model setting of ``groups`` (the routing core's when None), group by group: the
    group's ``first`` names, then its blocks' other fields in declaration order."""
    infos: list[SettingInfo] = []
    for group in routing_groups() if groups is None else groups:
        fields = {f.name: (kind, f) for kind in group.blocks for f in dataclasses.fields(kind)}
        order = [*group.first, *(n for n in fields if n not in group.first)]
        infos += [SettingInfo(n, group, fields[n][0], fields[n][1].default, help_of(fields[n][1]))
                  for n in order]
    return infos


def defaults(groups: Sequence[SettingsGroup] | None = None) -> dict[str, Any]:
    """Every per-model setting of ``groups`` (the routing core's when None) with its default."""
    return {i.name: i.default for i in setting_infos(groups)}


def blocks_of(groups: Iterable[SettingsGroup]) -> tuple[type, ...]:
    """The settings blocks of ``groups``, in order."""
    return tuple(dict.fromkeys(kind for group in groups for kind in group.blocks))


def policy_names() -> tuple[str, ...]:
    """The registered policies' names."""
    return tuple(POLICIES)


def policies_help() -> str:
    """One line per registered policy: its name and what it does (CLI help, docs)."""
    return "; ".join(f"{p.name}: {p.summary}" if p.summary else p.name for p in POLICIES.values())


def settings_markdown(groups: Sequence[SettingsGroup] | None = None) -> str:
    """The per-model settings as docs/server.md shows them: one table per group under its title
    (a test keeps the page equal to this)."""
    rows: list[str] = []
    group: SettingsGroup | None = None
    for i in setting_infos(groups):
        if i.group is not group:
            group = i.group
            rows += [*([""] if rows else []), f"#### {group.title}", "",
                     "| setting | default | declared by | meaning |", "|---|---|---|---|"]
        default = "none" if i.default is None else (
            f"`{list(i.default)}`" if isinstance(i.default, tuple) else f"`{i.default!r}`".replace("'", '"'))
        rows.append(f"| `{i.name}` | {default} | `{i.block.__name__}` | {i.help} |")
    return "\n".join(rows) + "\n"


def settings_help(width: int = 100, groups: Sequence[SettingsGroup] | None = None) -> str:
    """Every per-model setting with its default and what it does, under a heading per group, wrapped
    at ``width`` (``kvroute serve --help-settings``)."""
    lines: list[str] = []
    group: SettingsGroup | None = None
    for i in setting_infos(groups):
        if i.group is not group:
            group = i.group
            heading = textwrap.fill(f"{group.title}:", width=width)
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


@functools.lru_cache(maxsize=32)
def _field_index(kinds: tuple[type, ...]) -> dict[str, type]:
    """Which of ``kinds`` declares each setting name (a name declared twice is a mistake)."""
    index: dict[str, type] = {}
    for kind in kinds:
        for f in dataclasses.fields(kind):
            if f.name in index:
                raise TypeError(f"setting {f.name!r} is declared by both {index[f.name].__name__} "
                                f"and {kind.__name__}")
            index[f.name] = kind
    return index


_DEFAULT_BLOCKS: dict[type, Any] = {}


def _defaults_of(kind: type[Any]) -> Any:
    """The default instance of a block (blocks are frozen: one is shared)."""
    found = _DEFAULT_BLOCKS.get(kind)
    if found is None:
        found = _DEFAULT_BLOCKS[kind] = kind()
    return found


class ModelSettings:
    """How requests for one model are routed: one validated instance of every settings block it
    carries, built once; immutable.

    ``ModelSettings(policy="session", overflow=4)`` carries the routing core's blocks and sets fields
    by name whatever block declares them; ``ModelSettings.carrying(blocks, ...)`` carries ``blocks``
    too (the fleet guard's, from ``router_settings``).  Unknown names and invalid values raise
    ValueError naming them.  ``block(AutoSettings)`` is what a stage reads (a block the model does
    not carry reads as its defaults); ``settings.stay_tokens`` reads any carried field flat.
    """

    __slots__ = ("_blocks", "_extra", "_index", "placement")
    _blocks: dict[type, Any]
    _extra: tuple[type, ...]
    _index: dict[str, type]
    placement: PlacementSettings

    def __init__(self, **settings: Any) -> None:
        self._build((), settings)

    @classmethod
    def carrying(cls, blocks: Iterable[type], **settings: Any) -> ModelSettings:
        """Settings that carry ``blocks`` beside the routing core's (validated like the constructor)."""
        made = cls.__new__(cls)
        made._build(tuple(blocks), settings)
        return made

    def _build(self, extra: tuple[type, ...], settings: dict[str, Any]) -> None:
        # The routing core's blocks are read when built, so a policy registered since joins.
        kinds = tuple(dict.fromkeys((*blocks_of(routing_groups()), *extra)))
        index = _field_index(kinds)
        grouped: dict[type, dict[str, Any]] = {}
        for name, value in settings.items():
            kind = index.get(name)
            if kind is None:
                raise ValueError(f"unknown routing setting {name!r}")
            value = tuple(value) if isinstance(value, list) else value
            _check_kind(_fields_of(kind)[name], value)
            grouped.setdefault(kind, {})[name] = value
        blocks: dict[type, Any] = {}
        for kind in kinds:
            try:
                blocks[kind] = kind(**grouped[kind]) if kind in grouped else _defaults_of(kind)
            except TypeError as exc:
                raise ValueError(str(exc)) from None
        placement: PlacementSettings = blocks[PlacementSettings]
        if placement.policy not in POLICIES:
            raise ValueError(f"unknown policy {placement.policy!r}; expected one of {', '.join(POLICIES)}")
        object.__setattr__(self, "_blocks", blocks)
        object.__setattr__(self, "_extra", extra)
        object.__setattr__(self, "_index", index)
        object.__setattr__(self, "placement", placement)
        for name in index:
            if not hasattr(ModelSettings, name):  # a method or slot of the same name wins
                setattr(ModelSettings, name, _flat(name))

    def block(self, kind: type[BlockT]) -> BlockT:
        """This model's settings block ``kind`` (its defaults for a block the model does not carry)."""
        # Read a dozen times a request: typed by annotation, not by a call to typing.cast.
        found: BlockT | None = self._blocks.get(kind)
        return found if found is not None else _defaults_of(kind)

    # A setting read flat (``settings.stay_tokens``) is a property of the class, added when a
    # ModelSettings first carries it (``_flat``), not a ``__getattr__``: a class with one sends every
    # attribute read of its instances, ``settings.block`` and ``self._blocks`` included, through
    # CPython's slow path (~450 instructions each, a dozen ``block`` calls a request).
    if TYPE_CHECKING:
        def __getattr__(self, name: str) -> Any: ...

    def __setattr__(self, name: str, value: Any) -> None:
        raise AttributeError("ModelSettings is immutable; use replace()")

    def items(self) -> Iterator[tuple[str, Any]]:
        """(name, value) of every setting carried."""
        for kind, block in self._blocks.items():
            for f in dataclasses.fields(kind):
                yield f.name, getattr(block, f.name)

    def as_dict(self) -> dict[str, Any]:
        """Every setting carried, by name."""
        return dict(self.items())

    def replace(self, **changes: Any) -> ModelSettings:
        """A copy with some settings changed (validated), carrying the same blocks."""
        return type(self).carrying(self._extra, **{**self.as_dict(), **changes})

    def __eq__(self, other: object) -> bool:
        return isinstance(other, ModelSettings) and self.as_dict() == other.as_dict()

    def __hash__(self) -> int:
        return hash(tuple(self.items()))

    def __repr__(self) -> str:
        default = {f.name: f.default for kind in self._blocks for f in dataclasses.fields(kind)}
        changed = ", ".join(f"{k}={v!r}" for k, v in self.items() if v != default[k])
        return f"ModelSettings({changed})"

    def overflow_threshold(self, worker_max_num_seqs: int | None) -> int:
        """The placement block's overflow threshold for one worker."""
        return self.placement.overflow_threshold(worker_max_num_seqs)

    def slack_for(self, est_tokens: int) -> int:
        """The placement block's prompt-size slack."""
        return self.placement.slack_for(est_tokens)


def _flat(name: str) -> property:
    """The setting ``name`` read flat: from the block that declares it, where the instance carries
    one (else AttributeError, as for any missing attribute)."""
    def read(self: ModelSettings) -> Any:
        kind = self._index.get(name)
        if kind is None:
            raise AttributeError(name)
        return getattr(self._blocks[kind], name)
    return property(read, doc=f"The setting {name!r}.")


def _fields_of(kind: type) -> dict[str, dataclasses.Field[Any]]:
    return {f.name: f for f in dataclasses.fields(kind)}


def _check_kind(f: dataclasses.Field[Any], value: Any) -> None:
    """A number where the default is a number, a boolean where it is one, None only where the
    field allows it (each block checks its own ranges)."""
    default, name = f.default, f.name
    if value is None:
        if not takes_none(f):
            raise ValueError(f"{name} must be set")
    elif isinstance(default, bool):
        if not isinstance(value, bool):
            raise ValueError(f"{name} must be true or false, got {value!r}")
    elif isinstance(default, int | float) and (isinstance(value, bool) or not isinstance(value, int | float)):
        raise ValueError(f"{name} must be a number, got {value!r}")


@dataclass(frozen=True, slots=True)
class RoutingConfig:
    """Index, session-table and hashing limits shared by every model, plus per-model settings.

    ``window_bytes`` is the indexed window: every block in it is indexed.  With ``hash_beyond_window``
    the rest of the prompt (up to ``max_hash_bytes``) is hashed too, and a bounded sample of its
    blocks is stored: ``anchors_per_octave`` positions per doubling of the prompt length plus the
    last ``tail_blocks``; that is what tells apart conversations whose first 32 KB are identical.
    """

    default: ModelSettings = field(default_factory=ModelSettings)
    models: dict[str, ModelSettings] = field(default_factory=dict)
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
        if not isinstance(self.default, ModelSettings):
            raise ValueError("default must be a ModelSettings")
        for model, settings in self.models.items():
            if not isinstance(settings, ModelSettings):
                raise ValueError(f"models[{model!r}] must be a ModelSettings")

    def settings_for(self, model: str) -> ModelSettings:
        """The settings for ``model``, falling back to the default."""
        return self.models.get(model, self.default)

    @property
    def window_blocks(self) -> int:
        """How many leading blocks are always indexed (the 32 KB window)."""
        return self.window_bytes // self.block_bytes
