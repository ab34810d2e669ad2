"""The full tier's list: its patterns match node ids literally but for `*`, and every line
names a test that exists (conftest.py also refuses a stale line when whole files run)."""

import conftest


def test_patterns_match_ids_literally_but_for_the_star():
    rx = conftest.full_tier_regex("tests/test_a.py::test_b[x-1]")
    assert rx.match("tests/test_a.py::test_b[x-1]")
    assert not rx.match("tests/test_a.py::test_b[x-2]")
    assert not rx.match("tests/test_a.py::test_b[x]")  # brackets are not a character class
    star = conftest.full_tier_regex("tests/test_a.py::test_b[deepseek-*]")
    assert star.match("tests/test_a.py::test_b[deepseek-v3-1m]")
    assert not star.match("tests/test_a.py::test_b[llama3.1-8b-1m]")


def test_every_line_names_a_file_and_a_test_in_it():
    root = conftest.FULL_TIER.parent.parent
    for line in conftest._full_tier_patterns():
        path, _, rest = line.partition("::")
        name = rest.split("[")[0]
        assert (root / path).is_file(), line
        assert f"def {name}(" in (root / path).read_text(), line
