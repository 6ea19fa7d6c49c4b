import math

import pytest

from medha.core.request import InvalidTransition, Request
from medha.core.request import RequestState as S


def test_valid_request_starts_waiting():
    r = Request("a", 0.0, 10, 5)
    assert r.state is S.WAITING and r.num_tokens == 10 and r.num_unscheduled == 10


def test_from_tokens_sets_length():
    r = Request.from_tokens("a", 0.0, [1, 2, 3], 4)
    assert r.prompt_len == 3 and r.prompt_token_ids == [1, 2, 3]


def test_context_token_ids_read_prompt_then_outputs():
    r = Request.from_tokens("a", 0.0, [1, 2, 3], 4)
    r.output_token_ids += [4, 5]
    assert [r.context_token_ids(s, e) for s, e in ((0, 3), (1, 4), (3, 5), (4, 5), (0, 5))] == [
        [1, 2, 3],
        [2, 3, 4],
        [4, 5],
        [5],
        [1, 2, 3, 4, 5],
    ]
    with pytest.raises(ValueError, match="no token ids"):
        Request("b", 0.0, 3, 4).context_token_ids(0, 1)


@pytest.mark.parametrize(
    "kwargs, field",
    [
        (dict(max_tokens=0), "max_tokens"),
        (dict(max_tokens=-3), "max_tokens"),
        (dict(prompt_len=0), "prompt"),
        (dict(ttft_deadline_s=0.0), "ttft_deadline_s"),
        (dict(ttft_deadline_s=-1.0), "ttft_deadline_s"),
        (dict(ttft_deadline_s=math.nan), "ttft_deadline_s"),
        (dict(tpot_target_s=0), "tpot_target_s"),
        (dict(arrival_s=math.inf), "arrival_s"),
        (dict(request_id=""), "request_id"),
    ],
)
def test_bad_fields_are_named(kwargs, field):
    base = dict(request_id="a", arrival_s=0.0, prompt_len=8, max_tokens=4)
    base.update(kwargs)
    with pytest.raises(ValueError, match=field):
        Request(**base)


def test_empty_token_list_is_an_empty_prompt():
    with pytest.raises(ValueError, match="prompt"):
        Request.from_tokens("a", 0.0, [], 4)


def test_length_mismatch_is_reported():
    with pytest.raises(ValueError, match="prompt_len"):
        Request("a", 0.0, 5, 4, prompt_token_ids=[1, 2])


def test_context_limits():
    r = Request("a", 0.0, 100, 10)
    with pytest.raises(ValueError, match="max_model_len"):
        r.validate(max_model_len=50)
    with pytest.raises(ValueError, match="prompt_len \\+ max_tokens"):
        r.validate(max_model_len=105)
    r.validate(max_model_len=110)


@pytest.mark.parametrize(
    "path",
    [
        [S.PREFILLING, S.DECODING, S.FINISHED],
        [S.PREFILLING, S.FINISHED],
        [
            S.PREFILLING,
            S.PREEMPTED,
            S.PREFILLING,
            S.DECODING,
            S.PREEMPTED,
            S.PREFILLING,
            S.DECODING,
            S.ABORTED,
        ],
        [S.ABORTED],
    ],
)
def test_allowed_paths(path):
    r = Request("a", 0.0, 4, 4)
    for state in path:
        r.transition(state)
    assert r.state is path[-1]


@pytest.mark.parametrize(
    "path",
    [
        [S.DECODING],  # decoding needs a prefill first
        [S.FINISHED],
        [S.PREFILLING, S.WAITING],
        [S.PREFILLING, S.DECODING, S.PREFILLING],  # a decode only re-prefills after preemption
        [S.ABORTED, S.PREFILLING],
        [S.PREFILLING, S.FINISHED, S.DECODING],
    ],
)
def test_forbidden_transitions(path):
    r = Request("a", 0.0, 4, 4)
    with pytest.raises(InvalidTransition):
        for state in path:
            r.transition(state)


def test_slack_definitions():
    r = Request("a", 1.0, 4, 4)
    r.deadline_s, r.total_work_s, r.remaining_work_s = 11.0, 4.0, 2.0
    assert r.slack(3.0) == pytest.approx(11 - 3 - 2)
    assert r.relative_slack(3.0, "remaining") == pytest.approx(6 / 2)
    assert r.relative_slack(3.0, "total") == pytest.approx(6 / 4)
    with pytest.raises(ValueError, match="remaining.*total"):
        r.relative_slack(3.0, "left")
