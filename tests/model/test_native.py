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
