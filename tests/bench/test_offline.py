"""`pdserve bench offline` at a toy size: it runs both sides and prints its tables."""

from __future__ import annotations

import re

from pdserve.bench import offline


def test_workload_is_seeded_and_in_range():
    args = offline._parse(["--num-seqs", "20", "--min-input", "5", "--max-input", "9",
                           "--min-output", "3", "--max-output", "4", "--seed", "3"])
    w = offline.make_workload(args)
    assert w.prompts == offline.make_workload(args).prompts
    assert all(5 <= len(p) <= 9 for p in w.prompts) and all(3 <= n <= 4 for n in w.output_lens)
    assert all(0 <= t <= offline.MAX_TOKEN_ID for p in w.prompts for t in p)


def test_left_pad_aligns_prompts_right():
    ids, mask = offline._left_pad([[5, 6, 7], [8]])
    assert ids.tolist() == [[5, 6, 7], [0, 0, 8]]
    assert mask.tolist() == [[1, 1, 1], [0, 0, 1]]


def test_tiny_run_prints_both_tables(capsys):
    rc = offline.main(["--num-seqs", "3", "--min-input", "8", "--max-input", "20",
                       "--min-output", "2", "--max-output", "5", "--hf-batch-size", "2",
                       "--decode-batches", "1,2", "--decode-steps", "2",
                       "--prefill-lens", "40", "--prefill-runs", "1"])
    out = capsys.readouterr().out
    assert rc == 0
    assert "| pdserve LLMEngine |" in out and "| HF transformers generate (batch 2) |" in out
    assert "**pdserve / HF**" in out and "| 2 |" in out
    # The paged attention kernels against their fallback, both timed in this run.
    assert "paged kernel step (ms)" in out and "torch step (ms)" in out
    assert "paged kernel prefill (ms)" in out and "| 40 |" in out
    assert out.count("torch / kernel") == 2
    # the decode step's weight reads against the host's, measured in the same run
    assert re.search(r"Weights read per decode step: 0\.\d+ GB; at batch 1 [\d.]+ GB/s, \d+% "
                     r"of this host's read bandwidth \([\d.]+ GB/s", out), out[-400:]


def test_each_attention_path_times_a_prefill_it_computes():
    """Both paths time the same prompts: a prefix-cache hit on the second would time a
    prefill that computes nothing (it did: the torch path's 512-token prefill read 20 ms)."""
    args = offline._parse(["--num-seqs", "1", "--min-input", "8", "--max-input", "8",
                           "--min-output", "2", "--max-output", "2", "--decode-batches", "",
                           "--prefill-lens", "40", "--prefill-runs", "2", "--skip-hf"])
    engine = offline.engine_for(args, offline.make_workload(args), [], [40])
    computed, run = [], engine.runner.run
    engine.runner.run = lambda items: (computed.append(sum(n for _, n in items)), run(items))[1]
    times = offline.attention_paths(engine, lambda n: offline.prefill_ms(engine, args, n), [40])
    assert len(times) == (2 if engine.runner.model.paged else 1)
    assert computed == [40] * 2 * len(times)


def test_bad_lengths_are_refused(capsys):
    assert offline.main(["--min-input", "10", "--max-input", "5", "--skip-hf"]) == 2
    assert "min <= max" in capsys.readouterr().err
