"""A report's provenance: the command that reruns it, the commit it ran at, the machine it ran on.

A figure is evidence only if someone can rerun it and knows what code it measured, so every
benchmark writes its JSON through ``write_report``.
"""

from __future__ import annotations

import json
import os
import platform
import shlex
import subprocess
import sys
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
SCRATCH = Path("runs/bench")  # where a report goes unless --out says otherwise


def command() -> str:
    """The command line that ran this process, as it is rerun from the repository root."""
    spec = getattr(sys.modules["__main__"], "__spec__", None)
    module = spec.name.removesuffix(".__main__") if spec is not None else None  # a package's
    program = f"-m {module}" if module else os.path.relpath(sys.argv[0], ROOT)
    return f"python {program} {shlex.join(sys.argv[1:])}".rstrip()


def commit() -> str:
    """HEAD's sha, with ``-dirty`` when tracked files differ from it (the figure then measured code
    no commit holds)."""

    def git(*args: str) -> str:
        return subprocess.run(
            ["git", "-C", str(ROOT), *args], capture_output=True, text=True, check=False
        ).stdout.strip()

    sha = git("rev-parse", "HEAD") or "unknown"
    return sha + ("-dirty" if git("status", "--porcelain", "--untracked-files=no") else "")


def machine(**extra: Any) -> dict[str, Any]:
    """Cores, CPU model, memory and the software versions a figure depends on."""
    cpu = next(
        (line.split(":", 1)[1].strip() for line in _cpuinfo() if line.startswith("model name")),
        platform.processor() or platform.machine(),
    )
    facts: dict[str, Any] = {
        "cpus": os.cpu_count(),
        "cpu": cpu,
        "memory_bytes": os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES"),
        "platform": platform.platform(),
        "python": platform.python_version(),
    }
    if "torch" in sys.modules:
        facts["torch"] = sys.modules["torch"].__version__
    return {**facts, **extra}


def _cpuinfo() -> list[str]:
    try:
        return Path("/proc/cpuinfo").read_text().splitlines()
    except OSError:
        return []


def provenance(**machine_extra: Any) -> dict[str, Any]:
    return {"command": command(), "commit": commit(), "machine": machine(**machine_extra)}


def write_report(path: Path, report: dict[str, Any], **machine_extra: Any) -> None:
    """``report`` as JSON at ``path``, its provenance first."""
    path.parent.mkdir(parents=True, exist_ok=True)
    body = {"provenance": provenance(**machine_extra), **report}
    path.write_text(json.dumps(body, indent=1, default=float) + "\n")
