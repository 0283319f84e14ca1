"""What a model alias adds to one request, in-process: resolving the name, the request body for the
worker (spliced, or re-encoded), and renaming the answer (a plain JSON answer, or every event of a stream).

    python benchmarks/bench_model_alias.py            # a Markdown table of medians (µs)
    python benchmarks/bench_model_alias.py --quick

The request is shaped like Claude Code's (``tests/clients``): ~7 KB of system text, ~32 KB of
tools, a few turns; ``parse`` (``parse_request``, paid by every request alias or not) is shown
for scale.  Requests that no alias changes pay one ``resolve`` (with no alias and no default
model configured, nothing at all).
"""

from __future__ import annotations

import argparse
import dataclasses
import statistics
import time
from collections.abc import Callable

import orjson

from kvroute.api.model_aliases import ModelAliases, body_for
from kvroute.api.requests import parse_request
from kvroute.server.model_names import AnswerRename

ASKED, TARGET = "claude-opus-4-1-20250805", "qwen3-4b"


def claude_code_body(turns: int) -> dict[str, object]:
    tool = {"name": "Tool", "description": "does a thing with files and shells " * 20,
            "input_schema": {"type": "object", "properties": {
                f"p{i}": {"type": "string", "description": "x" * 40} for i in range(6)}}}
    messages: list[dict[str, object]] = []
    for i in range(turns):
        text = f"turn {i}: " + "fix the bug " * 40
        messages.append({"role": "user", "content": [{"type": "text", "text": text}]})
        messages.append({"role": "assistant", "content": [{"type": "text", "text": "done " * 60}]})
    messages.append({"role": "user", "content": "and now?"})
    return {"model": ASKED, "max_tokens": 32000, "stream": True,
            "system": [{"type": "text", "text": "You are Claude Code. " * 330}],
            "tools": [dict(tool, name=f"Tool{i}") for i in range(36)], "messages": messages,
            "metadata": {"user_id": "user_abc_account_def_session_0f0f"}}


def anthropic_stream(events: int) -> list[bytes]:
    def ev(name: str, data: object) -> bytes:
        return b"event: " + name.encode() + b"\ndata: " + orjson.dumps(data) + b"\n\n"
    out = [ev("message_start", {"type": "message_start", "message": {
        "id": "msg_1", "type": "message", "role": "assistant", "model": TARGET, "content": [],
        "stop_reason": None, "usage": {"input_tokens": 12000, "output_tokens": 0}}})]
    delta = ev("content_block_delta", {"type": "content_block_delta", "index": 0,
                                       "delta": {"type": "text_delta", "text": " word"}})
    out += [delta] * events
    out.append(ev("message_stop", {"type": "message_stop"}))
    return out


def openai_stream(events: int) -> list[bytes]:
    chunk = {"id": "c", "object": "chat.completion.chunk", "created": 1, "model": TARGET,
             "choices": [{"index": 0, "delta": {"content": " word"}}]}
    return [b"data: " + orjson.dumps(chunk) + b"\n\n"] * events


def median_us(fn: Callable[[], object], reps: int) -> float:
    for _ in range(min(reps, 200)):
        fn()
    samples = []
    for _ in range(reps):
        start = time.perf_counter_ns()
        fn()
        samples.append((time.perf_counter_ns() - start) / 1000)
    return statistics.median(samples)


def main(args: argparse.Namespace) -> None:
    reps = 300 if args.quick else 3000
    aliases = ModelAliases({"claude-*": TARGET})
    fleet = [frozenset({TARGET})] * 4
    rename = AnswerRename(ASKED, TARGET)
    rows: list[tuple[str, float]] = []
    for turns in (1, 20):
        doc = claude_code_body(turns)
        raw = orjson.dumps(doc)  # "model" first, as Claude Code sends it: spliced
        middle = orjson.dumps({"messages": doc["messages"], **doc})  # "model" inside: re-encoded
        key = parse_request("messages", doc, {})
        label = f"{len(raw) // 1024} KB request"
        rows.append((f"{label}: parse (every request, for scale)", median_us(
            lambda doc=doc: parse_request("messages", doc, {}), reps)))
        for how, body in (("model first: spliced", raw), ("model inside: re-encoded", middle)):
            rows.append((f"{label}, {how}: resolve + body + key + rename", median_us(
                lambda body=body, doc=doc, key=key: (
                    aliases.resolve(ASKED, lambda m: any(m in s for s in fleet)), body_for(body, doc, TARGET),
                    dataclasses.replace(key, model=TARGET), AnswerRename(ASKED, TARGET)), reps)))
    rows.append(("resolve alone (glob, memo hit; 4 workers)", median_us(
        lambda: aliases.resolve(ASKED, lambda m: any(m in s for s in fleet)), reps * 10)))
    rows.append(("resolve of a served name (no rewrite)", median_us(
        lambda: aliases.resolve(TARGET, lambda m: any(m in s for s in fleet)), reps * 10)))
    for name, stream in (("Anthropic", anthropic_stream(200)), ("OpenAI", openai_stream(200))):
        chunks = [b"".join(stream[i:i + 4]) for i in range(0, len(stream), 4)]  # a few events per read
        rows.append((f"{name} stream of {len(stream)} events, renamed ({len(chunks)} chunks)", median_us(
            lambda chunks=chunks: [rename.events(c) for c in chunks], reps)))
    answer = orjson.dumps({"id": "msg_1", "type": "message", "role": "assistant", "model": TARGET,
                           "content": [{"type": "text", "text": "word " * 200}], "stop_reason": "end_turn",
                           "usage": {"input_tokens": 12000, "output_tokens": 200}})
    rows.append((f"plain answer of {len(answer)} bytes, renamed",
                 median_us(lambda: rename.document(answer), reps)))
    print("| step | median (µs) |\n|---|---:|")
    for label, us in rows:
        print(f"| {label} | {us:.1f} |")


if __name__ == "__main__":
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--quick", action="store_true")
    main(p.parse_args())
