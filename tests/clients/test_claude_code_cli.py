"""Today's Claude Code CLI, end to end, as README.md runs it: ``kvroute serve ... --model-alias``
then ``claude -p "hi"`` with no ``--model``, a ``--continue`` turn, and a turn on Claude Code's small
model, through the router to four simulated vLLM replicas.

What the CLI sends (2.1.x) is what breaks naive proxies and simulators: ``POST
/v1/messages?beta=true``, its own model names (``claude-opus-…``; ``claude-haiku-…`` for
background tasks), a ``system`` message inside ``messages`` after the first user turn,
``thinking``/``context_management``/``output_config``, an attribution block in ``system``,
``max_tokens`` 32000, ~7 KB of system text and ~32 KB of tools.  The evidence is the engines' own
counters, never timing.
"""

from __future__ import annotations

import json
from collections.abc import Awaitable, Callable
from pathlib import Path

from claude_cli import run_claude

from kvroute.router_settings import Settings, parse_worker_spec
from kvroute.server.app import start_router
from kvroute.sim.server import SimFleet
from readme_commands import command

# What the simulated replicas serve: the README's alias maps Claude Code's names to it.
MODEL = "qwen3-4b"


def readme_settings() -> tuple[dict[str, object], list[str]]:
    """The router settings of README.md's Claude Code ``kvroute serve`` line (its ``--worker``
    URLs are the reader's; this test's replicas replace them), and the ``claude`` line's
    arguments.  An option this does not know fails the test, so the README cannot drift."""
    serve = command("kvroute", "serve", having="--model-alias").argv
    settings: dict[str, object] = {"aliases": []}
    for name, value in zip(serve[::2], serve[1::2], strict=True):
        if name == "--model-alias":
            settings["aliases"].append(value)  # type: ignore[attr-defined]
        elif name == "--default-model":
            settings["default_model"] = value
        else:
            assert name in ("--worker", "--port"), f"README's Claude Code serve line: what is {name}?"
    claude = command("claude")
    assert claude.env.keys() == {"ANTHROPIC_BASE_URL"} and "--model" not in claude.argv, claude.line
    return settings, claude.argv


def engine_counts(fleet: SimFleet) -> list[tuple[int, int, int]]:
    """Per replica: requests finished, prompt tokens, prompt tokens served from the prefix cache."""
    return [(sum(r.engine.stats.finished.values()), r.engine.stats.prompt_tokens,
             r.engine.stats.prompt_tokens_cached) for r in fleet.replicas]


async def test_claude_code_with_no_model_flag_two_turns_on_one_replica_then_its_small_model(
        sim_fleet: Callable[..., Awaitable[SimFleet]], claude_bin: Path, tmp_path: Path) -> None:
    fleet = await sim_fleet(4, speed=50.0, model=MODEL)
    names, claude_args = readme_settings()
    settings = Settings.from_dict({"probe_interval_s": 0.2, **names}).replace(
        workers=tuple(parse_worker_spec(u) for u in fleet.urls))
    router = await start_router(settings)
    home, project, other = tmp_path / "home", tmp_path / "project", tmp_path / "other"
    for folder in (home, project, other):
        folder.mkdir()
    try:
        first = await run_claude(claude_bin, claude_args, base_url=router.url, home=home, cwd=project)
        after_first = engine_counts(fleet)
        second = await run_claude(
            claude_bin, ["-p", "--continue", "and now say bye", "--output-format", "json"],
            base_url=router.url, home=home, cwd=project)
        after_second = engine_counts(fleet)
        turns = len(router.router.activity.requests)
        # Claude Code's own name for its small model, which it also uses for background tasks.
        small = await run_claude(claude_bin, ["-p", "hi", "--model", "haiku", "--output-format", "json"],
                                 base_url=router.url, home=home, cwd=other)
        recent = list(router.router.activity.requests)
    finally:
        await router.close()

    for turn in (first, second, small):
        assert turn.returncode == 0, turn.stderr[-2000:]
        assert "API Error" not in turn.stdout + turn.stderr, turn.stdout + turn.stderr[-2000:]
        assert turn.stdout.strip(), turn.stderr[-2000:]
    # Claude Code asked for its own models by their names; the replicas served them as MODEL.
    asked = [next(iter(json.loads(t.stdout)["modelUsage"])) for t in (second, small)]
    assert asked[0].startswith("claude-") and asked[1].startswith("claude-haiku-"), asked
    assert turns == 2 and len(recent) == 3, [(r.route, r.model, r.status) for r in recent]
    assert all((r.route, r.model, r.status) == ("messages", MODEL, 200) for r in recent)
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
