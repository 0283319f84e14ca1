"""What the local tokenizer (api/local_tokens.py) costs a request of the shared-prefix workload:
groups of new conversations, each group under its own long system prompt, each conversation its
own short question (llm-d's benchmark shape, as benchmarks/ab_shared_prefix.py sends it).  Every
request is a first turn, so the per-conversation tail rule does not apply; the shared heads do.

    python benchmarks/bench_local_tokens.py --tokenizer ~/.cache/kvroute-vllm/model/SmolLM2-135M-Instruct

Per request, in-process, with the shared heads and with them emptied before each request (every
system prompt encoded whole, as before they were kept), alternating by round; p50 and p99 over
the requests of every round.
"""

from __future__ import annotations

import argparse
import random
import statistics
import time

# Run as a script, this directory is on the path.
from subagents import WORDS, words

from kvroute.api.local_tokens import ChatTokenizer


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--tokenizer", required=True, help="the model's folder (tokenizer.json, chat template)")
    p.add_argument("--groups", type=int, default=14)
    p.add_argument("--questions", type=int, default=32)
    p.add_argument("--system-chars", type=int, default=38_000,
                   help="about 6,000 of SmolLM2-135M's tokens (default 38,000)")
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args()

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


if __name__ == "__main__":
    main()
