"""Starts of `python -m tracewire_server` that end before its engine does, many at once,
for test_startup.

Each such start spends its time importing vLLM (the server's argument parser is vLLM's),
~7 s of a core, and then exits in a fraction of a second. This runner imports it once and
runs each start in a fork of itself, as the interpreter runs `python -m`: the entry
point's `main(argv)`, its SystemExit turned into the exit status (a message: printed to
stderr, status 1) and the child's own stdout and stderr captured. test_startup keeps one
start a real `python -m` subprocess, so the module entry itself stays covered.

Reads {name: [args...]} as JSON on stdin; writes {name: {returncode, stdout, stderr}}.
"""

from __future__ import annotations

import json
import os
import sys
import tempfile
import traceback
from collections.abc import Callable


def _forked(main: Callable[[list[str]], int], argv: list[str]) -> dict[str, object]:
    with tempfile.TemporaryFile() as out, tempfile.TemporaryFile() as err:
        pid = os.fork()
        if pid == 0:  # the child: one start
            os.dup2(out.fileno(), 1)
            os.dup2(err.fileno(), 2)
            sys.argv = [sys.argv[0], *argv]
            try:
                code: object = main(argv)
            except SystemExit as e:
                code = e.code
            except BaseException:  # noqa: BLE001 - what the interpreter would print
                traceback.print_exc()
                code = 1
            if code is None:
                code = 0
            elif not isinstance(code, int):
                print(code, file=sys.stderr)
                code = 1
            sys.stdout.flush()
            sys.stderr.flush()
            os._exit(code)
        _, status = os.waitpid(pid, 0)
        out.seek(0)
        err.seek(0)
        return {"returncode": os.waitstatus_to_exitcode(status),
                "stdout": out.read().decode(errors="replace"), "stderr": err.read().decode(errors="replace")}


def main() -> None:
    cases: dict[str, list[str]] = json.load(sys.stdin)
    from tracewire_server import __main__ as entry
    from tracewire_server.frontend import engine, vllm_compat  # noqa: F401 - what every start imports

    json.dump({name: _forked(entry.main, argv) for name, argv in cases.items()}, sys.stdout)


if __name__ == "__main__":
    main()
