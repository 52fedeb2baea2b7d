"""`pdserve up`'s core plan: decodes own their cores, prefills split what is left."""

from pdserve.entrypoints.up import share_cores


def test_two_cores_one_prefill_one_decode_get_a_core_each():
    assert share_cores([0, 1], 1, 1, 1, 1) == {"prefill": [({0}, 1, 0)],
                                                "decode": [({1}, 1, 0)]}


def test_prefills_split_the_cores_the_decode_ranks_leave():
    plan = share_cores(list(range(8)), 2, 1, 1, 2)
    assert plan["decode"] == [({7, 6}, 1, 0)]
    assert plan["prefill"] == [({0, 1, 2}, 3, 0), ({3, 4, 5}, 3, 0)]


def test_prefill_ranks_divide_their_share_of_threads():
    assert share_cores(list(range(6)), 1, 2, 2, 1)["prefill"] == [({0, 1, 2, 3}, 2, 0)]


def test_with_no_core_left_prefills_share_all_at_lower_priority():
    plan = share_cores([0, 1], 1, 1, 2, 1)
    assert plan["decode"] == [({1}, 1, 0), ({0}, 1, 0)]
    assert plan["prefill"] == [(None, 2, 10)]
    assert share_cores([5], 1, 1, 1, 1) == {"prefill": [(None, 1, 0)],
                                             "decode": [({5}, 1, 0)]}
