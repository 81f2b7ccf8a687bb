"""engine/devices.py: what the engine logs about the device at start."""
import pytest


def test_triton_cache_line_says_where_and_whether_warm(tmp_path, monkeypatch):
    from longreach.engine.devices import triton_cache_line

    triton = pytest.importorskip("triton")
    if not hasattr(triton, "knobs"):
        pytest.skip("this triton has no knobs module")
    monkeypatch.setattr(triton.knobs.cache, "dir", str(tmp_path))
    assert "empty: kernels compile on first use" in triton_cache_line() and str(tmp_path) in triton_cache_line()
    (tmp_path / "abc").mkdir()
    assert "1 compiled kernels cached, reused" in triton_cache_line()
