"""Discovery of replicas (docs/discovery.md): what a source says and what the router does about it.

A source is a DNS name (``dns://NAME:PORT``: every A/AAAA record a replica) or a file of worker
URLs (``file://PATH``).  This module is pure — no I/O, no clock: it parses sources and files,
folds each round's answer into what a source is taken to say (``SourceView``, with the rule for
empty answers), and turns the union of the sources against the registered workers into actions
(``Plan``).  The lookups are in ``fleet/discovery_lookup.py``, the loop in ``server/discovery.py``.
"""

from __future__ import annotations

import ipaddress
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field, replace
from typing import Literal
from urllib.parse import parse_qsl, urlsplit

import orjson

from kvroute.fleet.registry import worker_id_for

DNS_SCHEME = "dns://"
FILE_SCHEME = "file://"
# The port a ``?server=`` without one is asked on.
_DNS_PORT = 53


@dataclass(frozen=True, slots=True)
class DiscoverySource:
    """One ``--discover`` source.  ``spec`` is the text it was given as: the ``source`` label of
    its metrics and the ``source`` of the workers it registers."""

    spec: str
    kind: Literal["dns", "file"]
    # dns: the name, the port every replica listens on, and the DNS server to ask (None: the
    # system resolver).
    host: str = ""
    port: int = 0
    server: tuple[str, int] | None = None
    # file: the path, as given (relative to the working directory unless absolute).
    path: str = ""


def parse_source(spec: str) -> DiscoverySource:
    """A source from ``dns://NAME:PORT[?server=IP[:PORT]]`` or ``file://PATH``; raises
    ``ValueError`` saying what is wrong."""
    spec = spec.strip()
    if spec.startswith(FILE_SCHEME):
        path = spec[len(FILE_SCHEME):]
        if not path:
            raise ValueError(f"discovery source {spec!r}: file:// needs a path (file:///etc/kvroute/workers)")
        return DiscoverySource(spec=spec, kind="file", path=path)
    if not spec.startswith(DNS_SCHEME):
        raise ValueError(f"discovery source {spec!r} must be dns://NAME:PORT or file://PATH")
    parts = urlsplit(spec)
    try:
        port = parts.port
    except ValueError:
        port = None
    if not parts.hostname or port is None or port == 0:
        raise ValueError(f"discovery source {spec!r}: dns:// needs a name and the replicas' port "
                         "(dns://vllm.default.svc.cluster.local:8000)")
    if parts.path not in ("", "/") or parts.fragment or parts.username or parts.password:
        raise ValueError(f"discovery source {spec!r}: dns://NAME:PORT takes no path, user or fragment")
    server = None
    for key, value in parse_qsl(parts.query, keep_blank_values=True):
        if key != "server":
            raise ValueError(f"discovery source {spec!r}: unknown option {key!r} (known: server)")
        server = parse_server(value)
    return DiscoverySource(spec=spec, kind="dns", host=parts.hostname, port=port, server=server)


def parse_server(text: str) -> tuple[str, int]:
    """A DNS server as ``IP``, ``IP:PORT``, ``[IPv6]:PORT`` or a bare IPv6 address (port 53 unless
    given); raises ``ValueError``."""
    host, port = text, _DNS_PORT
    if text.startswith("["):
        host, sep, rest = text[1:].partition("]")
        if not sep or (rest and not rest.startswith(":")):
            raise ValueError(f"DNS server {text!r}: expected [IPv6]:PORT")
        if rest:
            port = _port(text, rest[1:])
    elif text.count(":") == 1:
        host, _, port_text = text.partition(":")
        port = _port(text, port_text)
    try:
        ipaddress.ip_address(host)
    except ValueError:
        raise ValueError(f"DNS server {text!r} must be an IP address, optionally with :PORT") from None
    return host, port


