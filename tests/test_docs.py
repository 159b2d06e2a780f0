"""The README and docs/ stay true to the code: every flag of every command is in its table
in docs/cli.md (and nothing else is), the examples use only real flags, the README stays
short and its test command is the one CI runs, and every relative link points to a file
that exists."""
import re
import shlex
from pathlib import Path

import click
import pytest

from batchinfer.bench.cli import bench
from batchinfer.cli import main
from batchinfer.job.cli import merge, run

REPO = Path(__file__).resolve().parents[1]
DOCS = REPO / "docs"
README = REPO / "README.md"
MAX_README_LINES = 200


def _context(command: click.Command, name: str, parent: click.Context) -> click.Context:
    return command.make_context(name, [], parent=parent, resilient_parsing=True)


def _commands() -> dict[str, tuple[click.Command, click.Context]]:
    """Each documented command with a context made as `batchinfer` makes it (so the help
    option has its -h spelling)."""
    top = click.Context(main, info_name="batchinfer", **main.context_settings)
    commands = {name: (cmd, _context(cmd, name, top))
                for name, cmd in (("run", run), ("merge", merge), ("bench", bench))}
    bench_ctx = commands["bench"][1]
    for name in ("kernels", "structured"):
        sub = bench.get_command(bench_ctx, name)
        commands[f"bench {name}"] = (sub, _context(sub, name, bench_ctx))
    return commands


# the help option: click builds it once per command, with the help names of the first
# context that asks (a test invoking `run` alone gives it no -h), so it is not compared
HELP = {"-h", "--help"}


def real_flags(command: click.Command, ctx: click.Context) -> set[str]:
    """Every spelling of every option, --no- forms included (the help option aside)."""
    return {opt for param in command.get_params(ctx) if isinstance(param, click.Option)
            for opt in (*param.opts, *param.secondary_opts)} - HELP


def _sections(text: str) -> dict[str, str]:
    """The text under each `## ` heading, by heading."""
    parts = re.split(r"^## +(.+?) *$", text, flags=re.M)
    return {parts[i].strip(): parts[i + 1] for i in range(1, len(parts), 2)}


_FLAG = re.compile(r"(?<![\w-])--?[A-Za-z][\w-]*")


def documented_flags(section: str) -> set[str]:
    """The flags in the first column of the section's flag table (`| flag | default | ...`)."""
    lines = section.splitlines()
    start = next((i for i, line in enumerate(lines) if re.match(r"\|\s*flag\s*\|", line)), None)
    assert start is not None, "no `| flag | default | what it does |` table"
    flags = set()
    for line in lines[start + 2:]:
        if not line.startswith("|"):
            break
        first = line.split("|")[1]
        for code in re.findall(r"`([^`]*)`", first):
            flags.update(_FLAG.findall(code))
    return flags - HELP


@pytest.mark.parametrize("name", ["run", "merge", "bench", "bench kernels",
                                  "bench structured"])
def test_cli_md_documents_every_flag_and_only_real_ones(name):
    command, ctx = _commands()[name]
    sections = _sections((DOCS / "cli.md").read_text())
    assert name in sections, f"docs/cli.md has no `## {name}` section"
    real, documented = real_flags(command, ctx), documented_flags(sections[name])
    assert not real - documented, (
        f"flags of `batchinfer {name}` missing from its table in docs/cli.md: "
        f"{sorted(real - documented)}")
    assert not documented - real, (
        f"docs/cli.md's `{name}` table has flags `batchinfer {name}` does not: "
        f"{sorted(documented - real)}")


def test_documented_flags_reads_every_spelling():
    section = """
| flag | default | what it does |
|---|---|---|
| `-o`, `--output TEXT` | required | out |
| `--enable-prefix-caching`, `--prefix-caching` / `--no-enable-prefix-caching`, `--no-prefix-caching` | on | `--not-this` |
| `--max-n N` | 128 | most |

| flag | default | what it does |
| `--a-later-table` | | |
"""
    assert documented_flags(section) == {
        "-o", "--output", "--enable-prefix-caching", "--prefix-caching",
        "--no-enable-prefix-caching", "--no-prefix-caching", "--max-n"}


