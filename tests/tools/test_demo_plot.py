"""The demo's PNG (``prefix_router/tools/demo_plot.py``): written where asked and a PNG, its path said
on one line; without matplotlib one line saying how to get it, and the demo goes on."""

from __future__ import annotations

import sys

from prefix_router.tools.demo_plot import MISSING, plot_or_say

PNG_SIGNATURE = b"\x89PNG\r\n\x1a\n"


def _rows(hit: float, p50: float | None) -> list[dict]:
    rows = [{"replica": f"replica-{i}", "hit_rate": hit, "ttft_p50_s": p50, "ttft_p99_s": None if p50 is None else p50 * 4}
            for i in range(3)]
    return rows + [{"replica": "total", "hit_rate": hit, "ttft_p50_s": p50, "ttft_p99_s": 0.9}]


def test_the_plot_is_a_png_where_asked_and_its_path_is_said(tmp_path, capsys):
    path = tmp_path / "out" / "demo.png"
    path.parent.mkdir()
    per_policy = {"prefix-affinity": _rows(0.8, 0.05), "round-robin": _rows(0.6, None)}  # a replica without TTFT
    assert plot_or_say(per_policy, path, "TTFT (modelled)", "a title") == path
    assert path.read_bytes()[:8] == PNG_SIGNATURE
    assert capsys.readouterr().out == f"plot: {path}\n"


def test_without_matplotlib_one_line_says_how_to_get_it(tmp_path, capsys, monkeypatch):
    for name in [m for m in sys.modules if m == "matplotlib" or m.startswith("matplotlib.")]:
        monkeypatch.delitem(sys.modules, name)
    monkeypatch.setitem(sys.modules, "matplotlib", None)  # import matplotlib raises ImportError
    path = tmp_path / "demo.png"
    assert plot_or_say({"prefix-affinity": _rows(0.8, 0.05)}, path, "TTFT (modelled)") is None
    out = capsys.readouterr()
    assert out.out == "no plot: pip install 'prefix-router[demo]'\n" == MISSING + "\n"
    assert out.err == "" and not path.exists()


def test_a_plot_that_cannot_be_written_is_said_on_stderr_and_the_demo_goes_on(tmp_path, capsys):
    path = tmp_path / "no-such-folder" / "demo.png"
    assert plot_or_say({"prefix-affinity": _rows(0.8, 0.05)}, path, "TTFT (modelled)") is None
    out = capsys.readouterr()
    assert out.out == "" and "no plot:" in out.err and not path.exists()


def test_any_name_is_a_png_at_that_name_and_a_folder_is_said_on_stderr(tmp_path, capsys):
    rows = {"prefix-affinity": _rows(0.8, 0.05)}
    for name in ("demo.txt", "demo"):  # a ValueError traceback, and demo.png written for "demo", before
        path = tmp_path / name
        assert plot_or_say(rows, path, "TTFT (modelled)") == path
        assert path.read_bytes()[:8] == PNG_SIGNATURE and capsys.readouterr().out == f"plot: {path}\n"
    folder = tmp_path / "plots"
    folder.mkdir()
    assert plot_or_say(rows, folder, "TTFT (modelled)") is None  # was "plot: plots", written as plots.png
    out = capsys.readouterr()
    assert out.out == "" and "no plot:" in out.err and not (tmp_path / "plots.png").exists()
