"""The command line: a wrong input is one line on stderr and exit code 2, never a traceback."""

from __future__ import annotations

import pytest

from nnterp.__main__ import main
from nnterp.families import BY_MODEL_TYPE

from ..conftest import build_tiny, tiny_tokenizer


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    path = tmp_path_factory.mktemp("cli-model")
    build_tiny(BY_MODEL_TYPE["llama"].tiny_config()).save_pretrained(path)
    tiny_tokenizer().save_pretrained(path)
    return str(path)


@pytest.mark.parametrize("argv, message", [
    (["check", "/nonexistent/folder"], "check: error: No model folder at '/nonexistent/folder'"),
    (["lens", "--model", "{folder}", "--prompt", ""], "lens: --prompt is empty"),
    (["lens", "--model", "{folder}", "--prompt", "the cat", "--target", "cat sat", "--plot", ""],
     "lens: error: The target 'cat sat' is 2 tokens"),
    (["demo", "--model", "{folder}", "--layer", "99", "--plot", ""], "demo: error: Layer 99 is out of range"),
])
def test_a_wrong_input_is_one_line_and_exit_code_2(folder, capsys, argv, message):
    with pytest.raises(SystemExit) as exit_info:
        main([arg.format(folder=folder) for arg in argv])
    assert exit_info.value.code == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert message in err[-1] and "Traceback" not in "\n".join(err)
    assert len([line for line in err if "error" in line]) == 1


def test_docs_writes_into_the_given_folder_or_the_checkouts(tmp_path, capsys):
    main(["docs", "--folder", str(tmp_path / "site-pages")])
    assert (tmp_path / "site-pages" / "families" / "llama.md").is_file()
    assert "pages under" in capsys.readouterr().out


def test_check_aligns_its_table_and_states_each_reason_once(folder, capsys):
    from nnterp import StandardizedTransformer

    with pytest.raises(SystemExit) as exit_info:
        main(["check", folder])
    assert exit_info.value.code == 0
    out = capsys.readouterr().out.splitlines()
    table = StandardizedTransformer(folder).availability(0)
    rows = [line for line in out if line.startswith("  ") and line.split()[0] in table]
    assert len(rows) == len(table)
    assert len({line.index(line[2:].split(None, 1)[1], 2) for line in rows}) == 1  # the places start in one column
    reasons = {entry.reason for entry in table.values() if not entry.available}
    assert reasons and all(sum(reason in line for line in out) == 1 for reason in reasons)


@pytest.mark.parametrize("command", ["demo", "lens", "check", "docs"])
def test_every_option_says_what_it_is(command, capsys):
    with pytest.raises(SystemExit):
        main([command, "--help"])
    options = capsys.readouterr().out.split("options:")[1].splitlines()[1:]
    flags = [line.split() for line in options if line.lstrip().startswith("--") and not line.lstrip().startswith("--help")]
    assert all(len(words) > 2 for words in flags), flags  # "--flag VALUE" then its help text


def test_lens_says_where_it_wrote_its_heatmap(tmp_path, monkeypatch, capsys):
    folder = tmp_path / "model"
    build_tiny(BY_MODEL_TYPE["llama"].tiny_config()).save_pretrained(folder)
    tiny_tokenizer().save_pretrained(folder)
    monkeypatch.chdir(tmp_path)
    main(["lens", "--model", str(folder), "--prompt", "the cat sat"])
    written = tmp_path / "logit_lens.png"
    assert written.is_file() and str(written.resolve()) in capsys.readouterr().out
