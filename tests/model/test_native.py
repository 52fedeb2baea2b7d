"""Building pdserve's CPU kernels."""

from __future__ import annotations

from pdserve.model import native


def test_builds_once_and_is_cached(monkeypatch, tmp_path):
    monkeypatch.setenv("PDSERVE_CACHE_DIR", str(tmp_path))
    first = native._build()
    assert first is not None and first.parent == tmp_path / "kernels"
    stamp = first.stat().st_mtime_ns
    assert native._build() == first and first.stat().st_mtime_ns == stamp  # not rebuilt
    assert not list(first.parent.glob("*.tmp"))


def test_without_a_compiler_there_are_no_kernels(monkeypatch, tmp_path, caplog):
    monkeypatch.setenv("CXX", "no-such-compiler")
    monkeypatch.setenv("PDSERVE_CACHE_DIR", str(tmp_path))
    assert native._build() is None
    assert "no C++ compiler" in caplog.text


def test_an_unwritable_cache_turns_the_kernels_off_not_the_server(monkeypatch, tmp_path,
                                                                   caplog):
    (tmp_path / "file").write_text("")  # a cache folder below a file cannot be made
    monkeypatch.setenv("PDSERVE_CACHE_DIR", str(tmp_path / "file" / "cache"))
    assert native.library.__wrapped__() is None  # past functools.cache
    assert "CPU kernels are off" in caplog.text


def test_a_failing_compiler_turns_the_kernels_off_once(monkeypatch, tmp_path, caplog):
    monkeypatch.setenv("CXX", "false")  # runs, exits 1
    monkeypatch.setenv("PDSERVE_CACHE_DIR", str(tmp_path))
    assert native._build() is None
    assert "building pdserve's CPU kernels failed" in caplog.text
    left = list((tmp_path / "kernels").iterdir())  # no half-built library: the failure noted
    assert [p.suffix for p in left] == [".failed"]
    # The next process does not spend a compile on the same sources: it reads the note.
    caplog.clear()
    monkeypatch.setattr(native.subprocess, "run", lambda *a, **k: 1 / 0)
    assert native._build() is None
    assert "did not build for this CPU and compiler" in caplog.text