def test_readme_is_short():
    lines = README.read_text().splitlines()
    assert len(lines) <= MAX_README_LINES, (
        f"README.md has {len(lines)} lines; keep it to {MAX_README_LINES} and move detail "
        "into docs/")


def _quick_start_commands() -> list[str]:
    section = _sections(README.read_text())["Quick start"]
    block = re.search(r"```bash\n(.*?)```", section, flags=re.S)
    assert block, "README's Quick start has no bash block"
    return [line for line in block.group(1).splitlines()
            if line.strip() and not line.startswith("#")]


def test_readme_quick_start_test_command_is_what_ci_runs():
    demo, tests = _quick_start_commands()
    assert demo.endswith("batchinfer run --config jobs/demo.toml")
    ci = [line for line in (REPO / ".ci" / "run").read_text().splitlines()
          if line.strip() and not line.lstrip().startswith("#")]
    steps = [shlex.split(step) for step in tests.split("&&")]
    venv, install, pytest_ = steps
    assert venv == ["python3", "-m", "venv", ".venv"]
    assert any(shlex.split(line) == venv for line in ci)
    # the same packages installed: the pinned torch and the package with its test extra
    assert install[:2] == [".venv/bin/pip", "install"]
    packages = install[2:]
    installs = [shlex.split(line) for line in ci if " install " in line]
    assert any(words[-len(packages):] == packages for words in installs), (
        f".ci/run does not install {packages}")
    # and the same test runner, on the whole suite
    assert pytest_ == [".venv/bin/pytest"]
    runs = [shlex.split(line) for line in ci if ".venv/bin/pytest" in line]
    assert runs and all(not arg.startswith("tests") for arg in runs[0]), (
        ".ci/run's pytest must run the whole suite, as the README's command does")


def _markdown_files() -> list[Path]:
    return [README, *sorted(DOCS.glob("*.md"))]


_COMMAND = re.compile(r"(?:^|&&|\s)(?:\S*/)?batchinfer "
                      r"(bench kernels|bench structured|run|merge|bench)\b(.*)")


def example_commands() -> list[tuple[str, str, list[str]]]:
    """(file, command, flags) of each `batchinfer COMMAND ...` line in the bash examples."""
    found = []
    for path in _markdown_files():
        for block in re.findall(r"```bash\n(.*?)```", path.read_text(), flags=re.S):
            for line in block.replace("\\\n", " ").splitlines():
                m = _COMMAND.search(line)
                if not m:
                    continue
                words = shlex.split(m.group(2).split("&&")[0], comments=True)
                flags = [w.split("=")[0] for w in words if re.match(r"--?[A-Za-z]", w)]
                found.append((path.name, m.group(1), flags))
    return found


def test_examples_use_real_flags():
    commands = _commands()
    examples = example_commands()
    assert len(examples) > 20
    bad = [(name, command, flag) for name, command, flags in examples for flag in flags
           if flag not in real_flags(*commands[command])]
    assert not bad, f"examples with flags their command does not have: {bad}"


_LINK = re.compile(r"\]\(([^)\s]+)\)")


@pytest.mark.parametrize("path", _markdown_files(), ids=lambda p: str(p.relative_to(REPO)))
def test_relative_links_point_to_files(path):
    text = re.sub(r"```.*?```", "", path.read_text(), flags=re.S)
    bad = []
    for target in _LINK.findall(text):
        if re.match(r"[a-z][a-z0-9+.-]*:", target):  # https:, mailto:, ...
            continue
        if "#" in target:
            bad.append(f"{target} (a heading anchor: link the file)")
        elif not (path.parent / target).exists():
            bad.append(f"{target} (no such file)")
    assert not bad, f"{path.relative_to(REPO)}: {bad}"
