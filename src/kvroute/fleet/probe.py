"""Polling each worker's ``/health``, ``/metrics``, ``/v1/models`` (and ``/server_info`` once).

One loop per worker, on its own small connection pool so that a worker saturated with proxied
requests still answers its probe instead of looking dead.
"""

from __future__ import annotations

import asyncio
import logging
import re
from collections.abc import Mapping
from typing import Any

import aiohttp
import orjson

from kvroute.event_loop import cancel_and_wait
from kvroute.fleet.registry import ProbeResult, Registry
from kvroute.fleet.vllm_metrics import EngineMetrics, parse_vllm_metrics

log = logging.getLogger("kvroute.probe")

def find_config_int(info: Any, name: str) -> int | None:
    """The positive integer setting ``name`` from a ``/server_info`` answer: a JSON field anywhere
    in it (the simulator) or ``name=N`` inside a config dump string (vLLM's dev-mode
    ``vllm_config``)."""
    if isinstance(info, Mapping):
        value = info.get(name)
        if isinstance(value, int) and not isinstance(value, bool) and value > 0:
            return value
        for v in info.values():
            found = find_config_int(v, name)
            if found is not None:
                return found
    elif isinstance(info, list):
        for v in info:
            found = find_config_int(v, name)
            if found is not None:
                return found
    elif isinstance(info, str):
        match = re.search(rf"\b{name}['\"]?\s*[=:]\s*(\d+)", info)
        if match and int(match.group(1)) > 0:
            return int(match.group(1))
    return None


def find_max_num_seqs(info: Any) -> int | None:
    """The sequence slots of the worker a ``/server_info`` answer describes: ``max_num_seqs``,
    which is per engine rank, times ``data_parallel_size`` (one API server in front of several
    ranks, each with its own slots)."""
    per_rank = find_config_int(info, "max_num_seqs")
    if per_rank is None:
        return None
    return per_rank * (find_config_int(info, "data_parallel_size") or 1)


_VLLM_KV_EVENTS = re.compile(r"kv_events_config=KVEventsConfig\((?P<body>[^)]*)\)")


def find_kv_events(info: Any) -> str | None:
    """Where the engine says it publishes KV-cache events, as ``PUB[,REPLAY]`` (a ``*`` host left
    for the caller to fill): the simulator's ``kv_events`` (its bound endpoints) or vLLM's
    dev-mode ``vllm_config`` dump (``kv_events_config=KVEventsConfig(...)``); None if it does not."""
    if isinstance(info, Mapping):
        sim = info.get("kv_events")
        endpoint = sim.get("endpoint") if isinstance(sim, Mapping) else None
        if isinstance(sim, Mapping) and isinstance(endpoint, str):
            replay = sim.get("replay_endpoint")
            return endpoint + (f",{replay}" if isinstance(replay, str) and replay else "")
        dump = info.get("vllm_config")
        if isinstance(dump, str) and (match := _VLLM_KV_EVENTS.search(dump)):
            fields = dict(re.findall(r"(\w+)=('[^']*'|\w+)", match.group("body")))
            if fields.get("enable_kv_cache_events") != "True" or fields.get("publisher", "'zmq'") not in (
                    "'zmq'", "None"):
                return None
            pub: str = fields.get("endpoint", "'tcp://*:5557'").strip("'")
            replay_at: str = fields.get("replay_endpoint", "None").strip("'")
            return pub + (f",{replay_at}" if replay_at and replay_at != "None" else "")
    return None


