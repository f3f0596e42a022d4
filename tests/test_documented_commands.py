"""Every command line the documentation shows is one its command accepts.

The documents are README.md, docs/*.md, training/README.md, export/README.md and BENCHMARKS.md. Their command
lines are the lines of fenced code blocks (in a shell language, or none: a `text` or `python` block is no command
line), and the inline code, that run one of the project's commands: a console script of setup.py (`kt-train`,
...), `python -m training.NAME` or `python -m export.NAME`, or a benchmark script (`python bench/NAME.py`, with
any interpreter path, e.g. `.venv/bin/python`). Each is split as the shell
splits it (a `\\` at a line's end continues it; `|`, `;`, `&&` and `&` separate commands; redirections,
environment assignments and `# comments` are set aside) and its arguments are parsed by the command's own
parser, the `build_parser()` of its module: a flag the parser does not know, a value it refuses, a command or
script that does not exist, fails, naming file:line and the command.

What the documentation writes for the reader to fill in is read as such: a shell or make variable (`$RUN`,
`${RUN}`, `$(RUN)`), a word in capitals (`N`, `DIR`, `SAVED_MODEL_DIR`) as the value of any flag, `...` as
elided arguments, and `[--flag VALUE]` as an optional one. Inline code may quote part of a command
(`kt-export --xla-max-batch 8`): there a missing required argument, or a flag quoted without its value, is
not a failure; a flag the command does not know still is. A script that docs/benchmarks-log.md lists as
removed from bench/ is not parsed: the commit the list names has it. No model is built: the commands' modules
are only imported.
"""

import argparse
import contextlib
import importlib
import io
import os
import re
import shlex
import sys
from functools import lru_cache

from conftest import REPO, removed_bench_scripts

DOCUMENTS = ["README.md", *sorted(str(p.relative_to(REPO)) for p in (REPO / "docs").glob("*.md")),
             "training/README.md", "export/README.md", "BENCHMARKS.md"]

# What marks a line (or an inline code span) worth splitting: it names a command somewhere.
MENTIONS_COMMAND = re.compile(r"(?:^|[\s/|;&(])kt-[a-z][a-z0-9-]*(?:\s|$)"
                              r"|python[0-9.]*\s.*?-m\s+(?:training|export)\."
                              r"|(?:^|[\s/])bench/\w+\.py\b")
FENCE = re.compile(r"^\s*(?:```|~~~)\s*(\S*)")
SHELL_BLOCKS = {"", "sh", "bash", "shell", "console", "zsh"}  # a fenced block in another language is no command
INLINE_CODE = re.compile(r"(?<!`)`([^`\n]+(?:\n(?!\s*\n)[^`\n]+)*)`(?!`)")
SHELL_VARIABLE = re.compile(r"\$(?:\{(\w+)\}|\((\w+)\)|(\w+))")
# A value the reader fills in: a word with a capital letter and no small one (N, DIR, EXPORT_DIR/NAME, N,N).
PLACEHOLDER = re.compile(r"[^a-z]*[A-Z][^a-z]*")
ASSIGNMENT = re.compile(r"^[A-Za-z_]\w*=")
WRAPPERS = {"time", "nohup", "env", "exec", "nice", "timeout", "taskset", "numactl"}
SEPARATORS = {"|", "||", "&&", ";", "&", ")", "|&"}  # and "(" opening a command (a subshell)
PYTHON = re.compile(r"(?:.*/)?python[0-9.]*")
BENCH_SCRIPT = re.compile(r"(?:.*/)?bench/(\w+)\.py")
PACKAGES = ("training", "export")  # python -m PACKAGE.NAME


@lru_cache(maxsize=None)
def console_scripts():
    """{script name: module} of setup.py's console_scripts."""
    text = (REPO / "setup.py").read_text(encoding="utf-8")
    scripts = dict(re.findall(r'"(kt-[a-z-]+)=([\w.]+):main"', text))
    assert scripts, "no console_scripts found in setup.py"
    return scripts


@lru_cache(maxsize=None)
def removed_scripts():
    """conftest's `removed_bench_scripts()`, read once."""
    return removed_bench_scripts()


def command_lines(document):
    """(line number, text, inline) of every piece of `document` that may hold a command line: each line of its
    fenced shell blocks (continuations joined; inline False) and each inline code span (its line breaks made
    spaces; inline True)."""
    lines = (REPO / document).read_text(encoding="utf-8").split("\n")
    in_fence, shell, prose, pending, start = False, False, [], "", 0
    for number, line in enumerate(lines, 1):
        fence = FENCE.match(line)
        if fence:
            in_fence = not in_fence
            shell = in_fence and fence.group(1).lower() in SHELL_BLOCKS
            prose.append("")
            continue
        if not in_fence:
            prose.append(line)
            continue
        prose.append("")
        if not shell:
            continue
        if not pending:
            start = number
        if line.rstrip().endswith("\\"):
            pending += line.rstrip()[:-1] + " "
            continue
        yield start, pending + line, False
        pending = ""
    text = "\n".join(prose)
    for match in INLINE_CODE.finditer(text):
        yield text.count("\n", 0, match.start()) + 1, match.group(1).replace("\n", " "), True