def _port(text: str, port_text: str) -> int:
    if not port_text.isdigit() or not 0 < int(port_text) < 65536:
        raise ValueError(f"{text!r}: the port must be a number from 1 to 65535")
    return int(port_text)


def address_url(address: str, port: int) -> str:
    """The worker URL of a resolved address: ``http://IP:PORT``, an IPv6 address bracketed."""
    host = f"[{address}]" if ":" in address else address
    return f"http://{host}:{port}"


def target_url(target: str) -> str:
    """A file's entry as a worker URL: ``http(s)://HOST[:PORT][/PATH]`` as given, or ``HOST:PORT``
    (file_sd's form) as ``http://HOST:PORT``; raises ``ValueError``."""
    url = target if "://" in target else f"http://{target}"
    if not url.startswith(("http://", "https://")):
        raise ValueError(f"{target!r}: a worker URL must start with http:// or https://")
    try:
        parts = urlsplit(url)
        parts.port  # noqa: B018  (raises on a port that is not a number or out of range)
    except ValueError:
        raise ValueError(f"{target!r} is not a worker URL (http://HOST:PORT): bad host or port") from None
    if not parts.hostname or parts.query or parts.fragment or any(c.isspace() for c in url):
        raise ValueError(f"{target!r} is not a worker URL (http://HOST:PORT)")
    return url.rstrip("/")


def parse_targets(text: str) -> frozenset[str]:
    """The worker URLs a discovery file lists; raises ``ValueError`` naming the first bad entry.

    Either one URL (or ``HOST:PORT``) a line, ``#`` starting a comment, blank lines ignored; or,
    when the file starts with ``[`` (or ``{``: a mistake it then names), Prometheus' file_sd
    JSON: ``[{"targets": ["HOST:PORT", ...], "labels": {...}}, ...]`` (the labels are ignored)."""
    if text.lstrip().startswith(("[", "{")):
        return _file_sd_targets(text)
    urls = set()
    for number, line in enumerate(text.splitlines(), 1):
        entry = line.split("#", 1)[0].strip()
        if entry:
            try:
                urls.add(target_url(entry))
            except ValueError as exc:
                raise ValueError(f"line {number}: {exc}") from None
    return frozenset(urls)


def _file_sd_targets(text: str) -> frozenset[str]:
    try:
        doc = orjson.loads(text)
    except orjson.JSONDecodeError as exc:
        raise ValueError(f"not valid JSON: {exc}") from None
    if not isinstance(doc, list):
        raise ValueError('file_sd JSON must be a list of {"targets": [...]} groups')
    urls = set()
    for number, group in enumerate(doc, 1):
        targets = group.get("targets") if isinstance(group, dict) else None
        if not isinstance(targets, list) or not all(isinstance(t, str) for t in targets):
            raise ValueError(f'group {number}: expected {{"targets": ["HOST:PORT", ...]}}')
        for target in targets:
            try:
                urls.add(target_url(target.strip()))
            except ValueError as exc:
                raise ValueError(f"group {number}: {exc}") from None
    return frozenset(urls)


@dataclass(frozen=True, slots=True)
class SourceView:
    """What the router takes a source to say: ``urls`` is the set it acts on.

    ``answered``: at least one round succeeded.  ``empty_rounds``: empty answers in a row not yet
    acted on (the set is kept until ``empty_rounds_needed`` say so).  ``failures``: failed rounds
    in a row (the set is kept through them)."""

    urls: frozenset[str] = frozenset()
    answered: bool = False
    empty_rounds: int = 0
    failures: int = 0


