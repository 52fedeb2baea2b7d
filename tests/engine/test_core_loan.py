"""Core loans between engines on one host through a shared board: a decode lends to a
prefill (paced while the prefill has a backlog), a prefill to its lone decode (only idle)."""

from __future__ import annotations

import json
import os
import threading
import time

import pytest
import torch

from pdserve.engine import core_loan

needs_two_cores = pytest.mark.skipif(len(os.sched_getaffinity(0)) < 2,
                                     reason="needs two cores to lend one")


def _lender(monkeypatch, board: str, slot: int = 0, threads: int = 1, paced: bool = True,
            dp_rank: int = 0) -> core_loan.Lender:
    spec = {"lend": {"board": board, "slot": slot, "threads": threads, "paced": paced}}
    monkeypatch.setenv(core_loan.ENV, json.dumps(spec))
    lender, borrower = core_loan.from_env(dp_rank)
    assert borrower is None
    return lender


def _borrower(monkeypatch, board: str, cpus: list[int]) -> core_loan.Borrower:
    monkeypatch.setenv(core_loan.ENV, json.dumps({"borrow": {"board": board, "cpus": cpus}}))
    lender, borrower = core_loan.from_env()
    assert lender is None
    return borrower


def _in_thread(fn):
    """fn's result in a new thread, as the engine loop runs it (affinity and torch's thread
    count are per thread, so the test's own stay as they were)."""
    out = []
    t = threading.Thread(target=lambda: out.append(fn()))
    t.start()
    t.join()
    return out[0]


def test_no_loan_without_the_environment(monkeypatch):
    monkeypatch.delenv(core_loan.ENV, raising=False)
    assert core_loan.from_env() == (None, None)


def test_lenders_publish_what_they_lend_while_idle_in_their_rank_slot(tmp_path, monkeypatch):
    board = tmp_path / "board"
    core_loan.new_board(str(board), 3)
    empty = bytes(core_loan.LENDERS + 3)
    assert board.read_bytes() == empty  # nothing lent before a decode says it is idle
    rank1 = _lender(monkeypatch, str(board), slot=1, threads=2, dp_rank=1)
    rank1.before_step(busy=False)
    assert board.read_bytes() == bytes(core_loan.LENDERS) + bytes([0, 0, 2])
    rank1.before_step(busy=True)
    assert board.read_bytes() == empty


@needs_two_cores
def test_the_borrower_takes_idle_cores_and_leaves_them_when_lenders_are_busy(tmp_path,
                                                                             monkeypatch):
    cores = sorted(os.sched_getaffinity(0))
    own, lent = set(cores[:-1]), {cores[-1]}
    board = str(tmp_path / "board")
    core_loan.new_board(board, 1)
    lender = _lender(monkeypatch, board)
    threads = torch.get_num_threads()
    borrower = _borrower(monkeypatch, board, sorted(lent))
    assert borrower.own == own and borrower.threads == threads

    def step():
        borrower.before_step(busy=True, demand=1)
        return borrower.borrowed, torch.get_num_threads(), os.sched_getaffinity(0)

    assert _in_thread(step) == (False, threads, own)  # the lender has not said it is idle
    lender.before_step(busy=False)
    assert _in_thread(step) == (True, threads + 1, own | lent)
    lender.before_step(busy=True)
    assert _in_thread(step) == (False, threads, own)
    assert torch.get_num_threads() == threads and os.sched_getaffinity(0) == own | lent


@needs_two_cores
def test_the_borrower_follows_the_lender_between_layers(tmp_path, monkeypatch):
    """A step that began without the loan takes it once the lender goes idle, and keeps
    counting as borrowed after the lender takes its core back."""
    board = str(tmp_path / "board")
    core_loan.new_board(board, 1)
    lender = _lender(monkeypatch, board)
    borrower = _borrower(monkeypatch, board, [max(os.sched_getaffinity(0))])
    threads = torch.get_num_threads()

    def step():
        seen = []
        borrower.before_step(busy=True, demand=1)
        seen.append(torch.get_num_threads())
        lender.before_step(busy=False)  # the decode finishes its last request mid-prefill
        borrower.take()  # the next layer
        seen.append(torch.get_num_threads())
        lender.before_step(busy=True)
        borrower.take()
        seen.append(torch.get_num_threads())
        return seen, borrower.borrowed

    assert _in_thread(step) == ([threads, threads + 1, threads], True)


def _pair(tmp_path, monkeypatch, paced: bool = True):
    board = str(tmp_path / "board")
    core_loan.new_board(board, 1)
    lender = _lender(monkeypatch, board, paced=paced)
    borrower = _borrower(monkeypatch, board, [max(os.sched_getaffinity(0))])
    return lender, borrower


