"""Exact-match scoring of a generated answer."""


def score(output: str, answer: str) -> bool:
    """Whether a greedy continuation gives `answer`: `output` without its leading
    whitespace starts with `answer`, and the character after it (if any) is no letter or
    digit. The runner generates a few tokens past the answer, so `"71432."` and
    `"71432 is the key"` are right for `"71432"`; `"714329"`, `"7143"` and `""` are wrong.

    **Arguments:**

    - `output`: the decoded continuation.
    - `answer`: the expected answer (`Sample.answer`); surrounding whitespace is ignored.

    **Returns:** `True` for a right answer.

    **Raises:** `ValueError` for an empty (or all-whitespace) `answer`.
    """
    expected = answer.strip()
    if not expected:
        raise ValueError(
            f"answer must be a non-empty text to match; got {answer!r}. Pass Sample.answer."
        )
    given = output.lstrip()
    if not given.startswith(expected):
        return False
    after = given[len(expected) : len(expected) + 1]
    return not after.isalnum()
