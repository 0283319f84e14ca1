"""The real-engine growing-chat table: kvroute in front of two vLLM-CPU replicas.

Each conversation grows by about 500 tokens a turn through the router; every turn's prompt is also
sent straight to the *other* replica with a fresh ``cache_salt`` (vLLM keeps salted prompts apart),
which is what that turn costs where the conversation was never seen. Prints a Markdown table.

    PYTHONPATH=tools python -m kvroute_dev.vllm_chat_table [--conversations 3] [--turns 4] [--urls URL,URL]

Without ``--urls`` it starts (and stops) two replicas from the prepared environment.
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import sys
import uuid
from collections.abc import Iterable
from dataclasses import dataclass

import aiohttp

from kvroute.fleet.registry import worker_id_for
from kvroute.router_settings import Settings, WorkerSpec
from kvroute.server.app import start_router
from kvroute_dev.growing_chat import ChatAnswer, GrowingChat, send_chat
from kvroute_dev.vllm_env import SERVED_MODEL_NAME, VllmEnv, default_home, problems
from kvroute_dev.vllm_replicas import start_replicas


@dataclass(frozen=True)
class TurnRow:
    """One turn of one conversation: through the router, and cold on the other replica."""

    conversation: int
    turn: int
    routed: ChatAnswer
    other: ChatAnswer


async def run_chats(urls: list[str], conversations: int, turns: int) -> list[TurnRow]:
    """Run the conversations one after another through a router in front of ``urls``."""
    settings = Settings(workers=tuple(WorkerSpec(url=u) for u in urls))
    router = await start_router(settings, host="127.0.0.1", port=0)
    by_worker = {worker_id_for(u): u for u in urls}
    rows: list[TurnRow] = []
    try:
        async with aiohttp.ClientSession() as session:
            for c in range(conversations):
                chat = GrowingChat(f"table-{uuid.uuid4().hex[:8]}")
                for t in range(1, turns + 1):
                    messages = chat.ask()
                    routed = await send_chat(session, router.url, SERVED_MODEL_NAME, messages)
                    chat.answer(routed.reply)
                    other_url = next(u for w, u in by_worker.items() if w != routed.worker)
                    salt = {"cache_salt": uuid.uuid4().hex}
                    other = await send_chat(session, other_url, SERVED_MODEL_NAME, messages, extra=salt)
                    rows.append(TurnRow(c, t, routed, other))
    finally:
        await router.close()
    return rows


def render(rows: list[TurnRow], urls: list[str]) -> str:
    """Medians per turn over the conversations, as a Markdown table."""
    names = {worker_id_for(u): f"r{i}" for i, u in enumerate(urls)}
    lines = [
        "| turn | prompt tokens | via router: worker | cached | time | other replica (cold): cached | time | "
        "same worker as turn 1 |",
        "| ---: | ---: | :---: | ---: | ---: | ---: | ---: | :---: |",
    ]
    first_worker = {r.conversation: r.routed.worker for r in rows if r.turn == 1}
    for turn in sorted({r.turn for r in rows}):
        group = [r for r in rows if r.turn == turn]
        workers = "/".join(sorted({names.get(r.routed.worker or "", "?") for r in group}))
        same = sum(1 for r in group if r.routed.worker == first_worker[r.conversation])
        lines.append(
            f"| {turn} | {_median(r.routed.prompt_tokens for r in group):.0f} | {workers} "
            f"| {_median(r.routed.cached_tokens for r in group):.0f} "
            f"| {_median(r.routed.seconds for r in group):.2f} s "
            f"| {_median(r.other.cached_tokens for r in group):.0f} "
            f"| {_median(r.other.seconds for r in group):.2f} s | {same}/{len(group)} |"
        )
    return "\n".join(lines)


def _median(values: Iterable[float]) -> float:
    return float(statistics.median(values))


def main(argv: list[str] | None = None) -> int:
    """Command line; exit 1 when the environment is not prepared."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--conversations", type=int, default=3)
    parser.add_argument("--turns", type=int, default=4)
    parser.add_argument("--urls", default="", help="two running replicas (comma-separated) to use instead")
    args = parser.parse_args(argv)
    urls = [u.strip().rstrip("/") for u in args.urls.split(",") if u.strip()]
    if urls:
        rows = asyncio.run(run_chats(urls, args.conversations, args.turns))
    else:
        env = VllmEnv(default_home())
        found = problems(env)
        if found:
            print("vllm_chat_table: NOT PREPARED: " + "; ".join(found), file=sys.stderr)
            return 1
        with start_replicas(env, count=2) as fleet:
            urls = fleet.urls
            rows = asyncio.run(run_chats(urls, args.conversations, args.turns))
    print(render(rows, urls))
    return 0


if __name__ == "__main__":
    sys.exit(main())
