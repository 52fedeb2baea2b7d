"""`pdserve up`'s core plan: decodes own their cores, prefills (and the proxy) split what
is left."""

import argparse
import os

from pdserve.entrypoints import up


def test_two_cores_one_prefill_one_decode_get_a_core_each():
    assert up.share_cores([0, 1], 1, 1, 1, 1) == {"prefill": [({0}, 1, 0)],
                                                "decode": [({1}, 1, 0)]}


def test_prefills_split_the_cores_the_decode_ranks_leave():
    plan = up.share_cores(list(range(8)), 2, 1, 1, 2)
    assert plan["decode"] == [({7, 6}, 1, 0)]
    assert plan["prefill"] == [({0, 1, 2}, 3, 0), ({3, 4, 5}, 3, 0)]


def test_prefill_ranks_divide_their_share_of_threads():
    assert up.share_cores(list(range(6)), 1, 2, 2, 1)["prefill"] == [({0, 1, 2, 3}, 2, 0)]


def test_with_no_core_left_prefills_share_all_at_lower_priority():
    plan = up.share_cores([0, 1], 1, 1, 2, 1)
    assert plan["decode"] == [({1}, 1, 0), ({0}, 1, 0)]
    assert plan["prefill"] == [(None, 2, 10)]
    assert up.share_cores([5], 1, 1, 1, 1) == {"prefill": [(None, 1, 0)],
                                             "decode": [({5}, 1, 0)]}


def test_the_proxy_runs_on_the_prefills_cores_never_on_a_decodes(monkeypatch):
    sub = argparse.ArgumentParser().add_subparsers()
    up.add_parser(sub)
    args = sub.choices["up"].parse_args(["--prefill", "2"])
    monkeypatch.setattr(os, "sched_getaffinity", lambda _: {0, 1, 2, 3, 4})
    insts = {i.name: i for i in up.plan(args, [])}
    assert insts["decode0"].cpus == {4} and insts["decode0"].argv[-2:] == ["--num-threads", "1"]
    assert insts["prefill0"].cpus == {0, 1} and insts["prefill1"].cpus == {2, 3}
    assert insts["proxy"].cpus == {0, 1, 2, 3}
    monkeypatch.setattr(os, "sched_getaffinity", lambda _: {0})
    assert {i.name: i.cpus for i in up.plan(args, [])}["proxy"] is None


def test_instances_get_a_process_group_of_their_own_in_ups_session():
    """A group, so that stopping an instance takes its children; up's session (not a new
    one), so that Linux's per-session autogroups leave an instance's nice in effect."""
    inst = up.Instance("sleeper", ["sleep", "30"], "", {}, nice=3)
    up._start(inst)
    try:
        pid = inst.proc.pid
        assert os.getpgid(pid) == pid and os.getsid(pid) == os.getsid(0)
        assert os.getpriority(os.PRIO_PROCESS, pid) == os.getpriority(os.PRIO_PROCESS, 0) + 3
    finally:
        up._stop_all([inst], 5)
    assert inst.proc.returncode is not None
