"""CPU per sync message of signing and checking it (sync/trust.py), beside what encoding and
decoding the same message already costs.  In-process, no Redis: the figures are the bus's work per
message, sender and receiver.

Messages as the bus sends them: a heartbeat for 4 and for 64 workers, a facts message of one prefix
record (the common live case: one decision) and a full batch (256 records of 100 block hashes, the
largest the bus builds).  Each figure is the fastest of ``--rounds`` rounds of ``--repeat`` calls.

    python benchmarks/bench_sync_signing.py
    python benchmarks/bench_sync_signing.py --rounds 9 --repeat 2000 --json out.json
"""

from __future__ import annotations

import argparse
import json
import os
import random
import time
from collections.abc import Callable
from typing import Any

from kvroute.routing.sync_record import PrefixRecord, SyncRecord
from kvroute.sync.messages import (
    FactsMessage,
    LoadMessage,
    WorkerLoad,
    decode_facts,
    decode_load,
    encode_facts,
    encode_load,
)
from kvroute.sync.trust import Signer, check_facts, check_load

SECRET = b"0123456789abcdef0123456789abcdef"
NOW = time.time()


def fastest_us(fn: Callable[[], Any], repeat: int, rounds: int) -> float:
    """Fastest mean time per call over ``rounds`` rounds of ``repeat`` calls, in microseconds."""
    best = float("inf")
    for _ in range(rounds):
        start = time.perf_counter()
        for _ in range(repeat):
            fn()
        best = min(best, (time.perf_counter() - start) / repeat)
    return best * 1e6


def heartbeat(workers: int) -> LoadMessage:
    return LoadMessage("host:1234:abcdef", NOW, 1.0,
                       {f"10.0.0.{i}:8000": WorkerLoad(i % 17, NOW - 3600) for i in range(workers)})


def facts(records: int, rng: random.Random) -> FactsMessage:
    recs: tuple[SyncRecord, ...] = tuple(
        PrefixRecord(f"10.0.0.{i % 8}:8000", NOW - 3600, NOW, tuple(rng.getrandbits(64) for _ in range(100)),
                     prefill_tokens=2000) for i in range(records))
    return FactsMessage("host:1234:abcdef", NOW, recs)


def measure(name: str, payload: bytes, decode: Callable[[Any], Any], check: Callable[[Any], None],
            args: argparse.Namespace) -> dict[str, Any]:
    signer = Signer(SECRET)
    fields = signer.fields(payload)
    unsigned = {k: v for k, v in fields.items() if k == b"m"}
    repeat = max(20, args.repeat * 1000 // max(1000, len(payload)))  # big batches: fewer calls
    msg = decode(unsigned)
    row = {
        "message": name, "bytes": len(payload),
        "sign_us": fastest_us(lambda: signer.fields(payload), repeat, args.rounds),
        "verify_us": fastest_us(lambda: signer.verify(fields), repeat, args.rounds),
        "bounds_us": fastest_us(lambda: check(msg), repeat, args.rounds),
        "decode_us": fastest_us(lambda: decode(unsigned), repeat, args.rounds),
    }
    row["added_share_of_decode"] = (row["verify_us"] + row["bounds_us"]) / row["decode_us"]
    return row


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--rounds", type=int, default=7)
    p.add_argument("--repeat", type=int, default=5000, help="calls per round for a 1 KB message")
    p.add_argument("--json", help="also write the rows here")
    args = p.parse_args()
    rng = random.Random(0)

    def held(_: str) -> float | None:
        return None

    def load_check(m: LoadMessage) -> None:
        check_load(m, now=NOW, max_skew_s=60.0, live=True, held_epoch=held, max_inflight=lambda _: 768)

    def facts_check(m: FactsMessage) -> None:
        check_facts(m, now=NOW, max_skew_s=60.0, held_epoch=held)

    rows = [
        measure("heartbeat, 4 workers", encode_load(heartbeat(4)), decode_load, load_check, args),
        measure("heartbeat, 64 workers", encode_load(heartbeat(64)), decode_load, load_check, args),
        measure("facts, 1 prefix record", encode_facts(facts(1, rng)), decode_facts, facts_check, args),
        measure("facts, 256 prefix records", encode_facts(facts(256, rng)), decode_facts, facts_check, args),
    ]
    print(f"cpus={os.cpu_count()} load average {os.getloadavg()[0]:.2f}; fastest of {args.rounds} rounds")
    print(f"{'message':28} {'bytes':>9} {'sign µs':>9} {'verify µs':>10} {'bounds µs':>10} {'decode µs':>10} "
          f"{'added':>7}")
    for r in rows:
        print(f"{r['message']:28} {r['bytes']:>9,} {r['sign_us']:>9.2f} {r['verify_us']:>10.2f} "
              f"{r['bounds_us']:>10.2f} {r['decode_us']:>10.2f} {r['added_share_of_decode']:>6.0%}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(rows, f, indent=2)


if __name__ == "__main__":
    main()
