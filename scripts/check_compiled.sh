#!/usr/bin/env bash
# The compiled build's check (docs/design.md, "Compiled modules"): builds the wheel with the mypyc
# hook (pyproject.toml, off by default) from a copy of this checkout, installs it into a fresh
# virtual environment and runs tests against it.
#
#   scripts/check_compiled.sh                    # tests/routing against the compiled wheel
#   scripts/check_compiled.sh tests/routing/test_pruning.py -x
#   KEEP=1 scripts/check_compiled.sh             # keep the venv (printed) to benchmark with
#
# Needs a C compiler and the test dependencies installed for python3 (`pip install -e '.[test]'`):
# the venv sees them (--system-site-packages) and adds only hatch-mypyc when missing.  The build
# runs in a copy because mypyc writes its .so files beside the sources (`build_ext --inplace`): in
# this checkout they would shadow the pure-Python modules for `pip install -e .` and PYTHONPATH=src.
set -euo pipefail
root="$(cd "$(dirname "$0")/.." && pwd)"
work="$(mktemp -d)"
if [ -z "${KEEP:-}" ]; then trap 'rm -rf "$work"' EXIT; fi

mkdir "$work/tree"
# Tracked and untracked-but-not-ignored files, as they are now (uncommitted edits included).
(cd "$root" && git ls-files -z -co --exclude-standard | while IFS= read -r -d '' f; do
   [ -e "$f" ] && printf '%s\0' "$f"; done | tar --null -cf - -T -) | tar -xf - -C "$work/tree"

python3 -m venv --system-site-packages "$work/venv"
py="$work/venv/bin/python"
"$py" -c 'import hatch_mypyc' 2>/dev/null || "$py" -m pip install -q 'hatch-mypyc>=0.16'

started=$SECONDS
(cd "$work/tree" && HATCH_BUILD_HOOK_ENABLE_MYPYC=true "$py" -m pip wheel -q --no-deps \
   --no-build-isolation -w "$work/dist" .)
"$py" -m pip install -q --no-deps "$work"/dist/kvroute-*.whl
echo "compiled wheel: $((SECONDS - started)) s to build and install"

# The tests must see the compiled modules, not a checkout's sources.
(cd "$root" && "$py" - <<'EOF'
import importlib
import tomllib

with open("pyproject.toml", "rb") as f:
    hook = tomllib.load(f)["tool"]["hatch"]["build"]["targets"]["wheel"]["hooks"]["mypyc"]
compiled = [p.removeprefix("src/").removesuffix(".py").replace("/", ".") for p in hook["include"]]
for name in compiled:
    path = importlib.import_module(name).__file__ or ""
    if not path.endswith(".so"):
        raise SystemExit(f"{name} is not the compiled module: {path}")
print(f"compiled: {', '.join(compiled)}")
EOF
)

started=$SECONDS
rc=0
(cd "$root" && "$py" -m pytest -q -p no:cacheprovider "${@:-tests/routing}") || rc=$?
echo "tests against the compiled wheel: $((SECONDS - started)) s, exit $rc"
[ -n "${KEEP:-}" ] && echo "kept: $work (python: $py)"
exit "$rc"
