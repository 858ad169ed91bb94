"""The command line as a new user meets it first: every subcommand's --help renders (through
`python -m mpiasgd` and the `mpiasgd` script), and train's (and simulate's) lists every config key."""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from mpiasgd.config import FIELDS

SUBCOMMANDS = ("train", "simulate", "evaluate", "report", "watch", "trace", "export", "data")
SCRIPT = shutil.which("mpiasgd", path=str(Path(sys.executable).parent))


@pytest.mark.parametrize("flag", ["--help", "-h"])
@pytest.mark.parametrize("command", SUBCOMMANDS)
def test_every_subcommand_help_renders(command, flag):
    res = subprocess.run([sys.executable, "-m", "mpiasgd", command, flag], capture_output=True, text=True,
                         timeout=60)
    assert res.returncode == 0 and res.stderr == "", res.stderr
    assert res.stdout.startswith(f"usage: mpiasgd {command}"), res.stdout[:200]
    if command in ("train", "simulate"):  # one flag per config key, and the autotune help's '%' shown as itself
        missing = [key for key in FIELDS if f"--{key.replace('_', '-')}" not in res.stdout]
        assert missing == [], missing
        assert "> 3 % faster" in res.stdout


def test_the_installed_script_and_the_top_level_help_render():
    assert SCRIPT is not None, f"no 'mpiasgd' script beside {sys.executable}: pip install -e ."
    for argv in ([SCRIPT, "train", "--help"], [SCRIPT, "--help"], [sys.executable, "-m", "mpiasgd", "--help"]):
        res = subprocess.run(argv, capture_output=True, text=True, timeout=60)
        assert res.returncode == 0 and res.stderr == "", (argv, res.stderr)
    assert all(command in res.stdout for command in SUBCOMMANDS), res.stdout


@pytest.mark.parametrize("argv,line", [
    (["report", "x.h5", "--formt", "csv"], "unrecognized arguments: --formt csv (did you mean --format?)"),
    (["data", "synth", "o.h5", "--count", "3", "--size", "4", "--clases", "3"],
     "unrecognized arguments: --clases 3 (did you mean --classes?)"),
    (["evaluate", "x.h5", "--zzz"], "unrecognized arguments: --zzz"),
])
def test_an_unknown_flag_of_a_subcommand_suggests_the_close_one(argv, line, capsys):
    """Python < 3.14's argparse names an unknown flag without a suggestion; mpiasgd adds the likely one."""
    from mpiasgd.cli import main

    with pytest.raises(SystemExit) as e:
        main(argv)
    assert e.value.code == 2
    assert capsys.readouterr().err.splitlines()[-1] == f"mpiasgd: error: {line}"
