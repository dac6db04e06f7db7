"""`tessera bench auth` runs end to end (tiny and bounded) and prints the overhead line."""

from __future__ import annotations

from benchmarks import bench_auth


def test_bench_auth_hot_path_on_sqlite(capsys):
    assert bench_auth.main(["--requests", "60", "--rate", "300", "--backends", "sqlite"]) == 0
    out = capsys.readouterr().out
    assert "none" in out and "sqlite" in out
    assert "auth + quota add" in out and "ms CPU" in out
