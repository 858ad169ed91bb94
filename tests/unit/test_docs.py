"""The docs are true to the code: every `mpiasgd ...` command line they show parses against the real argument
parser, every flag they name exists, and every relative link resolves (issue 37).

A command line is a line of a fenced code block (continuation lines joined, comments dropped) or an inline code
span that runs `mpiasgd` (`python -m mpiasgd ...`, `mpiasgd ...`, after `mpiexec`/`srun` and their flags). A
flag is an inline code span that starts with `--`: it must be a flag of an `mpiasgd` command, of a script under
`bench/` (a string literal in its source), or of the launchers and tools the docs show beside them (OTHER_FLAGS).
"""

from __future__ import annotations

import argparse
import contextlib
import functools
import importlib
import io
import re
import shlex
from pathlib import Path

import pytest

from mpiasgd import config
from mpiasgd.cli import make_parser
from mpiasgd.sim import cli as sim_cli

REPO = Path(__file__).resolve().parents[2]
PAGES = sorted([REPO / "README.md", *(REPO / "docs").rglob("*.md")])

# flags of the programs the docs show beside mpiasgd: mpiexec / mpirun (Open MPI), srun / sbatch / scancel
# (SLURM), pip, pytest, python, nvcc, and the tools of dev/ and tests/ that take their own flags
OTHER_FLAGS = {
    "--oversubscribe", "--bind-to", "--map-by", "--mca", "--host", "--hostfile", "--with-ft", "--dvm",  # mpiexec
    "--mpi", "--signal", "--gpus-per-task", "--ntasks-per-node", "--ntasks", "--nodes", "--batch", "--requeue",
    "--time", "--array", "--cpus-per-task", "--gres", "--gpus", "--export", "--kill-on-bad-exit", "--dependency",
    "--no-binary", "--index-url", "--extra-index-url", "--upgrade", "--quiet",  # pip
    "--against",  # dev/sass_mix.py
    "--tsan", "--plant", "--define", "--cases", "--full", "--repeat",  # tests/kernels_cpu/cuda_cpu/run_cases.py
    "--durations", "--timeout",  # pytest
    "--version", "--help",
}

FENCE = re.compile(r"^```(\w*)\s*$")
INLINE = re.compile(r"(?<!`)`([^`\n]+)`(?!`)")
LINK = re.compile(r"!?\[[^\]]*\]\(([^)\s]+)\)")


def fenced_lines(text: str) -> list[tuple[int, str]]:
    """(line number, line) of every shell line in a fenced code block (not python, toml or output blocks),
    continuation lines (ending in a backslash) joined."""
    out, lang, buf, start = [], None, "", 0
    for number, line in enumerate(text.splitlines(), 1):
        m = FENCE.match(line.strip())
        if m:
            lang = None if lang is not None else m.group(1)
            continue
        if lang is None or lang not in ("", "bash", "sh", "shell", "console"):
            continue
        if not buf:
            start = number
        if line.rstrip().endswith("\\"):
            buf += line.rstrip()[:-1] + " "
            continue
        out.append((start, buf + line))
        buf = ""
    return out


def spans(text: str) -> list[tuple[int, str]]:
    """(line number, text) of every inline code span outside fenced blocks."""
    out, inside = [], False
    for number, line in enumerate(text.splitlines(), 1):
        if FENCE.match(line.strip()):
            inside = not inside
            continue
        if not inside:
            out += [(number, m.group(1)) for m in INLINE.finditer(line)]
    return out


LAUNCHERS = ("mpiexec", "mpirun", "srun", "python", "python3", "mpiasgd", "env", "time", "timeout", "sudo")


