"""Settings blocks: each routing part declares its own tunables beside its code.

A *block* is a frozen dataclass whose fields are one part's settings (the placement rules every
policy shares, the learned figures, the ``auto`` cost, a new scorer's weight).  Each field says in
its metadata what it does (``setting(default, "help")``), and the block validates itself in
``__post_init__``.  Blocks are registered in *groups*, by what a user tunes (``SettingsGroup``:
placement, cache, overload, guard), listed explicitly: the routing core's in routing/policies/,
and with the fleet guard's, every group a router carries, in ``router_settings.settings_groups``.
``ModelSettings`` (routing/config.py) holds one instance of every block a model carries; the
configuration loader, the per-model overrides, the CLI help and the dashboard all read the blocks'
fields, so a new setting is declared once, where it is used.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass, field
from typing import Any, Literal, Protocol, TypeVar

# vLLM's default --max-num-seqs; used when neither the engine nor the configuration says.
DEFAULT_MAX_NUM_SEQS = 256

BlockT = TypeVar("BlockT")


def setting(default: Any, help: str, *, optional: bool = False) -> Any:
    """A block field with its documentation (shown by ``kvroute serve --help-settings`` and
    docs/server.md's generated tables).  ``optional``: None is accepted too, though the default
    is not None (``int | None = setting(2, ..., optional=True)``); it is said here because a
    block compiled by mypyc no longer carries its annotations as text (docs/design.md)."""
    if isinstance(default, list | dict | set):
        raise TypeError("settings must have immutable defaults")
    metadata: dict[str, Any] = {"help": help}
    if optional:
        metadata["optional"] = True
    return field(default=default, metadata=metadata)


def help_of(f: dataclasses.Field[Any]) -> str:
    """The documentation of a block field ('' when it has none)."""
    return str(f.metadata.get("help", ""))


def takes_none(f: dataclasses.Field[Any]) -> bool:
    """Whether a block field accepts None: its default is None, or ``setting(..., optional=True)``."""
    return f.default is None or bool(f.metadata.get("optional", False))


class Blocks(Protocol):
    """What a stage reads its settings from: ``settings.block(AutoSettings).stay_tokens``."""

    def block(self, kind: type[BlockT]) -> BlockT: ...


@dataclass(frozen=True, slots=True)
class SettingsGroup:
    """Settings a user tunes together, listed under one heading (``kvroute serve
    --help-settings``, docs/server.md): ``first`` names the few most users tune, listed first; the
    other fields of ``blocks`` follow in declaration order.  Every block is a frozen dataclass,
    so one instance can be shared (the defaults of a block a model does not carry)."""

    name: str
    title: str
    blocks: tuple[type, ...]
    first: tuple[str, ...] = ()

    def __post_init__(self) -> None:
        names: set[str] = set()
        for kind in self.blocks:
            params = getattr(kind, "__dataclass_params__", None)
            if params is None or not params.frozen:
                raise TypeError(f"settings block {kind.__name__} must be a frozen dataclass")
            names.update(f.name for f in dataclasses.fields(kind))
        missing = [n for n in self.first if n not in names]
        if missing:
            raise TypeError(f"group {self.name!r} lists {', '.join(missing)} first, which none of its "
                            "blocks declares")

    def joined(self, blocks: tuple[type, ...]) -> SettingsGroup:
        """This group with ``blocks`` added after its own (a policy's block joins placement)."""
        more = tuple(b for b in blocks if b not in self.blocks)
        return self if not more else SettingsGroup(self.name, self.title, self.blocks + more, self.first)


def check_non_negative(block: object, *names: str) -> None:
    """Raise ValueError unless each named field is a finite number >= 0."""
    for name in names:
        value = getattr(block, name)
        if isinstance(value, bool) or not isinstance(value, int | float) or not math.isfinite(value) \
                or value < 0:
            raise ValueError(f"{name} must be a finite non-negative number")


def check_positive(block: object, *names: str, what: str = "number") -> None:
    """Raise ValueError unless each named field is a finite number > 0 (``what`` names its kind
    in the message: "share", "number of seconds")."""
    for name in names:
        value = getattr(block, name)
        if isinstance(value, bool) or not isinstance(value, int | float) or not math.isfinite(value) \
                or value <= 0:
            raise ValueError(f"{name} must be a positive {what}")


@dataclass(frozen=True, slots=True)
class PlacementSettings:
    """Rules every policy shares: which policy, session stickiness, overflow, slots and slack."""

    policy: str = setting("auto", "routing policy: round-robin, p2c, least-loaded, prefix, session, auto")
    sticky: bool = setting(True, "keep a conversation on the replica that served its last turn")
    overflow: int | Literal["auto"] = setting(
        "auto", "a session leaves its replica past this many requests in flight there; 'auto': a "
                "quarter of max_num_seqs for 'session', the predicted time to first token for 'auto' "
                "(a number is then a hard cap)")
    max_num_seqs: int | None = setting(
        None, "the engines' --max-num-seqs when they do not report it (default 256, vLLM's)")
    slack_steps: tuple[int, ...] = setting(
        (1024, 4096, 8192, 32768),
        "prompt-size slack: a cached replica may carry one more request in flight than the freest "
        "for each of these prompt sizes (estimated tokens) the request reaches")
    session_active_s: float = setting(
        60.0, "a session counts as active on its replica while its last request is younger than this")

    def __post_init__(self) -> None:
        if self.overflow != "auto" and (
            isinstance(self.overflow, bool) or not isinstance(self.overflow, int) or self.overflow < 0
        ):
            raise ValueError("overflow must be 'auto' or a non-negative integer")
        if self.max_num_seqs is not None and (isinstance(self.max_num_seqs, bool) or self.max_num_seqs < 1):
            raise ValueError("max_num_seqs must be positive")
        if list(self.slack_steps) != sorted(self.slack_steps) or any(s < 0 for s in self.slack_steps):
            raise ValueError("slack_steps must be non-negative and ascending")
        check_non_negative(self, "session_active_s")

    def overflow_threshold(self, worker_max_num_seqs: int | None) -> int:
        """Session stickiness's threshold for one worker: the configured number, or a quarter of
        max_num_seqs."""
        if self.overflow != "auto":
            return self.overflow
        seqs = worker_max_num_seqs or self.max_num_seqs or DEFAULT_MAX_NUM_SEQS
        return max(1, seqs // 4)

    def slack_for(self, est_tokens: int) -> int:
        """The prompt-size slack: how many more in-flight requests a cached worker may carry."""
        return sum(1 for step in self.slack_steps if est_tokens >= step)
