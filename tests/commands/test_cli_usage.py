"""The CLI's one vocabulary (issue 16): ``--version``, help and an example for every
subcommand and flag, usage errors with the subcommand's own usage (exit 2), sizes and
negative values refused naming the flag, quiet broken pipes, ``rm`` by model id, plural
grammar."""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys

import pytest
from conftest import REPO
from support.admin import build_store

from kvstore import __version__
from kvstore.cli import _subparsers, build_parser, join_negative_values, main


def _cli(*args: str, **kw) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "kvstore.cli", *args], capture_output=True,
                          text=True, timeout=120, stdin=subprocess.DEVNULL, **kw)


def _usage_error(capsys, argv: list[str]) -> str:
    with pytest.raises(SystemExit) as e:
        main(argv)
    assert e.value.code == 2, argv
    return capsys.readouterr().err


@pytest.fixture(scope="module")
def one_store(tmp_path_factory):
    """A store of one model, one segment file (model 'm/one', 1 prompt of 2 blocks)."""
    p = tmp_path_factory.mktemp("usage") / "store"
    build_store(p, "m/one", prompts=1, blocks=2)
    return p


def test_version(capsys):
    with pytest.raises(SystemExit) as e:
        main(["--version"])
    assert e.value.code == 0 and f"kvstore {__version__}" in capsys.readouterr().out


def test_every_subcommand_and_flag_has_help_and_an_example():
    parser = build_parser()
    subs = _subparsers(parser)
    assert {"demo", "serve", "ls", "inspect", "rm", "prune", "verify", "compact", "stats",
            "recover", "bench"} <= set(subs)
    todo = [(f"kvstore {name}", sp) for name, sp in subs.items()]
    while todo:
        prog, sp = todo.pop()
        assert sp.description, f"{prog} has no description"
        nested = _subparsers(sp)
        todo.extend((f"{prog} {n}", p) for n, p in nested.items())
        if not nested:  # a command (not a group of them): examples of itself
            assert sp.epilog and "examples:" in sp.epilog and prog in sp.epilog, prog
        for action in sp._actions:
            assert action.help, f"{prog} {action.option_strings or action.dest}: no help"
    top = parser.format_help()
    for name in ("demo", "bench", "serve"):  # no subcommand without a one-line help
        assert name in top and subs[name].description


def test_docs_use_store_never_the_old_path_spelling():
    """Issue 31: docs/vllm.md started the daemon with ``serve --path``; the vocabulary is
    ``--store`` (``--path`` stays accepted, and only cli.md's vocabulary table names it)."""

    root = REPO
    for doc in [root / "README.md", *sorted((root / "docs").glob("*.md"))]:
        for n, line in enumerate(doc.read_text().splitlines(), 1):
            if "--path" in line and "old spelling" not in line:
                raise AssertionError(f"{doc.name}:{n} uses --path, not --store: {line.strip()}")


def test_store_is_the_option_everywhere():
    subs = _subparsers(build_parser())
    for name in ("serve", "ls", "inspect", "rm", "prune", "verify", "compact", "stats",
                 "recover", "demo"):
        opts = {o for a in subs[name]._actions for o in a.option_strings}
        assert "--store" in opts, name
    serve = {o for a in subs["serve"]._actions for o in a.option_strings}
    assert "--path" in serve  # the old spelling, kept as an alias
    a = build_parser().parse_args(["serve", "--path", "/x", "--socket", "/s"])
    b = build_parser().parse_args(["serve", "--store", "/x", "--socket", "/s"])
    assert a.store == b.store == "/x"


def test_unknown_flag_prints_the_subcommands_usage(capsys):
    err = _usage_error(capsys, ["ls", "--bogus"])
    assert err.startswith("usage: kvstore ls ") and "kvstore ls: error: unrecognized " \
        "arguments: --bogus" in err
    err = _usage_error(capsys, ["serve", "--store", "/x", "--socket", "/s", "--nope", "1"])
    assert err.startswith("usage: kvstore serve ") and "--nope" in err
    nested = [(n, s) for n, sp in _subparsers(build_parser()).items()
              for s in _subparsers(sp)]  # kvstore batch run: the innermost usage
    for group, name in nested[:1]:
        err = _usage_error(capsys, [group, name, "--bogus-flag"])
        assert err.startswith(f"usage: kvstore {group} {name} ")
        assert f"kvstore {group} {name}: error:" in err


def test_negative_grace_refused_by_verify_and_prune_alike(capsys):
    for cmd in ("verify", "prune"):
        err = _usage_error(capsys, [cmd, "--grace", "-5"])
        assert f"kvstore {cmd}: error: argument --grace: must be a number of seconds >= 0" in err


