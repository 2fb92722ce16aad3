"""Run several ``rollout-tracer`` commands in one interpreter where a package is missing, for
tests/test_missing_extras.py: ``python -m tests._missing_extras_run COMMANDS.json OUT.json``.

The interpreter starts with the package hidden (the test's ``sitecustomize.py``); each command
then runs in a fork of this process (so they share the imports made before and none sees
another's state), exactly as the console script runs it: ``rollout.cli.main(argv)``, an
exception that escapes it printed as Python prints an uncaught one. Each command's exit
status, stdout and stderr are written to OUT.json."""

from __future__ import annotations

import json
import os
import sys
import tempfile
import traceback


def run(argv: list[str], cwd: str) -> dict[str, object]:
    out = tempfile.TemporaryFile()  # noqa: SIM115  (closed by this process's exit)
    err = tempfile.TemporaryFile()  # noqa: SIM115
    pid = os.fork()
    if pid == 0:  # the command, as the console script runs it
        os.chdir(cwd)
        os.dup2(out.fileno(), 1)
        os.dup2(err.fileno(), 2)
        code = 1
        try:
            from rollout.cli import main

            code = main(argv)
        except SystemExit as exc:
            code = exc.code if isinstance(exc.code, int) else 1
        except BaseException:
            traceback.print_exc()
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code)
    _, status = os.waitpid(pid, 0)
    texts = []
    for f in (out, err):
        f.seek(0)
        texts.append(f.read().decode(errors="replace"))
    return {"argv": argv, "status": os.waitstatus_to_exitcode(status), "stdout": texts[0],
            "stderr": texts[1]}  # fmt: skip


def main() -> None:
    commands_path, out_path = sys.argv[1:3]
    with open(commands_path) as f:
        spec = json.load(f)
    results = [run(argv, spec["cwd"]) for argv in spec["commands"]]
    with open(out_path, "w") as f:
        json.dump(results, f)


if __name__ == "__main__":
    main()
