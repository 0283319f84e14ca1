"""Adds up the collections ``sitecustomize.py`` logged, per router process: after the first
``--skip`` seconds (start-up: imports, the first probes), by generation, with the CPU they took."""

from __future__ import annotations

import argparse
import glob
import os


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("dir", help="the KVROUTE_GC_PROBE directory")
    p.add_argument("--skip", type=float, default=3.0, help="seconds of start-up left out (default 3)")
    args = p.parse_args()
    for path in sorted(glob.glob(os.path.join(args.dir, "gc.*.txt"))):
        with open(path) as f:
            argv, *lines = f.read().splitlines()
        rows = [line.split() for line in lines]
        if not rows:
            continue
        first = float(rows[0][0])
        run = [r for r in rows if float(r[0]) - first >= args.skip]
        counts = [sum(1 for r in run if r[1] == str(g)) for g in range(3)]
        cpu_ms = [sum(int(r[2]) for r in run if r[1] == str(g)) / 1000 for g in range(3)]
        collected = sum(int(r[3]) for r in run)
        print(f"{os.path.basename(path)} {argv.split()[0]}\n"
              f"  collections by generation {counts}, CPU ms {cpu_ms} (total {sum(cpu_ms):.1f}), "
              f"objects collected {collected}")


if __name__ == "__main__":
    main()