def test_a_busy_decode_lends_after_each_step_only_while_the_prefill_has_a_backlog(
        tmp_path, monkeypatch):
    lender, borrower = _pair(tmp_path, monkeypatch)
    lent_during_gap = []
    monkeypatch.setattr(core_loan.time, "sleep", lambda s: lent_during_gap.append(
        (s, sum(borrower.board[core_loan.LENDERS:]))))
    lent = []
    for demand in range(core_loan.PACE_DEMAND + 2):
        _in_thread(lambda d=demand: borrower.before_step(busy=d > 0, demand=d))
        lender.before_step(busy=True)
        lent.append(lender.after_step(0.015))
    assert lent == [0.0] * core_loan.PACE_DEMAND + [0.015] * 2  # (for the metric)
    # One gap per step from the backlog on, as long as the step, with the core lent (the
    # short sleeps are the decode waiting for the prefill's layer on its core to end).
    assert [gap for gap in lent_during_gap if gap[0] > 0.001] == [(0.015, 1)] * 2
    lender.before_step(busy=True)
    assert sum(borrower.board[core_loan.LENDERS:]) == 0  # taken back for the next step


@needs_two_cores
def test_a_decode_takes_its_core_back_only_once_the_prefills_layer_is_done(tmp_path,
                                                                          monkeypatch):
    lender, borrower = _pair(tmp_path, monkeypatch)
    # Longer than any scheduling delay of a loaded host: the borrower's thread, 30 ms
    # asleep, must be what ends the wait, not the give-up timeout.
    monkeypatch.setattr(core_loan, "RECLAIM_TIMEOUT_S", 10.0)
    lender.before_step(busy=False)
    _in_thread(lambda: borrower.before_step(busy=True, demand=1))
    assert borrower.board[core_loan.BORROWING] == 1  # a layer runs on the decode's core

    def next_layer():  # the prefill reaches its next checkpoint 30 ms later
        time.sleep(0.03)
        borrower.take()

    t = threading.Thread(target=next_layer)
    t.start()
    start = time.monotonic()
    lender.before_step(busy=True)
    waited = time.monotonic() - start
    t.join()
    assert 0.02 < waited < 5
    assert borrower.board[core_loan.BORROWING] == 0 and borrower.current == borrower.threads


def test_a_decode_does_not_wait_for_a_prefill_that_is_gone(tmp_path, monkeypatch):
    lender, borrower = _pair(tmp_path, monkeypatch)
    borrower.board[core_loan.BORROWING] = 1  # set by a prefill that died mid-layer
    start = time.monotonic()
    lender.before_step(busy=True)
    assert core_loan.RECLAIM_TIMEOUT_S <= time.monotonic() - start < 5  # gave up, not hung


def test_an_idle_prefill_borrows_nothing_and_says_so(tmp_path, monkeypatch):
    lender, borrower = _pair(tmp_path, monkeypatch)
    lender.before_step(busy=False)
    _in_thread(lambda: borrower.before_step(busy=False, demand=0))
    assert borrower.board[core_loan.BORROWING] == 0 and borrower.board[core_loan.DEMAND] == 0


def test_an_unpaced_lender_lends_only_while_idle_whatever_the_backlog(tmp_path, monkeypatch):
    """A prefill lends its core to its decode when it has no prompt; a decode's backlog
    (many sequences to decode) never makes a busy prefill give its core away."""
    lender, borrower = _pair(tmp_path, monkeypatch, paced=False)
    _in_thread(lambda: borrower.before_step(busy=True, demand=core_loan.PACE_DEMAND + 5))
    lender.before_step(busy=True)
    assert lender.after_step(0.015) == 0.0
    assert sum(borrower.board[core_loan.LENDERS:]) == 0


@needs_two_cores
def test_the_borrower_leaves_the_lent_cores_between_steps(tmp_path, monkeypatch):
    """A decode that stepped on an idle prefill's core and then waits (idle, or lending its
    own core) must not keep the flag up: the prefill, given a prompt, would wait for it."""
    lender, borrower = _pair(tmp_path, monkeypatch, paced=False)
    monkeypatch.setattr(core_loan, "RECLAIM_TIMEOUT_S", 10.0)  # a wrong wait is unmistakable
    lender.before_step(busy=False)

    def step():
        borrower.before_step(busy=True, demand=1)
        during = borrower.board[core_loan.BORROWING], torch.get_num_threads()
        borrower.after_step()
        return during, (borrower.board[core_loan.BORROWING], torch.get_num_threads())

    threads = borrower.threads
    assert _in_thread(step) == ((1, threads + 1), (0, threads))
    start = time.monotonic()
    lender.before_step(busy=True)  # a prompt arrives: nothing to wait for
    assert time.monotonic() - start < 5
