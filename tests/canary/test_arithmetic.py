"""The canary's questions and the exact grading of replies."""

from __future__ import annotations

import pytest

from kvroute.canary.questions import Verdict, grade, make_questions
from kvroute.sim.answers import arithmetic_answer


def test_questions_are_distinct_deterministic_and_right() -> None:
    questions = make_questions(500, seed=7)
    assert len({q.text for q in questions}) == 500
    assert questions == make_questions(500, seed=7)
    assert questions != make_questions(500, seed=8)
    apply = {"+": lambda a, b: a + b, "-": lambda a, b: a - b, "*": lambda a, b: a * b}
    for q in questions:
        left, op, right = q.text.removeprefix("What is ").removesuffix("?").split()
        assert apply[op](int(left), int(right)) == q.answer


def test_the_simulators_answer_mode_reads_every_question() -> None:
    for q in make_questions(200, seed=1):
        prompt = f"<|im_start|>user\nriver stone garden.\n\n{q.text}<|im_end|>\n<|im_start|>assistant\n"
        assert arithmetic_answer(prompt.encode()) == str(q.answer).encode()


@pytest.mark.parametrize(("content", "finish", "verdict"), [
    ("773", "stop", Verdict.CORRECT),
    ("773    ", "stop", Verdict.CORRECT),
    ("The answer is 773.", "stop", Verdict.CORRECT),
    ("276 + 497 = 773", "stop", Verdict.CORRECT),
    ("<think>276 plus 497 is 770? no, 773</think>\n773", "stop", Verdict.CORRECT),
    ("773.0", "stop", Verdict.CORRECT),
    ("772", "stop", Verdict.WRONG),
    ("seven hundred seventy-three", "stop", Verdict.WRONG),
    ("The answer is", "length", Verdict.TRUNCATED),
    ("", "stop", Verdict.EMPTY),
    ("   \n", "stop", Verdict.EMPTY),
    ("<think>hmm</think>", "stop", Verdict.EMPTY),
    ("!!!!!!!!!!!!!!!!", "length", Verdict.MALFORMED),
    ("773!!!!", "stop", Verdict.MALFORMED),
    ("...", "stop", Verdict.MALFORMED),
])
def test_grade(content: str, finish: str, verdict: Verdict) -> None:
    assert grade(content, finish, 773) is verdict


def test_grade_thousands_separator_and_errors() -> None:
    assert grade("65,095", "stop", 65095) is Verdict.CORRECT
    assert grade(None, None, 1, error="HTTP 500: boom") is Verdict.ERROR
    assert grade("1", "stop", 1, error="HTTP 500: boom") is Verdict.ERROR
    # A 200 that is not a chat completion is the replica's own wrong answer, not a failed request.
    not_one = grade(None, None, 1, error="not a chat completion: no choices", not_an_answer=True)
    assert not_one is Verdict.MALFORMED
