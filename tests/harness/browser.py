"""Headless Chromium (Debian's `chromium`) for checking pages the project writes: no network, no profile."""

from __future__ import annotations

import re
import shutil
import subprocess
from dataclasses import dataclass
from pathlib import Path

# every background service off: this machine's network is closed, and a test must send nothing anywhere
FLAGS = ["--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
         "--disable-background-networking", "--disable-component-update", "--disable-sync",
         "--disable-default-apps", "--disable-extensions", "--metrics-recording-only", "--mute-audio"]


def chromium() -> str | None:
    return shutil.which("chromium") or shutil.which("chromium-browser")


@dataclass
class Rendered:
    dom: str  # the document after its scripts ran
    console: str  # what the browser logged (script errors land here)

    def script_errors(self) -> list[str]:
        trapped = re.search(r'data-script-errors="([^"]*)"', self.dom)
        uncaught = [line for line in self.console.splitlines() if "Uncaught" in line]
        return ([trapped.group(1)] if trapped else []) + uncaught


def render(page: Path, profile: Path, budget_ms: int = 15000) -> Rendered:
    """Load `page` from disk, let its scripts run for up to `budget_ms` of virtual time, and return the DOM."""
    done = subprocess.run([chromium(), *FLAGS, f"--user-data-dir={profile}", "--enable-logging=stderr", "--v=0",
                           f"--virtual-time-budget={budget_ms}", "--dump-dom", page.resolve().as_uri()],
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-3000:]
    return Rendered(done.stdout, done.stderr)


def sections(dom: str, css_class: str) -> dict[str, str]:
    """`<section class=CSS_CLASS data-chart=KEY>…` → {KEY: its inner HTML}, cut at the next such section."""
    marks = list(re.finditer(rf"<section class=\"{css_class}\" data-chart=\"([\w-]+)\">", dom))
    ends = [m.start() for m in marks[1:]] + [len(dom)]
    return {m.group(1): dom[m.end():end] for m, end in zip(marks, ends)}
