"""The engine loop's side of the core loan, on a real engine: when a paced lender lends."""

from __future__ import annotations

import json
import threading

from pdserve.engine import core_loan
from pdserve.engine.engine_loop import EngineLoop
from pdserve.engine.request import Request
from tests.utils import greedy


def test_a_decode_lends_after_decode_steps_but_keeps_its_core_after_a_prefill(
        engine_f32, tmp_path, monkeypatch):
    """A decode that prefilled a prompt itself (conditional disaggregation) must not leave
    its streams stalled for a second step's length: it lends only after pure decode steps,
    even while the prefill it lends to has a backlog."""
    board = str(tmp_path / "board")
    core_loan.new_board(board, 1)
    with open(board, "r+b") as f:
        f.write(bytes([core_loan.PACE_DEMAND + 2]))  # the prefill's backlog
    monkeypatch.setenv(core_loan.ENV, json.dumps(
        {"lend": {"board": board, "slot": 0, "threads": 1, "paced": True}}))
    lent_after = []
    after_step = core_loan.Lender.after_step

    def spy(self, step_s):
        lent_after.append(engine_f32.last_step_prefilled)
        return after_step(self, step_s)

    monkeypatch.setattr(core_loan.Lender, "after_step", spy)
    done = threading.Event()
    loop = EngineLoop(lambda: engine_f32, lambda outs: any(o.finished for o in outs) and done.set())
    try:
        loop.add(Request("local", list(range(100, 140)), greedy(3)))  # 1 prefill, 2 decodes
        assert done.wait(60)
    finally:
        loop.shutdown()
    assert lent_after == [False, False]
    assert engine_f32.allocator.num_free == engine_f32.allocator.num_blocks