def observe(view: SourceView, answer: frozenset[str] | None, *, empty_rounds_needed: int) -> SourceView:
    """Fold one round into ``view``: ``answer`` is the URLs the source gave, None when the round
    failed (NXDOMAIN, a timeout, an unreadable or malformed file).

    A failure keeps the set.  A non-empty answer is the new set at once.  An empty answer empties
    the set only once ``empty_rounds_needed`` rounds in a row said so (failures between them
    neither count nor break the run): a name briefly without records during a rollout, or a file
    truncated before it is rewritten, must not drain the whole fleet."""
    if answer is None:
        return replace(view, failures=view.failures + 1)
    if answer:
        return SourceView(urls=answer, answered=True)
    empty = view.empty_rounds + 1
    if not view.urls or empty >= empty_rounds_needed:
        return SourceView(answered=True)
    return SourceView(urls=view.urls, answered=True, empty_rounds=empty)


@dataclass(frozen=True, slots=True)
class Member:
    """A registered worker, as the plan reads it."""

    id: str
    url: str
    source: str
    draining: bool
    inflight: int


@dataclass(frozen=True, slots=True)
class Plan:
    """What to do this round.  ``register``: (url, source) of workers to probe and register;
    ``drain``: workers discovery registered that no source lists any more; ``remove``: those it
    drained that have nothing in flight; ``resume``: those it drained that are listed again."""

    register: tuple[tuple[str, str], ...] = ()
    drain: tuple[str, ...] = ()
    remove: tuple[str, ...] = ()
    resume: tuple[str, ...] = ()

    def __bool__(self) -> bool:
        return bool(self.register or self.drain or self.remove or self.resume)


def wanted_urls(views: Sequence[tuple[str, SourceView]]) -> dict[str, str]:
    """Every URL the sources list -> the first source (in the given order) that lists it."""
    wanted: dict[str, str] = {}
    for source, view in views:
        for url in sorted(view.urls):
            wanted.setdefault(url, source)
    return wanted


@dataclass(slots=True)
class Reconciler:
    """Discovery's decisions for one router: the sources' views, and which of its workers it put
    in draining (so that it resumes only those, never a worker an operator drained).

    Discovery touches only the workers whose ``source`` is one of its sources: workers given by
    ``--worker`` or the config file, or registered through the admin API, are never drained by it,
    and a URL one of them already has is not registered again."""

    sources: tuple[str, ...]
    empty_rounds_needed: int = 2
    views: dict[str, SourceView] = field(default_factory=dict)
    drained: set[str] = field(default_factory=set)

    def observe(self, source: str, answer: frozenset[str] | None) -> SourceView:
        """Fold one round of ``source`` in (see ``observe``); returns its new view."""
        view = observe(self.views.get(source, SourceView()), answer,
                       empty_rounds_needed=self.empty_rounds_needed)
        self.views[source] = view
        return view

    def plan(self, members: Iterable[Member]) -> Plan:
        """The actions that make the registered workers what the sources list."""
        wanted = wanted_urls([(s, self.views[s]) for s in self.sources if s in self.views])
        wanted_ids = {worker_id_for(url): (url, source) for url, source in wanted.items()}
        by_id = {m.id: m for m in members}
        register = tuple((url, source) for wid, (url, source) in wanted_ids.items() if wid not in by_id)
        drain, remove, resume = [], [], []
        for member in by_id.values():
            if member.source not in self.sources:
                continue
            if member.id in wanted_ids:
                if member.id in self.drained:
                    resume.append(member.id)
            elif member.id not in self.drained:
                drain.append(member.id)
            elif member.inflight == 0:
                remove.append(member.id)
        return Plan(register=register, drain=tuple(drain), remove=tuple(remove), resume=tuple(resume))

    def applied(self, plan: Plan, members: Iterable[Member]) -> None:
        """Record that ``plan`` was carried out; ``members`` are the workers registered now (a
        worker removed meanwhile by other means is forgotten)."""
        self.drained.update(plan.drain)
        self.drained.difference_update(plan.remove, plan.resume)
        present = {m.id for m in members if m.source in self.sources}
        self.drained.intersection_update(present)

    def listed(self, source: str) -> int:
        """How many replicas ``source`` lists (what the router acts on)."""
        view = self.views.get(source)
        return 0 if view is None else len(view.urls)

