"""The documents stay true: the README's commands parse, its results are its JSONs', every result
records where it came from, and the configuration reference is the code's."""

from __future__ import annotations

import importlib.util
import json
import re
import shlex
from pathlib import Path

import pytest

from common.config import load_config, reference_markdown
from deploy.cli import build_parser

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "docs" / "results"
README = (ROOT / "README.md").read_text()


def markdown_table(text: str, header: str) -> list[list[str]]:
    """The rows of the table whose header line starts with ``header``, as cell strings."""
    lines = text.splitlines()
    start = next(i for i, line in enumerate(lines) if line.startswith(header))
    rows = []
    for line in lines[start + 2 :]:
        if not line.startswith("|"):
            break
        rows.append([cell.strip() for cell in line.strip().strip("|").split("|")])
    return rows


def at(data: object, path: str) -> object:
    """The value at a dot path; a key may itself hold dots, so parts are joined until one fits."""
    parts = path.split(".")
    while parts:
        for n in range(1, len(parts) + 1):
            key = ".".join(parts[:n])
            if isinstance(data, list) and key.isdigit() and int(key) < len(data):
                data = data[int(key)]
                break
            if isinstance(data, dict) and key in data:
                data = data[key]
                break
        else:
            raise KeyError(f"{path}: no key at {'.'.join(parts)}")
        parts = parts[n:]
    return data


def shown(value: float, like: str) -> str:
    """``value`` with as many decimals as ``like`` shows."""
    decimals = len(like.split(".")[1]) if "." in like else 0
    return f"{value:.{decimals}f}"


CLAIMS = {row[0]: row for row in markdown_table((RESULTS / "README.md").read_text(), "| claim |")}


@pytest.mark.parametrize("claim", sorted(CLAIMS))
def test_every_claimed_value_is_what_its_json_holds(claim: str) -> None:
    _, default_file, values, command = CLAIMS[claim]
    assert (RESULTS / default_file).exists(), default_file
    assert command, f"{claim}: no command"
    for spec, expected in re.findall(r"`([^`=]+)=([^`]+)`", values):
        file, _, path = spec.rpartition(":")
        data = json.loads((RESULTS / (file or default_file)).read_text())
        value = at(data, path)
        assert shown(float(value), expected) == expected, f"{claim}: {spec} is {value}"


def test_every_decimal_figure_of_the_readme_results_is_a_claimed_value() -> None:
    rows = markdown_table(README, "| result | figure |")
    assert len(rows) >= 8
    for result, figure, _seeds, link, commit in rows:
        assert result in CLAIMS, f"README result {result!r} is not in docs/results/README.md"
        claimed = {v for _, v in re.findall(r"`([^`=]+)=([^`]+)`", CLAIMS[result][2])}
        for number in re.findall(r"\d+\.\d+", figure):
            assert number in claimed, f"{result}: {number} is in no value of its claim"
        file = re.fullmatch(r"\[(\S+\.json)\]\(docs/results/\1\)", link)
        assert file and file[1] == CLAIMS[result][1], link
        provenance = json.loads((RESULTS / file[1]).read_text())["provenance"]
        assert len(commit) >= 7 and provenance["commit"].startswith(commit), (result, provenance)


@pytest.mark.parametrize("path", sorted(RESULTS.glob("*.json")), ids=lambda p: p.name)
def test_every_result_records_its_command_commit_and_machine(path: Path) -> None:
    provenance = json.loads(path.read_text()).get("provenance")
    assert provenance, f"{path.name}: no provenance"
    assert provenance["command"] and provenance["machine"]
    assert re.fullmatch(r"[0-9a-f]{7,40}(-dirty)?", provenance["commit"]), provenance["commit"]
    status = provenance.get("status", "current")
    assert status == "current" or status.startswith(("historical", "ran at", "current for")), status


def test_the_configuration_reference_is_the_codes() -> None:
    assert reference_markdown() in (ROOT / "docs" / "configuration.md").read_text()


def commands(text: str) -> list[str]:
    """Every command line of the bash blocks, continuation lines joined, `&` and comments cut."""
    found = []
    for block in re.findall(r"```bash\n(.*?)```", text, re.S):
        for line in block.replace("\\\n", " ").splitlines():
            line = line.split("  #")[0].strip().removesuffix("&").strip()
            if line and not line.startswith("#"):
                found.append(line)
    return found


def ours(command: str) -> bool:
    """A command of this project (the docs also show kubectl, docker, shell)."""
    first = next(w for w in command.split() if "=" not in w)
    return first in ("asyncppo", "torchrun", "make", "python")


DOCS = sorted((ROOT / "docs").glob("*.md"))
DOC_COMMANDS = [(p.name, c) for p in DOCS for c in commands(p.read_text()) if ours(c)]


@pytest.mark.parametrize("command", commands(README))
def test_every_readme_command_names_what_exists_and_parses(command: str) -> None:
    """`asyncppo` lines parse with the CLI's parser and their config and --set load; modules,
    scripts and make targets exist. A command of another kind fails: cover it here."""
    check_command(command)


@pytest.mark.parametrize("doc, command", DOC_COMMANDS)
def test_every_command_of_ours_in_the_docs_names_what_exists_and_parses(doc, command) -> None:
    check_command(command)


def check_command(command: str) -> None:
    argv = shlex.split(command)
    while "=" in argv[0] and not argv[0].startswith("-"):  # PYTHONPATH=... before the command
        argv = argv[1:]
    if argv[0] == "make":
        targets = re.findall(r"^([\w-]+):", (ROOT / "Makefile").read_text(), re.M)
        assert argv[1] in targets, command
        return
    if argv[0] == "python" and argv[1] == "-m":
        assert importlib.util.find_spec(argv[2]) is not None, command
        return
    if argv[0] == "python":
        assert (ROOT / argv[1]).is_file(), command
        return
    if argv[0] == "torchrun":
        argv = ["asyncppo", *argv[argv.index("deploy.cli") + 1 :]]
    assert argv[0] == "asyncppo", f"a README command this test does not check: {command}"
    args = build_parser().parse_args(argv[1:])
    if getattr(args, "config", None):
        load_config(ROOT / args.config, getattr(args, "overrides", []))