def split_commands(text):
    """The argument lists of the commands of a shell line, each list starting with the command's words."""
    text = SHELL_VARIABLE.sub(lambda m: next(g for g in m.groups() if g).upper(), text)
    text = re.sub(r"(?:(?<=\s)|^)\d+(?=[<>])", "", text)  # 2>&1, 2>/dev/null: the descriptor goes with the redirection
    lexer = shlex.shlex(text, posix=True, punctuation_chars=True)
    lexer.whitespace_split = True
    commands, current, skip_next = [], [], False
    for token in lexer:
        if skip_next:
            skip_next = False
        elif token in SEPARATORS or (token == "(" and not current):
            commands.append(current)
            current = []
        elif token[0] in "<>":
            skip_next = True  # a redirection: its target is no argument
        else:
            current.append(token)
    return [c for c in commands + [current] if c]


def find_command(words):
    """(command name, its module, its arguments) of the project's command that `words` runs (after any
    environment assignments and wrappers such as `timeout 600`), or None when they run something else."""
    i = 0
    while i < len(words) and (ASSIGNMENT.match(words[i]) or words[i] in WRAPPERS):
        wrapper = words[i] in WRAPPERS
        i += 1
        while wrapper and i < len(words) and re.fullmatch(r"-\w+|[\d.,:-]+[smh]?", words[i]):
            i += 1  # the wrapper's own options: timeout 600, taskset -c 0,1
    if i >= len(words):
        return None
    name = words[i].rsplit("/", 1)[-1]
    if name.startswith("kt-"):
        return name, console_scripts().get(name), words[i + 1:]
    if PYTHON.fullmatch(words[i]):
        i += 1
        while i < len(words) and words[i].startswith("-") and words[i] != "-m":
            i += 1
        if words[i:i + 1] == ["-m"] and i + 1 < len(words):
            module = words[i + 1]
            return (f"python -m {module}", module, words[i + 2:]) if module.split(".")[0] in PACKAGES else None
    script = BENCH_SCRIPT.fullmatch(words[i]) if i < len(words) else None
    if script:
        name = f"{script.group(1)}.py"
        # A script removed from bench/ is in the commit the benchmarks log names, with the parser it had then.
        return (f"bench/{name}", None if name in removed_scripts() else f"bench.{script.group(1)}",
                words[i + 1:])
    return None


def clean_arguments(arguments):
    """The arguments as the command would get them once the reader filled them in: `...` dropped, the
    brackets of `[--flag VALUE]` taken off."""
    out = []
    for word in arguments:
        if word in ("...", "…"):
            continue
        if word.startswith("[") and (word[1:].startswith("-") or out and out[-1].startswith("-")):
            word = word[1:]
        if word.endswith("]") and "[" not in word:
            word = word[:-1]
        if word:
            out.append(word)
    return out


class _Choices(list):
    """An action's choices, any placeholder among them."""

    def __contains__(self, value):
        return (isinstance(value, str) and PLACEHOLDER.fullmatch(value) is not None) or super().__contains__(value)


def _or_placeholder(convert):
    """argparse's `type` function `convert`, but a placeholder stays as written."""
    def read(text):
        return text if isinstance(text, str) and PLACEHOLDER.fullmatch(text) else convert(text)

    read.__name__ = getattr(convert, "__name__", repr(convert))  # argparse's "invalid int value" names it
    return read


def _placeholder_tolerant(parser, partial):
    """`parser` (and its subcommands' parsers) reading a placeholder as a value of any flag; with `partial`,
    nothing required (inline code quotes part of a command)."""
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for sub in set(action.choices.values()):
                _placeholder_tolerant(sub, partial)
        else:
            if callable(action.type):
                action.type = _or_placeholder(action.type)
            if action.choices is not None:
                action.choices = _Choices(action.choices)
        if partial:
            action.required = False
    if partial:
        for group in parser._mutually_exclusive_groups:
            group.required = False
    return parser


@lru_cache(maxsize=None)
def parser_factory(module_name):
    """The `build_parser` of the command's module (None when the module takes no arguments), or an error
    string."""
    environ = dict(os.environ)
    try:
        module = importlib.import_module(module_name)
    except ModuleNotFoundError as e:
        return f"no module {module_name} ({e})"
    except Exception as e:
        return f"importing {module_name} failed: {type(e).__name__}: {e}"
    finally:
        # A command's module may set the environment for its command as it is imported (training.train turns
        # TensorFlow's oneDNN on): the suite's other tests must not inherit it.
        os.environ.clear()
        os.environ.update(environ)
    return getattr(module, "build_parser", None)


