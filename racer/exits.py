"""A service that cannot start says why in one line, and the commands that start services report it
in one line.

``racer serve KIND`` that fails before it serves ends with ``racer serve KIND: REASON`` on stderr
(``racer.launch.serve``; a malformed setting: ``racer: REASON``, from ``racer.cli.main``).
``racer stack``, ``racer soak`` and the benchmarks that start services raise ``ServiceFailed``
when one exits before it serves, with the reason its output gives (``reason``), and ``racer``
prints it as ``racer: SERVICE exited before it served: REASON``, no traceback.

Standard library only: ``racer.cli`` imports it, and a health probe must not import torch.
"""

from __future__ import annotations

import json
import re
import signal

# What a service prints as its last line when it cannot start.
FATAL = re.compile(r"^racer(?: serve (?:drafter|verifier|gateway))?: (?P<reason>.+)$")
# The last line of a Python traceback: "ValueError: ...", "grpc._channel.Error", "KeyError: 'x'".
_EXCEPTION = re.compile(r"^(?:[A-Za-z_]\w*\.)*[A-Za-z_]\w*(?:Error|Exception|Exit|Interrupt|Warning)(?::\s.*)?$")


class ServiceFailed(RuntimeError):
    """``service`` exited (or never served) while a command started it: ``reason``, one line."""

    def __init__(self, service: str, reason: str, what: str = "exited before it served"):
        super().__init__(f"{service} {what}: {reason}")
        self.service = service
        self.reason = reason


def fatal_line(service: str, reason: str) -> str:
    """The line ``racer serve SERVICE`` ends with when it cannot start."""
    return f"racer serve {service}: {one_line(reason)}"


def one_line(text: str) -> str:
    """The first non-empty line of ``text`` (an exception's message may carry more)."""
    return next((line.strip() for line in str(text).splitlines() if line.strip()), "")


def reason(output: str, returncode: int | None = None) -> str:
    """Why a service exited, from its output (stderr, or its log file), last things first: the line
    it prints when it cannot start (``FATAL``); else the last ERROR or CRITICAL JSON log record (its
    message, and its exception's last line); else a traceback's last line; else its exit status."""
    lines = [line.strip() for line in output.splitlines() if line.strip()]
    for line in reversed(lines):
        m = FATAL.match(line)
        if m:
            return m["reason"]
    for line in reversed(lines):
        record = _record(line)
        if record is not None and record.get("level") in ("ERROR", "CRITICAL"):
            exc = [line.strip() for line in str(record.get("exc") or "").splitlines() if line.strip()]
            exc = exc[-1] if exc else ""
            msg = str(record.get("msg", ""))
            return f"{msg}: {exc}" if exc and msg else exc or msg
    for line in reversed(lines):
        if _EXCEPTION.match(line) and _record(line) is None:
            return line
    return status(returncode)


def status(returncode: int | None) -> str:
    """How a process ended, in words, when its output says nothing."""
    if returncode is None:
        return "no reason in its output"
    if returncode < 0:
        try:
            name = signal.Signals(-returncode).name
        except ValueError:
            name = f"signal {-returncode}"
        return f"killed by {name}, no reason in its output"
    return f"exit status {returncode}, no reason in its output"


def _record(line: str) -> dict | None:
    if not line.startswith("{"):
        return None
    try:
        record = json.loads(line)
    except ValueError:
        return None
    return record if isinstance(record, dict) else None


def wait_healthy(service, timeout: float = 300.0):
    """``service.wait_healthy(timeout)`` (a ``racer.procs.Service``), or ``ServiceFailed``: it exited
    first (with the reason its log gives), or still does not serve after ``timeout``."""
    try:
        return service.wait_healthy(timeout)
    except (RuntimeError, TimeoutError) as e:
        if service.alive():
            what = f"did not serve in {timeout:g} s"
            raise ServiceFailed(service.name, f"still running, not serving (its log: {service.log})", what) from e
        raise ServiceFailed(service.name, reason(service.log_text(), service.proc.poll())) from None
