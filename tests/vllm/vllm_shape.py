"""Comparing the shape of two engines' answers: Prometheus expositions (sample names, label keys,
metric types) and JSON documents (keys and value types), to keep the simulator honest against vLLM."""

from __future__ import annotations

import re
from collections import defaultdict
from dataclasses import dataclass
from pathlib import Path
from typing import Any

_SUFFIXES = ("_total", "_bucket", "_count", "_sum", "_created", "_info")
_LABEL_KEY = re.compile(r'([A-Za-z_][A-Za-z0-9_]*)="(?:[^"\\]|\\.)*"')
# Names of engine metrics as consumers write them in source: "vllm:..." and the process start time.
_USED = re.compile(r"[\"'](vllm:[a-z0-9_:]+|process_start_time_seconds)[\"']")
# Producers of expositions, not consumers: their names are what is being checked.
_PRODUCERS = ("sim",)


@dataclass(frozen=True)
class Exposition:
    """What a ``/metrics`` body declares: family types, and the label-key sets of each sample name."""

    kinds: dict[str, str]
    labels: dict[str, set[frozenset[str]]]

    def kind(self, sample: str) -> str | None:
        """The declared type of the family ``sample`` belongs to (either naming of counters)."""
        if sample in self.kinds:
            return self.kinds[sample]
        for suffix in _SUFFIXES:
            if sample.endswith(suffix):
                base = sample[: -len(suffix)]
                if base in self.kinds:
                    return self.kinds[base]
        return None


def parse_exposition(text: str) -> Exposition:
    """Read the TYPE lines and the sample lines of a Prometheus text exposition."""
    kinds: dict[str, str] = {}
    labels: dict[str, set[frozenset[str]]] = defaultdict(set)
    for line in text.splitlines():
        if line.startswith("# TYPE "):
            _, _, name, kind = line.split(maxsplit=3)
            kinds[name] = kind.strip()
        elif line and not line.startswith("#"):
            brace, space = line.find("{"), line.find(" ")
            if brace != -1 and (space == -1 or brace < space):
                name, inner = line[:brace], line[brace + 1 : line.rfind("}")]
                labels[name].add(frozenset(_LABEL_KEY.findall(inner)))
            else:
                labels[line[:space]].add(frozenset())
    return Exposition(kinds, dict(labels))


def used_metric_names(package_root: Path) -> set[str]:
    """Every engine metric name the router and the doctor read, found in their source."""
    names: set[str] = set()
    for path in package_root.rglob("*.py"):
        if path.relative_to(package_root).parts[0] in _PRODUCERS:
            continue
        names.update(_USED.findall(path.read_text(encoding="utf-8")))
    return names


def _samples_of(name: str, exposition: Exposition) -> list[str]:
    """The sample names a consumer's ``name`` stands for (itself, or its family's samples)."""
    return [s for s in (name, *(name + suffix for suffix in _SUFFIXES)) if s in exposition.labels]


def exposition_drift(real: Exposition, sim: Exposition, used: set[str]) -> list[str]:
    """Where ``sim`` differs from ``real``: names kvroute reads that sim lacks, names sim invents,
    and label-key sets or types that differ on the names both expose."""
    problems: list[str] = []
    for name in sorted(used):
        for sample in _samples_of(name, real):
            if sample not in sim.labels:
                problems.append(f"missing {sample} (real vLLM has it and kvroute reads {name})")
    for sample in sorted(sim.labels):
        if sample not in real.labels:
            if sample.startswith("vllm:"):
                problems.append(f"invented {sample} (real vLLM does not expose it)")
            continue
        if sim.labels[sample] != real.labels[sample]:
            problems.append(_label_drift(sample, real.labels[sample], sim.labels[sample]))
        if sim.kind(sample) != real.kind(sample):
            problems.append(f"type of {sample}: vLLM {real.kind(sample)}, sim {sim.kind(sample)}")
    return problems


def _label_drift(sample: str, real: set[frozenset[str]], sim: set[frozenset[str]]) -> str:
    real_keys, sim_keys = set().union(*real), set().union(*sim)
    missing, extra = sorted(real_keys - sim_keys), sorted(sim_keys - real_keys)
    if missing or extra:
        return f"labels of {sample}: sim lacks {missing}, sim adds {extra}"
    return f"label sets of {sample}: vLLM {sorted(map(sorted, real))}, sim {sorted(map(sorted, sim))}"


def json_shape(doc: Any) -> Any:
    """Keys and value types of a JSON document (a list's shape is its first element's)."""
    if isinstance(doc, dict):
        return {key: json_shape(value) for key, value in doc.items()}
    if isinstance(doc, list):
        return [json_shape(doc[0])] if doc else []
    if doc is None:
        return "null"
    return type(doc).__name__


def shape_drift(real: Any, sim: Any, path: str = "$") -> list[str]:
    """Where the JSON shape ``sim`` differs from ``real`` (missing or extra keys, other types)."""
    if isinstance(real, dict) and isinstance(sim, dict):
        problems = [f"{path}.{key}: missing in sim" for key in sorted(real.keys() - sim.keys())]
        problems += [f"{path}.{key}: not in vLLM" for key in sorted(sim.keys() - real.keys())]
        for key in sorted(real.keys() & sim.keys()):
            problems += shape_drift(real[key], sim[key], f"{path}.{key}")
        return problems
    if isinstance(real, list) and isinstance(sim, list):
        if real and sim:
            return shape_drift(real[0], sim[0], f"{path}[0]")
        return [] if bool(real) == bool(sim) else [f"{path}: vLLM {'non-' if real else ''}empty list"]
    if real != sim and "null" not in (real, sim):
        return [f"{path}: vLLM {real}, sim {sim}"]
    return []
