"""tessera bench gguf_kl: its arguments are checked before any model loads."""

from __future__ import annotations

import pytest

from benchmarks import bench_gguf_kl


@pytest.mark.parametrize("windows", ["0", "9"])
def test_windows_past_the_text_are_refused(windows):
    """The text holds 8 windows of 12 tokens; more used to crash in the embedding with an
    empty window."""
    with pytest.raises(SystemExit, match="--windows: 1 to 8"):
        bench_gguf_kl.main(["--windows", windows, "--quantization", "gguf"])