def mpiasgd_argv(line: str) -> list[str] | None:
    """The arguments after `mpiasgd` of a shell line that runs it (None if it does not): the line's first
    command must be a launcher, python or mpiasgd (so program output in a code block is not taken for a
    command); shell operators and what follows them are dropped, and `...` (the docs' "and so on")."""
    try:
        lexer = shlex.shlex(line, posix=True, punctuation_chars=";&|<>")
        lexer.whitespace_split = True
        lexer.commenters = "#"
        tokens = list(lexer)
    except ValueError:
        return None
    for i, token in enumerate(tokens):
        if token and token[0] in ";&|<>":
            tokens = tokens[:i]
            break
    words = [t for t in tokens if not re.match(r"^[A-Z_][A-Z0-9_]*=", t)]  # environment assignments
    if not words or Path(words[0]).name not in LAUNCHERS:
        return None
    for i, token in enumerate(tokens):
        if token == "mpiasgd" and (i == 0 or tokens[i - 1] == "-m" or Path(tokens[i - 1]).name in LAUNCHERS
                                   or "=" in tokens[i - 1]):
            return [t for t in tokens[i + 1:] if t not in ("...", "\u2026")]
    return None


def leaf(argv: list[str], whole: bool = True) -> tuple[argparse.ArgumentParser, list[str]]:
    """The parser of the (sub)command `argv` names, and the arguments it takes; SystemExit naming a command
    that does not exist (or, `whole`, is missing)."""
    if argv and argv[0] == "train":
        return config.make_parser(), argv[1:]
    if argv and argv[0] == "simulate":
        return sim_cli.make_parser(), argv[1:]
    parser, rest = make_parser(), list(argv)
    while True:
        subs = [a for a in parser._actions if isinstance(a, argparse._SubParsersAction)]
        if not subs or (not rest and not whole):
            return parser, rest
        if not rest or rest[0] not in subs[0].choices:
            raise SystemExit(f"{parser.prog}: no command {rest[0] if rest else ''!r}; known: "
                             f"{', '.join(subs[0].choices)}")
        parser, rest = subs[0].choices[rest[0]], rest[1:]


def parse(argv: list[str], whole: bool = True) -> str | None:
    """None when `mpiasgd ARGV` parses against the real parsers (the command is not run), else why not.
    `whole`: a full command line (a code block's), parsed as the program would; else (an inline span, which
    may name a command without its arguments) the command must exist and take every flag the span names."""
    argv = [a for a in argv if a not in ("-h", "--help")]
    if not whole:
        argv = argv[:next((i for i, a in enumerate(argv) if a.endswith(":")), len(argv))]  # a quoted message
    err = io.StringIO()
    with contextlib.redirect_stderr(err), contextlib.redirect_stdout(io.StringIO()):
        try:
            parser, rest = leaf(argv, whole)
            if whole:
                parser.parse_args(rest)
        except config.ConfigError as e:  # (train's and simulate's parsers raise it)
            return str(e)
        except SystemExit as e:
            if e.code:
                return str(e.code) if isinstance(e.code, str) else err.getvalue().strip().splitlines()[-1]
            return None
    unknown = [a.split("=")[0] for a in rest if a.startswith("--") and a.split("=")[0] not in
               parser._option_string_actions]
    return f"{parser.prog}: no flag {', '.join(unknown)}" if unknown else None


def option_strings(parser: argparse.ArgumentParser) -> set[str]:
    flags = set(parser._option_string_actions)
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for sub in action.choices.values():
                flags |= option_strings(sub)
    return flags


def known_flags() -> set[str]:
    flags = option_strings(make_parser()) | option_strings(config.make_parser()) | option_strings(sim_cli.make_parser())
    for script in [*(REPO / "bench").glob("*.py"), *(REPO / "dev").glob("*.py")]:
        flags |= set(re.findall(r"[\"'](--[a-z0-9][a-z0-9-]*)[\"']", script.read_text(encoding="utf-8")))
    return flags | OTHER_FLAGS


def slug(heading: str) -> str:
    """GitHub's anchor of a markdown heading."""
    return re.sub(r"[^\w\- ]", "", heading.strip().lower()).replace(" ", "-")