class Prober:
    """Runs a probe loop per watched worker and folds each round into the registry."""

    def __init__(
        self,
        registry: Registry,
        *,
        interval_s: float = 1.0,
        timeout_s: float = 2.0,
        models_every: int = 10,
        api_key: str | None = None,
    ) -> None:
        self._registry = registry
        # vLLM's --api-key guards /v1/models (not /health, /metrics): the workers' key is sent.
        self._headers = {"Authorization": f"Bearer {api_key}"} if api_key else None
        self._interval = interval_s
        self._timeout = aiohttp.ClientTimeout(total=timeout_s)
        self._models_every = models_every
        self._tasks: dict[str, asyncio.Task[None]] = {}
        self._session: aiohttp.ClientSession | None = None

    def _client(self) -> aiohttp.ClientSession:
        if self._session is None:
            connector = aiohttp.TCPConnector(limit=0, limit_per_host=4, keepalive_timeout=30)
            self._session = aiohttp.ClientSession(connector=connector, timeout=self._timeout,
                                                  headers=self._headers)
        return self._session

    async def probe_once(self, worker_id: str, *, with_models: bool = True,
                         with_server_info: bool = False) -> ProbeResult | None:
        """Probe ``worker_id`` now, apply the result to the registry and return it (None if the
        worker is not registered)."""
        record = self._registry.get(worker_id)
        if record is None:
            return None
        url = record.state.url
        inflight = record.state.total_inflight
        session = self._client()
        try:
            health, metrics, models, info = await asyncio.gather(
                self._get(session, f"{url}/health"),
                self._get_optional(session, f"{url}/metrics"),
                self._get_optional(session, f"{url}/v1/models") if with_models else _none(),
                self._get_optional(session, f"{url}/server_info") if with_server_info else _none(),
            )
        except (aiohttp.ClientError, OSError, TimeoutError) as exc:
            result = ProbeResult(reachable=False, healthy=False, error=_describe(exc))
        else:
            assert health is not None
            status = health[0]
            result = ProbeResult(
                reachable=True,
                healthy=200 <= status < 300,
                error=None if 200 <= status < 300 else f"/health answered {status}",
                metrics=_metrics(metrics),
                models=_models(models),
                max_num_seqs=_server_info(info),
                kv_events=find_kv_events(_json(info)),
                inflight_at_start=inflight,
            )
        if self._registry.get(worker_id) is record:  # not removed or re-registered meanwhile
            self._registry.apply_probe(worker_id, result)
        return result

    async def _get(self, session: aiohttp.ClientSession, url: str) -> tuple[int, bytes]:
        async with session.get(url) as resp:
            return resp.status, await resp.read()

    async def _get_optional(self, session: aiohttp.ClientSession, url: str) -> tuple[int, bytes] | None:
        """A GET whose failure only means "no answer" (``/health`` alone decides reachability)."""
        try:
            return await self._get(session, url)
        except (aiohttp.ClientError, OSError, TimeoutError):
            return None

    def watch(self, worker_id: str) -> None:
        """Start (or restart) the probe loop of ``worker_id``; its first round is one interval
        from now (whoever registers a worker probes it once at once, see ``probe_once``)."""
        self.unwatch(worker_id)
        self._tasks[worker_id] = asyncio.create_task(self._loop(worker_id), name=f"probe:{worker_id}")

    def unwatch(self, worker_id: str) -> None:
        """Stop probing ``worker_id``."""
        task = self._tasks.pop(worker_id, None)
        if task is not None:
            task.cancel()

    async def _loop(self, worker_id: str) -> None:
        rounds = 1
        record = self._registry.get(worker_id)
        needs_info = record is None or record.last_probe is None or record.state.max_num_seqs is None
        while True:
            await asyncio.sleep(self._interval)
            record = self._registry.get(worker_id)
            if record is None:
                return
            needs_models = not record.model_cards or rounds % self._models_every == 0
            try:
                result = await self.probe_once(
                    worker_id, with_models=needs_models, with_server_info=needs_info
                )
            except Exception:  # a bug here must not end the loop and freeze the worker's figures
                log.exception("probe of %s failed", worker_id)
                result = None
            if result is not None and result.reachable:
                needs_info = False
            rounds += 1

    async def close(self) -> None:
        """Stop every loop and close the probe connections."""
        tasks = list(self._tasks.values())
        self._tasks.clear()
        await cancel_and_wait(tasks)
        if self._session is not None:
            await self._session.close()
            self._session = None


async def _none() -> None:
    return None


def _describe(exc: BaseException) -> str:
    return f"{type(exc).__name__}: {exc}" if str(exc) else type(exc).__name__


def _metrics(answer: tuple[int, bytes] | None) -> EngineMetrics | None:
    if answer is None or answer[0] != 200:
        return None
    metrics = parse_vllm_metrics(answer[1].decode("utf-8", "replace"))
    has_any = metrics.has_load or metrics.kv_usage is not None or metrics.process_start_time is not None
    return metrics if has_any else None


def _json(answer: tuple[int, bytes] | None) -> Any:
    if answer is None or answer[0] != 200:
        return None
    try:
        return orjson.loads(answer[1])
    except orjson.JSONDecodeError:
        return None


def _models(answer: tuple[int, bytes] | None) -> tuple[Mapping[str, Any], ...] | None:
    doc = _json(answer)
    if not isinstance(doc, Mapping) or not isinstance(doc.get("data"), list):
        return None
    return tuple(c for c in doc["data"] if isinstance(c, Mapping) and isinstance(c.get("id"), str))


def _server_info(answer: tuple[int, bytes] | None) -> int | None:
    return find_max_num_seqs(_json(answer))
