"""The code blocks of a Markdown file, and running them as a reader would.

Every Python block of the docs is self-contained: a reader may copy any one of them alone.
`run_python` runs them so, each in a namespace of its own, in one fresh interpreter (one
start for all of them: a start and `import tracewire` cost seconds on a busy machine), with
`tracewire.TraceWarning` an error, so a step an example never reaches fails it; a block
that fails does not stop the others, and each failure is reported by name. It records what
each `print` wrote.
`# expected` comments on print lines are the documentation's claims: `print_claims` pairs
each with what was printed (`...` in a claim matches anything).
"""

from __future__ import annotations

import io
import json
import re
import subprocess
import sys
import tokenize
from dataclasses import dataclass
from pathlib import Path

FENCE = re.compile(r"^```(\w*)\s*$")
ROOT = Path(__file__).resolve().parents[1]


@dataclass(frozen=True)
class Block:
    path: Path
    line: int  # 1-based line of the block's first code line
    lang: str
    code: str

    @property
    def name(self) -> str:
        """Where the block is, e.g. docs/tutorials/patching.md:12 (the repository's
        several README.md files told apart)."""
        where = self.path.relative_to(ROOT) if self.path.is_relative_to(ROOT) else self.path
        return f"{where}:{self.line}"


def blocks(path: Path, lang: str) -> list[Block]:
    found: list[Block] = []
    current: list[str] | None = None
    current_lang, start = "", 0
    for n, line in enumerate(path.read_text().splitlines(), 1):
        fence = FENCE.match(line)
        if current is None and fence:
            current, current_lang, start = [], fence.group(1), n + 1
        elif current is not None and line.rstrip() == "```":
            if current_lang == lang:
                found.append(Block(path, start, lang, "\n".join(current) + "\n"))
            current = None
        elif current is not None:
            current.append(line)
    return found


# Runs in the child: each block in a namespace of its own, prints recorded by (block, line),
# every block run even when one before it failed (its traceback on stderr, exit status 1).
_DRIVER = r'''
import builtins, io, json, sys, traceback, warnings
import tracewire
warnings.simplefilter("error", tracewire.TraceWarning)
blocks, out_path = json.load(open(sys.argv[1])), sys.argv[2]
records, real_print = [], builtins.print
def recording_print(*args, sep=" ", end="\n", file=None, flush=False):
    if file is None:
        text = io.StringIO()
        real_print(*args, sep=sep, end=end, file=text)
        frame = sys._getframe(1)
        records.append([frame.f_code.co_filename, frame.f_lineno, text.getvalue()])
    real_print(*args, sep=sep, end=end, file=file, flush=flush)
builtins.print = recording_print
failed = []
for block in blocks:
    try:
        exec(compile(block["code"], block["name"], "exec"), {"__name__": "__main__"})
    except BaseException:
        failed.append(block["name"])
        sys.stderr.write(f"--- {block['name']} failed:\n{traceback.format_exc()}")
json.dump(records, open(out_path, "w"))
if failed:
    sys.exit(f"failed: {', '.join(failed)}")
'''


@dataclass(frozen=True)
class PythonRun:
    returncode: int
    stdout: str
    stderr: str
    prints: dict[tuple[str, int], list[str]]  # (block name, line in block) -> each call's text


def run_python(snippets: list[Block], cwd: Path, replace: dict[str, str], timeout: float = 300) -> PythonRun:
    sources = [{"name": b.name, "code": _replaced(b.code, replace)} for b in snippets]
    (cwd / "blocks.json").write_text(json.dumps(sources))
    proc = subprocess.run([sys.executable, "-c", _DRIVER, "blocks.json", "prints.json"], cwd=cwd,
                          capture_output=True, text=True, timeout=timeout)
    prints: dict[tuple[str, int], list[str]] = {}
    records = json.loads((cwd / "prints.json").read_text()) if (cwd / "prints.json").exists() else []
    for name, line, text in records:
        prints.setdefault((name, line), []).append(text)
    return PythonRun(proc.returncode, proc.stdout, proc.stderr, prints)


def print_claims(block: Block) -> list[tuple[int, str]]:
    """(line in block, claimed output) for each `print(...)  # claim` line."""
    claims = []
    for tok in tokenize.generate_tokens(io.StringIO(block.code).readline):
        if tok.type == tokenize.COMMENT and tok.line.lstrip().startswith("print("):
            claims.append((tok.start[0], tok.string[1:].strip()))
    return claims


def claim_holds(claim: str, printed: str) -> bool:
    pattern = ".*".join(re.escape(part) for part in claim.split("..."))
    return re.fullmatch(pattern, printed.rstrip("\n"), flags=re.DOTALL) is not None


def _replaced(code: str, replace: dict[str, str]) -> str:
    for old, new in replace.items():
        code = code.replace(old, new)
    return code