def anchors(page: Path) -> set[str]:
    out, inside = set(), False
    for line in page.read_text(encoding="utf-8").splitlines():
        if FENCE.match(line.strip()):
            inside = not inside
        elif not inside and line.startswith("#"):
            out.add(slug(line.lstrip("#")))
    return out


def where(page: Path, number: int) -> str:
    return f"{page.relative_to(REPO)}:{number}"


def test_the_docs_are_the_readme_and_the_pages_under_docs():
    names = {p.relative_to(REPO).as_posix() for p in PAGES}
    assert "README.md" in names and "docs/benchmarks/README.md" in names and len(names) > 15, names
    assert len((REPO / "README.md").read_text(encoding="utf-8").splitlines()) <= 300


def test_every_mpiasgd_command_line_in_the_docs_parses():
    bad, seen = [], 0
    for page in PAGES:
        text = page.read_text(encoding="utf-8")
        lines = [(n, line, True) for n, line in fenced_lines(text)] + [(n, s, False) for n, s in spans(text)]
        for number, line, whole in lines:
            argv = mpiasgd_argv(line)
            if argv is None:
                continue
            seen += 1
            why = parse(argv, whole)
            if why:
                bad.append(f"{where(page, number)}: {line.strip()}\n    {why}")
    assert seen > 50, f"only {seen} mpiasgd command lines found: the scan is broken"
    assert not bad, "\n".join(bad)


def unknown_flags(text: str, flags: set[str]) -> list[tuple[int, str, str]]:
    """(line number, flag, span) of every flag named in an inline code span of `text` that is not in `flags`."""
    return [(number, flag, span) for number, span in spans(text)
            for flag in re.findall(r"(?:^|\s)(--[a-z0-9][a-z0-9-]*)", span) if flag not in flags]


def test_every_flag_the_docs_name_exists():
    flags = known_flags()
    bad = [f"{where(page, number)}: {flag} (in `{span}`)" for page in PAGES
           for number, flag, span in unknown_flags(page.read_text(encoding="utf-8"), flags)]
    assert not bad, "flags that no parser has:\n" + "\n".join(bad)


def test_every_relative_link_in_the_docs_resolves():
    bad = []
    for page in PAGES:
        for number, line in enumerate(page.read_text(encoding="utf-8").splitlines(), 1):
            for target in LINK.findall(line):
                if re.match(r"^[a-z]+:", target):  # http:, https:, mailto:
                    continue
                path, _, anchor = target.partition("#")
                dest = (page.parent / path).resolve() if path else page
                if not dest.exists():
                    bad.append(f"{where(page, number)}: {target} (no such file)")
                elif not dest.is_relative_to(REPO):
                    bad.append(f"{where(page, number)}: {target} (outside the repository)")
                elif anchor and dest.suffix == ".md" and anchor not in anchors(dest):
                    bad.append(f"{where(page, number)}: {target} (no heading '{anchor}' in {dest.name})")
    assert not bad, "\n".join(bad)


@pytest.mark.parametrize("line, why", [
    ("mpiexec -n 3 python -m mpiasgd train --model digits --epocs 30", "--epocs"),
    ("python -m mpiasgd report runs/a.h5 --format yaml", "yaml"),
    ("python -m mpiasgd simulate --workers 2 --fit", "--fit"),
    ("python -m mpiasgd evalute runs/a.h5", "evalute"),
])
def test_a_misspelled_command_line_is_caught(line, why):
    assert why in (parse(mpiasgd_argv(line)) or ""), parse(mpiasgd_argv(line))


def test_a_misspelled_flag_in_prose_is_caught():
    text = "Use `--comm-timeout 60` or `--staleness-bound 2`,\nnot `--comm-timout 60`.\n"
    assert unknown_flags(text, known_flags()) == [(2, "--comm-timout", "--comm-timout 60")]