def test_negative_size_with_a_space_reaches_the_check(capsys):
    # "-1GiB" looks like an option to argparse: it used to be "expected one argument"
    assert join_negative_values(build_parser(), ["serve", "--disk-capacity", "-1GiB"]) == \
        ["serve", "--disk-capacity=-1GiB"]
    for spelling in (["--disk-capacity", "-1GiB"], ["--disk-capacity=-1GiB"]):
        err = _usage_error(capsys, ["serve", "--store", "/x", "--socket", "/s", *spelling])
        assert "argument --disk-capacity: '-1GiB' is negative" in err
    # a store or a socket path beginning with '-' is still an option error, not joined
    assert join_negative_values(build_parser(), ["ls", "--store", "-x"]) == ["ls", "--store", "-x"]


@pytest.mark.parametrize("argv, words", [
    (["--cpu-capacity", "12XB"], "argument --cpu-capacity: '12XB' is not a size"),
    (["--cpu-capacity", "1KiB"], "argument --cpu-capacity: 1KiB is less than 16.0 KiB"),
    (["--workers", "0"], "argument --workers: must be >= 1"),
    (["--metrics-port", "99999"], "argument --metrics-port: must be >= 0 and <= 65535"),
    (["--max-frame", "12"], "argument --max-frame: 12 is less than 1.0 KiB"),
    (["--max-connections", "0"], "argument --max-connections: must be >= 1"),
    (["--shutdown-timeout", "-1"], "argument --shutdown-timeout: must be a number of seconds"),
])
def test_serve_bad_flags_are_usage_errors(capsys, argv, words):
    err = _usage_error(capsys, ["serve", "--store", "/x", "--socket", "/s", *argv])
    last = err.strip().splitlines()[-1]  # usage, then one line naming the flag
    assert last.startswith("kvstore serve: error: ") and words in last and "Traceback" not in err


def test_inspect_says_1_file_not_1_files(one_store, capsys):
    assert main(["inspect", "--store", str(one_store)]) == 0
    out = capsys.readouterr().out
    assert "1 file," in out and "1 files" not in out
    assert "1 namespace" in out and "1 namespaces" not in out


def test_rm_takes_a_model_id(tmp_path, capsys):
    p = tmp_path / "store"
    build_store(p, "org/keep", prompts=1, blocks=2)
    build_store(p, "org/drop", prompts=2, blocks=2, salt=1)
    assert main(["rm", "org/drop", "--store", str(p), "--dry-run"]) == 0
    assert "Would remove 4 block(s)" in capsys.readouterr().out
    assert main(["rm", "org/drop", "--store", str(p), "-y"]) == 0
    assert "Removed 4 block(s)" in capsys.readouterr().out
    assert main(["ls", "--store", str(p), "--format", "json"]) == 0
    assert [e["model_id"] for e in json.loads(capsys.readouterr().out)["items"]] == ["org/keep"]
    assert main(["rm", "org/dropp", "--store", str(p), "-y"]) == 1  # a typo: named, not found
    assert "no namespace of model 'org/dropp' in the store (models here: 'org/keep')" in \
        capsys.readouterr().err


def _closed_pipe(*args: str) -> subprocess.CompletedProcess:
    """Run the CLI with a stdout whose reader has gone (``| head`` after its lines)."""
    r, w = os.pipe()
    os.close(r)
    try:
        p = subprocess.run([sys.executable, "-m", "kvstore.cli", *args], stdout=w,
                           stderr=subprocess.PIPE, text=True, timeout=120,
                           stdin=subprocess.DEVNULL)
    finally:
        os.close(w)
    return p


def test_broken_pipe_is_quiet(one_store):
    ids = _cli("ls", "-q", "--store", str(one_store)).stdout.split()
    for args in (["rm", ids[0], "--dry-run", "--format", "json"], ["ls", "--format", "json"],
                 ["ls", "--blocks"], ["inspect"]):
        p = _closed_pipe(*args, "--store", str(one_store))
        assert p.returncode == 141, (args, p.stderr)
        assert p.stderr == "", (args, p.stderr)  # no "error: Broken pipe", no traceback


def test_usage_errors_exit_2_through_the_entry_point():
    p = _cli("ls", "--bogus")
    assert p.returncode == 2 and p.stderr.startswith("usage: kvstore ls")
    p = _cli("bench", "--section", "nope")
    assert p.returncode == 2 and "invalid choice: 'nope'" in p.stderr
    assert "usage: kvstore bench" in p.stderr


def test_bench_help_lists_every_section():
    from kvstore.bench.runner import SECTIONS

    text = _subparsers(build_parser())["bench"].format_help()
    for name, section in SECTIONS.items():
        assert f"  {name}" in text and section.about.split()[0] in text


def test_argparse_types_name_the_bound():
    from kvstore.commands import args as a

    with pytest.raises(argparse.ArgumentTypeError, match="is negative"):
        a.size()("-3MiB")
    assert a.size()("0") == 0 and a.size(minimum=1024)("1KiB") == 1024
    with pytest.raises(argparse.ArgumentTypeError, match="less than"):
        a.size(minimum=1024)("0")
    with pytest.raises(argparse.ArgumentTypeError, match="seconds > 0"):
        a.seconds(positive=True)("0")
    with pytest.raises(argparse.ArgumentTypeError, match="seconds >= 0"):
        a.seconds()("inf")
