"""The order of `make test`'s integration part (tests/conftest.py): the end-to-end and two-node tests first, then
the tests that start a Ray of their own in the test process, then the rest as collected."""

from __future__ import annotations

import types

import pytest

import conftest


class FakeItem:
    """What the hook reads of a collected test: its module and markers."""

    def __init__(self, module: str, *marks) -> None:
        self.module = types.SimpleNamespace(__name__=module)
        self.marks = [m.mark for m in marks]

    def get_closest_marker(self, name: str):
        return next((m for m in self.marks if m.name == name), None)


def test_end_to_end_tests_go_first_then_those_that_need_no_ray_in_this_process():
    items = [FakeItem("tests.test_engines"), FakeItem("tests.test_startup_failures", pytest.mark.before_any_ray),
             FakeItem("tests.test_sft"), FakeItem("tests.test_two_nodes"), FakeItem("tests.test_train_e2e"),
             FakeItem("tests.test_gateway", pytest.mark.integration)]
    conftest.pytest_collection_modifyitems(None, items)
    assert [i.module.__name__ for i in items] == ["tests.test_train_e2e", "tests.test_two_nodes",
                                                  "tests.test_startup_failures", "tests.test_engines",
                                                  "tests.test_sft", "tests.test_gateway"]


def test_the_ray_tests_that_would_skip_after_a_session_ray_are_marked():
    """The test that skips where a Ray is already up carries the marker that runs it before any is."""
    import test_startup_failures

    test = test_startup_failures.test_a_ray_actor_that_dies_in_its_creation_task_is_named_with_its_own_error
    assert any(m.name == "before_any_ray" for m in test.pytestmark)
