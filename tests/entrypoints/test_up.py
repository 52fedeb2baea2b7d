"""`pdserve up`'s core plan: decodes own their cores, prefills (and the proxy) split what
is left, and prefills borrow the decodes' cores while those are idle."""

import argparse
import json
import os

from pdserve.config import EngineConfig
from pdserve.engine import core_loan
from pdserve.entrypoints import serve, up


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


def _plan(argv: list[str], cpus: set[int], boards, monkeypatch) -> dict[str, up.Instance]:
    sub = argparse.ArgumentParser().add_subparsers()
    up.add_parser(sub)
    monkeypatch.setattr(os, "sched_getaffinity", lambda _: cpus)
    return {i.name: i for i in up.plan(sub.choices["up"].parse_args(argv), [], boards)}


def _loan(inst: up.Instance) -> dict | None:
    spec = inst.env.get(core_loan.ENV)
    return None if spec is None else json.loads(spec)


def test_the_prefill_borrows_the_decode_core_at_lower_priority(tmp_path, monkeypatch):
    insts = _plan([], {0, 1}, str(tmp_path), monkeypatch)
    board = str(tmp_path / "prefill0")
    assert _loan(insts["decode0"])["lend"] == {"board": board, "slot": 0, "threads": 1,
                                               "paced": True}
    assert insts["decode0"].cpus == {1} and insts["decode0"].nice == 0
    assert _loan(insts["prefill0"])["borrow"] == {"board": board, "cpus": [1]}
    assert insts["prefill0"].cpus == {0, 1} and insts["prefill0"].nice == up.LOAN_NICE
    assert insts["proxy"].cpus == {0}  # the proxy stays off the decode's core
    assert (tmp_path / "prefill0").read_bytes() == bytes(core_loan.LENDERS + 1)  # all busy at first


def test_a_prefill_lends_its_cores_to_its_lone_decode_only_while_idle(tmp_path, monkeypatch):
    insts = _plan([], {0, 1, 2}, str(tmp_path), monkeypatch)
    board = str(tmp_path / "decode0")
    assert _loan(insts["prefill0"])["lend"] == {"board": board, "slot": 0, "threads": 2,
                                                "paced": False}
    assert _loan(insts["decode0"])["borrow"] == {"board": board, "cpus": [0, 1]}
    # The decode's process stays on its core: only its engine thread widens, while lent.
    assert insts["decode0"].cpus == {2}
    assert (tmp_path / "decode0").read_bytes() == bytes(core_loan.LENDERS + 2)


def test_each_decode_lends_to_one_prefill_a_slot_per_rank(tmp_path, monkeypatch):
    insts = _plan(["--prefill", "2", "--decode", "2", "--decode-dp", "2"], set(range(8)),
                  str(tmp_path), monkeypatch)
    lends = [_loan(insts[f"decode{j}"])["lend"] for j in range(2)]
    assert [lend["board"] for lend in lends] == [str(tmp_path / "prefill0"),
                                                 str(tmp_path / "prefill1")]
    assert _loan(insts["prefill0"])["borrow"]["cpus"] == sorted(insts["decode0"].cpus)
    assert _loan(insts["prefill1"])["borrow"]["cpus"] == sorted(insts["decode1"].cpus)
    assert len((tmp_path / "prefill0").read_bytes()) == core_loan.LENDERS + 2  # decode0's ranks
    # A decode of several ranks borrows nothing: which rank would take the prefill's cores?
    assert not any("borrow" in _loan(insts[f"decode{j}"]) for j in range(2))
    assert not any("lend" in _loan(insts[f"prefill{j}"]) for j in range(2))
    one = _plan(["--decode", "2", "--decode-dp", "2"], set(range(8)), str(tmp_path),
                monkeypatch)
    assert [_loan(one[f"decode{j}"])["lend"]["slot"] for j in range(2)] == [0, 2]  # after decode0's


def test_a_prefill_serving_two_decodes_lends_to_neither(tmp_path, monkeypatch):
    insts = _plan(["--decode", "2"], {0, 1, 2}, str(tmp_path), monkeypatch)
    assert "lend" not in _loan(insts["prefill0"])
    assert not any("borrow" in _loan(insts[f"decode{j}"]) for j in range(2))


def test_no_loans_for_prefills_with_ranks_or_when_turned_off(tmp_path, monkeypatch):
    insts = _plan(["--prefill-dp", "2"], {0, 1, 2}, str(tmp_path), monkeypatch)
    assert not any(_loan(i) for i in insts.values())
    insts = _plan([], {0, 1}, None, monkeypatch)  # what run() passes for --no-core-loan
    assert not any(_loan(i) for i in insts.values()) and insts["prefill0"].cpus == {0}


def test_decodes_take_prompts_in_smaller_chunks_than_prefills():
    sub = argparse.ArgumentParser().add_subparsers()
    up.add_parser(sub)
    for flags, prefill_budget, decode_budget in (
            ([], None, str(up.UP_DECODE_PROMPT_BUDGET)),  # a prefill takes its default
            (["--max-num-batched-tokens", "1024", "--decode-max-num-batched-tokens", "64"],
             "1024", "64")):
        args = sub.choices["up"].parse_args(flags)
        insts = {i.name: i.argv for i in up.plan(args, up.engine_argv(args))}

        def budget(argv: list[str]) -> str | None:  # the last one given wins
            at = [i for i, a in enumerate(argv) if a == "--max-num-batched-tokens"]
            return argv[at[-1] + 1] if at else None
        assert budget(insts["prefill0"]) == prefill_budget
        assert budget(insts["decode0"]) == decode_budget
    bad = sub.choices["up"].parse_args(["--decode-max-num-batched-tokens", "0"])
    assert up.run(bad) == 2


def test_enforce_eager_reaches_every_instance():
    sub = argparse.ArgumentParser().add_subparsers()
    up.add_parser(sub)
    serve.add_parser(sub)
    for flags, eager in (([], False), (["--enforce-eager"], True)):
        args = sub.choices["up"].parse_args(flags)
        insts = up.plan(args, up.engine_argv(args))
        serving = [i for i in insts if "serve" in i.argv]
        assert len(serving) == 2
        assert all(("--enforce-eager" in i.argv) == eager for i in serving)
        cfg = serve.engine_config(sub.choices["serve"].parse_args(flags))
        assert cfg.enforce_eager == eager
        assert cfg.max_num_batched_tokens == EngineConfig().max_num_batched_tokens  # on CPU
