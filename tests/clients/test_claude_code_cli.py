"""Today's Claude Code CLI, end to end: ``claude -p`` then ``claude -p --continue`` through
``kvroute serve``'s router to four simulated vLLM replicas.

What the CLI sends (2.1.x) is what breaks naive proxies and simulators: ``POST
/v1/messages?beta=true``, a ``system`` message inside ``messages`` after the first user turn,
``thinking``/``context_management``/``output_config``, an attribution block in ``system``,
``max_tokens`` 32000, ~7 KB of system text and ~32 KB of tools.  The evidence is the engines' own
counters, never timing.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from pathlib import Path

from claude_cli import run_claude

from kvroute.router_settings import Settings, parse_worker_spec
from kvroute.server.app import start_router
from kvroute.sim.server import SimFleet

# A model name Claude Code accepts with --model (it warns that it does not know its context size).
MODEL = "qwen3-4b"


def engine_counts(fleet: SimFleet) -> list[tuple[int, int, int]]:
    """Per replica: requests finished, prompt tokens, prompt tokens served from the prefix cache."""
    return [(sum(r.engine.stats.finished.values()), r.engine.stats.prompt_tokens,
             r.engine.stats.prompt_tokens_cached) for r in fleet.replicas]


async def test_claude_code_two_turns_on_one_replica_with_the_second_from_cache(
        sim_fleet: Callable[..., Awaitable[SimFleet]], claude_bin: Path, tmp_path: Path) -> None:
    fleet = await sim_fleet(4, speed=50.0, model=MODEL)
    settings = Settings.from_dict({"probe_interval_s": 0.2}).replace(
        workers=tuple(parse_worker_spec(u) for u in fleet.urls))
    router = await start_router(settings)
    home, project = tmp_path / "home", tmp_path / "project"
    home.mkdir()
    project.mkdir()
    try:
        first = await run_claude(claude_bin, ["-p", "say hi", "--model", MODEL],
                                 base_url=router.url, home=home, cwd=project)
        after_first = engine_counts(fleet)
        second = await run_claude(claude_bin, ["-p", "--continue", "and now say bye", "--model", MODEL],
                                  base_url=router.url, home=home, cwd=project)
        after_second = engine_counts(fleet)
        recent = list(router.router.activity.requests)
    finally:
        await router.close()

    for turn in (first, second):
        assert turn.returncode == 0, turn.stderr[-2000:]
        assert "API Error" not in turn.stdout + turn.stderr, turn.stdout + turn.stderr[-2000:]
        assert turn.stdout.strip(), turn.stderr[-2000:]
    assert [r.status for r in recent] == [200, 200] and all(r.route == "messages" for r in recent)
    # One replica served both turns, and the router says why: the second stayed with its session.
    served = [i for i, (finished, _, _) in enumerate(after_second) if finished]
    assert len(served) == 1 and after_second[served[0]][0] == 2, after_second
    assert recent[0].worker == recent[1].worker and recent[1].kind == "sticky"
    # The second turn's prompt came from the engine's prefix cache (≥ 90 %): the router's and the
    # engine's renderings of the mid-conversation system message kept turn 1's bytes in place.
    i = served[0]
    prompt_two = after_second[i][1] - after_first[i][1]
    cached_two = after_second[i][2] - after_first[i][2]
    assert prompt_two > 5000 and cached_two >= 0.9 * prompt_two, (prompt_two, cached_two)


async def test_claude_code_with_the_routers_api_key_and_with_a_wrong_one(
        sim_fleet: Callable[..., Awaitable[SimFleet]], claude_bin: Path, tmp_path: Path) -> None:
    fleet = await sim_fleet(1, speed=50.0, model=MODEL)
    settings = Settings.from_dict({"probe_interval_s": 0.2, "api_keys": ["sk-router-key"]}).replace(
        workers=tuple(parse_worker_spec(u) for u in fleet.urls))
    router = await start_router(settings)
    home, project = tmp_path / "home", tmp_path / "project"
    home.mkdir()
    project.mkdir()
    try:
        allowed = await run_claude(claude_bin, ["-p", "say hi", "--model", MODEL], base_url=router.url,
                                   home=home, cwd=project, api_key="sk-router-key")
        refused = await run_claude(claude_bin, ["-p", "say hi", "--model", MODEL], base_url=router.url,
                                   home=home, cwd=project, api_key="sk-not-the-key")
        statuses = [r.status for r in router.router.activity.requests]
    finally:
        await router.close()
    assert allowed.returncode == 0 and allowed.stdout.strip(), allowed.stderr[-2000:]
    assert statuses == [200]  # the refused requests never reached routing
    # x-should-retry: false on the 401 makes the CLI say so at once instead of retrying for minutes.
    assert refused.returncode != 0
    assert "Invalid API key" in refused.stdout + refused.stderr, (refused.stdout + refused.stderr)[-2000:]
