"""`pdserve bench multiturn` on a small run: every layout answers every turn, and the
history-aware `up` computes a later turn's new part only, as the monolithic server does,
where plain P/D computes the previous answer again."""

import json

from pdserve.bench import multiturn


def test_history_aware_up_computes_what_a_monolith_does(capsys):
    code = multiturn.main(["--conversations", "2", "--turns", "2", "--message-words", "30",
                           "--answer-tokens", "40", "--local-prefill-below", "96",
                           "--dtype", "float32"])
    out = capsys.readouterr().out
    assert code == 0 and "| 2 |" in out
    results = json.loads(out.strip().splitlines()[-1])
    aware, plain, mono = (results[name]["computed"] for name in (
        "up, history-aware", "up, every turn disaggregated", "serve (monolithic)"))
    assert aware[0] == plain[0] == mono[0] > 0  # turn 1: the whole of each prompt, once
    # Turn 2: the new message (and the tail of a block) everywhere; plain P/D also the
    # answer it did not see, 40 tokens per conversation.
    assert abs(aware[1] - mono[1]) <= 2 * 16 and plain[1] - aware[1] >= 2 * 40 - 2 * 16
    assert all(t > 0 for r in results.values() for t in r["ttft_s"])
