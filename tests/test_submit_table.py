"""``Policy.submit`` dispatches on a table of typed entries (``dask_lm.engine.policy.SUBMIT``), not on a method name
turned into an attribute: each entry posts its call and says what kind of answer it joins into. Fast: no cluster
(the checks run before anything is posted)."""

from __future__ import annotations

import inspect

import pytest

from dask_lm.data.messages import JoinGenerated, JoinRows, ReduceTrain
from dask_lm.engine.policy import SUBMIT, SUBMITTABLE, Policy


def _bare_policy() -> Policy:
    return object.__new__(Policy)  # submit's method checks need no cluster


def test_each_entry_takes_the_blocking_method_s_arguments():
    """``submit(method, ...)`` takes what ``method`` takes: the entry's post has the blocking method's parameters."""
    assert SUBMITTABLE == (
        "get_logprobs",
        "get_reference_policy_logprobs",
        "get_topk_logits",
        "score",
        "generate",
        "train",
    )
    for name, entry in SUBMIT.items():
        blocking = inspect.signature(getattr(Policy, name)).parameters
        posted = inspect.signature(entry.post).parameters
        assert list(posted) == list(blocking), name
        assert [p.default for p in posted.values()] == [p.default for p in blocking.values()], name


def test_each_entry_names_its_kind_of_answer():
    assert {n: e.join for n, e in SUBMIT.items()} == {
        "get_logprobs": JoinRows,
        "get_reference_policy_logprobs": JoinRows,
        "get_topk_logits": JoinRows,
        "score": JoinRows,
        "generate": JoinGenerated,
        "train": ReduceTrain,
    }


def test_an_unknown_method_is_named_with_the_valid_ones():
    with pytest.raises(
        ValueError,
        match=r"Policy.submit: 'save_checkpoint' cannot be submitted; use one of "
        r"\['get_logprobs', .*'train'\]",
    ):
        _bare_policy().submit("save_checkpoint", "/tmp/x")


@pytest.mark.parametrize("method", ["generate", "train"])
def test_only_rows_can_stay_on_the_workers(method):
    with pytest.raises(ValueError, match=rf"Policy.submit\('{method}', collect=False\): only the inference calls"):
        _bare_policy().submit(method, None, collect=False)