PATH_SPAN = re.compile(r"^((?:mpiasgd|tests|bench|jobs|kernels|dev|docs)/[\w./-]*)")
FILE_SPAN = re.compile(r"^([\w/.-]+\.(?:py|cu|cuh|sh|sbatch|toml))\b")  # a file, maybe relative to mpiasgd/
DOTTED_SPAN = re.compile(r"^(mpiasgd(?:\.\w+)+)")


def stale_references(text: str) -> list[tuple[int, str]]:
    """(line number, reference) of every file path (`mpiasgd/rank0/loop.py`, `jobs/`) or dotted name
    (`mpiasgd.optim.rules.AsyncRule`, `mpiasgd.model.export.load_npz(path)`) named at the start of an inline
    code span of `text` that does not exist: no such file or folder, or no such module or attribute."""
    bad = []
    for number, span in spans(text):
        path = PATH_SPAN.match(span)
        if path and not (REPO / path.group(1).rstrip(".")).exists() and "*" not in span:
            bad.append((number, path.group(1)))
        file = FILE_SPAN.match(span)
        if not path and file and "/" in file.group(1) and not any((d / file.group(1)).exists() for d in
                                                                  (REPO, REPO / "mpiasgd", REPO / "kernels")):
            bad.append((number, file.group(1)))
        dotted = DOTTED_SPAN.match(span)
        if dotted and not resolves(dotted.group(1)):
            bad.append((number, dotted.group(1)))
    return bad


def resolves(name: str) -> bool:
    """`name` is a module of the package, or an attribute (a class, a function, a constant, a method) of one."""
    parts = name.split(".")
    for cut in range(len(parts), 0, -1):
        try:
            obj = importlib.import_module(".".join(parts[:cut]))
        except ImportError:
            continue
        for attr in parts[cut:]:
            if not hasattr(obj, attr):
                return False
            obj = getattr(obj, attr)
        return True
    return False


def test_every_file_module_and_page_the_docs_name_exists():
    bad = [f"{where(page, number)}: {ref}" for page in PAGES for text in [page.read_text(encoding="utf-8")]
           for number, ref in [*stale_references(text), *missing_pages(text)]]
    assert not bad, "named in the docs, not in the repository:\n" + "\n".join(bad)


def test_a_moved_file_or_a_renamed_function_in_the_docs_is_caught():
    text = ("`mpiasgd/rank0/loop.py` and `mpiasgd.optim.rules.AsyncRule.apply` exist;\n"
            "`mpiasgd/runlog/disk.py`, `mpiasgd.optim.rules.AsyncRules` and `mpiasgd.model.exports` do not\n"
            "`rank0/server.py` exists (under mpiasgd/), `rank0/servers.py` does not\n")
    assert stale_references(text) == [(2, "mpiasgd/runlog/disk.py"), (2, "mpiasgd.optim.rules.AsyncRules"),
                                       (2, "mpiasgd.model.exports"), (3, "rank0/servers.py")]


PAGE_NAME = re.compile(r"(?<![\w/.(-])([\w-]+\.md)\b")  # a page named in prose (not a link target or a path)


@functools.cache
def page_names() -> frozenset[str]:
    """The names of the repository's Markdown files (walked once a session)."""
    return frozenset(p.name for p in REPO.rglob("*.md") if ".git" not in p.parts and ".venv" not in p.parts)


def missing_pages(text: str) -> list[tuple[int, str]]:
    """(line number, name) of every Markdown page `text` names in prose ("see BENCHMARKS.md") that no file of
    the repository is called: a page that moved or was removed."""
    names = page_names()
    bad = []
    for number, line in enumerate(text.splitlines(), 1):
        line = re.sub(r"\]\([^)]*\)", "]", line)  # link targets are checked by the link test
        bad.extend((number, name) for name in PAGE_NAME.findall(line) if name not in names)
    return bad


def test_a_removed_page_named_in_prose_is_caught():
    text = "numbers in BENCHMARKS.md and [the summary](benchmarks/README.md);\nsee README.md and docs/gpus.md\n"
    assert missing_pages(text) == [(1, "BENCHMARKS.md")]