def parse(command, module_name, arguments, partial):
    """None when `arguments` parse with the command's parser, else why not."""
    if module_name is None:
        if command.startswith("bench/"):
            return None  # a removed script (find_command)
        return f"{command} is not a console script of setup.py ({', '.join(sorted(console_scripts()))})"
    factory = parser_factory(module_name)
    if isinstance(factory, str):
        return factory
    if factory is None:
        return f"{module_name} takes no arguments" if arguments else None
    arguments = list(arguments)
    for _ in range(10):
        parser = _placeholder_tolerant(factory(), partial)
        err = io.StringIO()
        try:
            with contextlib.redirect_stderr(err), contextlib.redirect_stdout(io.StringIO()):
                parser.parse_args(arguments)
            return None
        except SystemExit as e:
            if e.code in (0, None):  # --help
                return None
            message = err.getvalue().strip().splitlines()[-1] if err.getvalue().strip() else f"exit {e.code}"
        except Exception as e:  # a type function that raised something else: the parse crashed
            return f"the parse crashed: {type(e).__name__}: {e}"
        # A flag quoted at the end of inline code without its value: give it one.
        flag = re.search(r"argument ([^:]+): expected (one|at least one|\d+) arguments?", message)
        if partial and flag and arguments and arguments[-1] in flag.group(1).split("/"):
            arguments += ["VALUE"] * (int(flag.group(2)) if flag.group(2).isdigit() else 1)
            continue
        return message
    return message


def documented_commands():
    """(file:line, command, module or script, arguments, partial) of every command line of the documents."""
    found = []
    for document in DOCUMENTS:
        for number, text, inline in command_lines(document):
            if not MENTIONS_COMMAND.search(text):
                continue
            where = f"{document}:{number}"
            try:
                commands = split_commands(text)
            except ValueError as e:
                found.append((where, text.strip(), None, None, f"the shell cannot split it: {e}"))
                continue
            for words in commands:
                command = find_command(words)
                if command:
                    name, module_name, arguments = command
                    found.append((where, " ".join(words), name, module_name, (clean_arguments(arguments), inline)))
    return sorted(found, key=lambda command: (command[0].rsplit(":", 1)[0], int(command[0].rsplit(":", 1)[1])))


def _problems(commands):
    problems = []
    for where, line, name, module_name, parsed in commands:
        if isinstance(parsed, str):
            problems.append(f"{where}: {line}\n    {parsed}")
            continue
        arguments, partial = parsed
        problem = parse(name, module_name, arguments, partial)
        if problem:
            problems.append(f"{where}: {line}\n    {problem}")
    return problems


def test_every_documented_command_line_parses_with_its_commands_parser():
    if str(REPO) not in sys.path:
        sys.path.insert(0, str(REPO))  # bench/'s scripts import as bench.NAME, as they import each other
    commands = documented_commands()
    # The documents show every kind of command: a change that found none would test nothing.
    names = {name for _, _, name, _, _ in commands}
    assert {"kt-train", "kt-prepare", "kt-evaluate", "kt-export", "kt-translate", "kt-average-checkpoints",
            "python -m training.train", "python -m export.client"} <= names, sorted(names)
    assert any(name.startswith("bench/") for name in names), sorted(names)
    problems = _problems(commands)
    assert problems == [], "documented command lines their parsers refuse:\n" + "\n".join(problems)


def test_the_check_refuses_an_unknown_flag_a_bad_value_and_a_missing_command(tmp_path, monkeypatch):
    """The check itself: a documented command with a flag its parser lacks, a value its parser refuses, or no
    such command, is reported with its file and line; placeholders, continuations, pipes and partial inline
    code are not."""
    if str(REPO) not in sys.path:
        sys.path.insert(0, str(REPO))
    doc = tmp_path / "doc.md"
    doc.write_text("\n".join([
        "Run `kt-export --xla-max-batch 8` or `kt-average-checkpoints --best N`, or `kt-train --no-such-flag`.",
        "```sh",
        'echo "A man." | .venv/bin/kt-translate --saved-model $EXPORT/1 --batch-size N 2>/dev/null > out.de',
        ".venv/bin/kt-train --preset small \\",
        "    --epochs ten",
        "python -m training.no_such_module --x 1",
        ".venv/bin/python bench/ctranslate2_side_by_side.py compare --saved-model exports/t --ct2-model ct2 --bogus",
        "python -m training.plots loss --model-dir runs/x --out loss.png   # a comment's apostrophe's fine",
        "KERAS_BACKEND=tensorflow taskset -c 0,1 timeout 10m python -m export.graph_ops $(EXPORT)/1 --allow-xla",
        "kt-nothing --help",
        "```",
    ]))
    monkeypatch.setattr(sys.modules[__name__], "DOCUMENTS", [str(doc)])
    problems = _problems(documented_commands())
    assert [p.split(":")[1] for p in problems] == ["1", "4", "6", "7", "10"], "\n".join(problems)
    assert "unrecognized arguments: --no-such-flag" in problems[0]
    assert "argument --epochs: invalid int value: 'ten'" in problems[1]
    assert "no module training.no_such_module" in problems[2]
    assert "unrecognized arguments: --bogus" in problems[3]
    assert "kt-nothing is not a console script" in problems[4]
