"""The canary's questions: short arithmetic with answers known exactly, and the grading of replies."""

from __future__ import annotations

import random
import re
from dataclasses import dataclass
from enum import StrEnum

# "*" rather than "×": plain ASCII every engine and tokenizer reads the same way.
_OPS = ("+", "-", "*")
_THINK = re.compile(r"<think>.*?(?:</think>|$)", re.S)
_NUMBER = re.compile(r"-?\d+(?:\.\d+)?")
_DIGIT_COMMA = re.compile(r"(?<=\d),(?=\d{3}\b)")
_BANGS = re.compile(r"!{3,}")


@dataclass(frozen=True, slots=True)
class Question:
    """One question and its exact answer."""

    text: str
    answer: int


class Verdict(StrEnum):
    """How one reply was judged; everything but ``correct`` is a failure."""

    CORRECT = "correct"
    WRONG = "wrong"  # a number, but not the answer
    EMPTY = "empty"  # no content at all
    # A run of "!" or no letters or digits (the silent corruption seen upstream), or a 200 whose
    # body is not a chat completion at all: not an answer.
    MALFORMED = "malformed"
    TRUNCATED = "truncated"  # cut off by max_tokens before any right answer
    ERROR = "error"  # no completion: transport failure, timeout, HTTP error


def make_questions(count: int, seed: int) -> list[Question]:
    """``count`` distinct questions; the same seed always gives the same list."""
    rng = random.Random(seed)
    seen: set[str] = set()
    questions: list[Question] = []
    while len(questions) < count:
        a, b, op = rng.randint(10, 999), rng.randint(10, 999), rng.choice(_OPS)
        expression = f"{a} {op} {b}"
        if expression in seen:
            continue
        seen.add(expression)
        answer = a + b if op == "+" else a - b if op == "-" else a * b
        questions.append(Question(f"What is {expression}?", answer))
    return questions


def grade(content: str | None, finish_reason: str | None, expected: int, error: str | None = None, *,
          not_an_answer: bool = False) -> Verdict:
    """Judge one reply: the last number in it must equal ``expected`` exactly.  ``not_an_answer``:
    the replica answered 200 with something that is not a chat completion, a wrong answer of its
    own (``error`` alone is a request that failed, which says nothing about the answers)."""
    if not_an_answer:
        return Verdict.MALFORMED
    if error is not None or content is None:
        return Verdict.ERROR
    text = _THINK.sub("", content).strip()
    if not text:
        return Verdict.EMPTY
    if _BANGS.search(text) or not any(ch.isalnum() for ch in text):
        return Verdict.MALFORMED
    numbers = _NUMBER.findall(_DIGIT_COMMA.sub("", text))
    if numbers and _equals(numbers[-1], expected):
        return Verdict.CORRECT
    return Verdict.TRUNCATED if finish_reason == "length" else Verdict.WRONG


def _equals(number: str, expected: int) -> bool:
    try:
        return float(number) == expected
    except ValueError:
        return False
