"""`pdserve bench peer`: without a vLLM-CPU folder it runs pdserve alone and says so; the
report's ratios and the servers' peak memory; a baseline that dies while starting is a
clear error, not a hang."""

import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from pdserve.bench import peer
from pdserve.bench.launch import free_port, running
from pdserve.model import loader


def test_without_a_peer_it_runs_pdserve_alone(tmp_path, capsys):
    code = peer.main(["--peer", str(tmp_path / "none"), "--only", "prefill",
                      "--prefill-lens", "40,90", "--runs", "1", "--out", str(tmp_path)])
    out, err = capsys.readouterr()
    assert code == 0
    assert "pdserve alone" in err and "pdserve alone" in out
    for n in (40, 90):
        row = next(line for line in out.splitlines() if f"prefill {n} tokens" in line)
        assert float(row.split("|")[2]) > 0  # pdserve's time, no vLLM figure or ratio
        assert row.rstrip("| ").endswith("-")
    rss = next(line for line in out.splitlines() if "peak RSS" in line)
    assert 100 < float(rss.split("|")[2]) < 20000  # the server's, in MB


def test_a_llamacpp_peer_missing_runs_pdserve_alone_on_the_gguf_file(tmp_path, capsys):
    """--model and --pdserve-args reach pdserve's server: the embedded file computed as
    stored; the missing peer is named as llama.cpp."""
    gguf = str(loader.embedded_gguf())
    code = peer.main(["--peer", str(tmp_path / "none"), "--peer-kind", "llamacpp", "--model",
                      gguf, "--pdserve-args=-q gguf", "--only", "prefill", "--prefill-lens",
                      "40", "--runs", "1", "--out", str(tmp_path)])
    out, err = capsys.readouterr()
    assert code == 0 and "no llama.cpp peer" in err and "llama.cpp was not run" in out
    assert "| work | pdserve | llama.cpp | pdserve / llama.cpp |" in out
    assert "(float32, gguf weights;" in (tmp_path / "pdserve-mono.log").read_text()


def test_a_llamacpp_peer_needs_a_gguf_file():
    with pytest.raises(SystemExit):
        peer.main(["--peer-kind", "llamacpp"])


def test_report_gives_pdserve_over_vllm():
    ours = peer.Results({1000: 500.0}, 400.0, {1.0: {"median_ttft_ms": 90.0,
                                                     "median_tpot_ms": 10.0,
                                                     "p99_itl_ms": 20.0,
                                                     "p100_itl_ms": 30.0}})
    theirs = peer.Results({1000: 1000.0}, 200.0, {1.0: {"median_ttft_ms": 100.0,
                                                        "median_tpot_ms": 20.0,
                                                        "p99_itl_ms": 10.0,
                                                        "p100_itl_ms": 120.0}})
    ours.concurrency[16] = {"output_throughput": 300.0, "median_tpot_ms": 40.0}
    theirs.concurrency[16] = {"output_throughput": 200.0, "median_tpot_ms": 50.0}
    ours.peak_rss_mb, theirs.peak_rss_mb = 900.0, 3000.0
    table = peer.report(ours, theirs)
    assert "| prefill 1000 tokens (ms) | 500 | 1000 | 0.50x |" in table
    assert "| 64 sequences at once (output tok/s) | 400 | 200 | 2.00x |" in table
    assert "median TTFT (ms) | 90.0 | 100.0 | 0.90x |" in table
    assert "p99 ITL (ms) | 20.0 | 10.0 | 2.00x |" in table
    assert "longest ITL (ms) | 30.0 | 120.0 | 0.25x |" in table
    assert "at most 16 in flight, 256 in / 128 out: output tok/s | 300.0 | 200.0 | 1.50x |" \
        in table
    assert "at most 16 in flight, 256 in / 128 out: median TPOT (ms) | 40.0 | 50.0 | 0.80x |" \
        in table
    assert "| peak RSS, all processes (MB) | 900 | 3000 | 0.30x |" in table
    assert "pdserve alone" not in table


def test_a_baseline_that_exits_during_start_up_is_named():
    url = f"http://127.0.0.1:{free_port()}"
    dies = running([sys.executable, "-c", "raise SystemExit(3)"], [url], timeout=30,
                   name="vllm serve")
    with pytest.raises(RuntimeError, match="vllm serve exited with 3 during start-up"), dies:
        pass


def test_unknown_work_is_refused():
    with pytest.raises(SystemExit):
        peer.main(["--only", "prefill,decode"])


def test_peak_memory_counts_descendants_in_their_own_sessions():
    """`pdserve up` starts its instances in sessions of their own: they count all the same."""
    child = ("import subprocess, sys; subprocess.Popen([sys.executable, '-c', "
             "'b = bytearray(300 << 20); import time; time.sleep(60)'], "
             "start_new_session=True); import time; time.sleep(60)")
    proc = subprocess.Popen([sys.executable, "-c", child])
    try:
        deadline = time.monotonic() + 30
        while (mb := peer.peak_rss_mb(proc.pid)) < 300 and time.monotonic() < deadline:
            time.sleep(0.2)
        assert mb >= 300  # the grandchild's 300 MB, in a session of its own
    finally:
        for pid in _descendants(proc.pid):
            os.kill(pid, 9)
        proc.kill()
        proc.wait()


def _descendants(pid: int) -> list[int]:
    kids = Path(f"/proc/{pid}/task/{pid}/children").read_text().split()
    return [int(k) for k in kids] + [d for k in kids for d in _descendants(int(k))]
