"""A folder on a full disk, for the fault tests: a 512 KB tmpfs filled to the last byte; where
no tmpfs can be mounted (no privilege), ENOSPC from the one write function the test names."""

from __future__ import annotations

import contextlib
import errno
import os
import subprocess
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

import tracer


@contextlib.contextmanager
def full_disk(
    path: Path, monkeypatch: pytest.MonkeyPatch, module: Any, function: str
) -> Iterator[Callable[[], None]]:
    """``path`` on a full disk; yields a function that frees it. ``module.function`` is the
    write that fails with ENOSPC where no tmpfs can be mounted. Resets the tracer on the way
    out (before the tmpfs goes)."""
    path.mkdir(parents=True)
    mounted = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=512k", "tmpfs", str(path)],
                             capture_output=True).returncode == 0  # fmt: skip
    try:
        if mounted:
            filler = path / "filler"
            with open(filler, "wb", buffering=0) as f, contextlib.suppress(OSError):
                while True:
                    f.write(b"x" * 4096)
            freed: Callable[[], None] = filler.unlink
        else:
            real = getattr(module, function)

            def enospc(*args: Any, **kwargs: Any) -> Any:
                raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

            monkeypatch.setattr(module, function, enospc)

            def freed() -> None:
                monkeypatch.setattr(module, function, real)

        yield freed
    finally:
        tracer.reset()
        if mounted:
            subprocess.run(["umount", "-l", str(path)], check=False)
