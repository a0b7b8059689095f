"""The configuration reference (``docs/serving/configuration.md``), written from the settings table
(``common/settings.py``), the one place a setting's flag, variable, default and help are written.

``python -m racer.settings_doc`` writes it; ``--check`` fails when the file differs from what the
table gives (a test runs it), so the reference cannot drift from what the services read.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from common import settings

OUT = Path(__file__).resolve().parent.parent / "docs" / "serving" / "configuration.md"

HEAD = """# Configuration reference

Every setting of `racer serve drafter|verifier|gateway`, as a flag or a `RACER_*` environment
variable (a flag wins; a value that does not parse stops the service with one line naming it).
The commands that share a flag with a service (`racer stack --dtype`, `racer soak --model`,
`racer bench --threads`, ...) read its variable the same way. Written from the settings table,
`common/settings.py` (`python -m racer.settings_doc`); a test fails when this page and the table
differ. Deployment files name the same variables, and tests compare them with the table too.
"""


def _default(s: settings.Setting) -> str:
    if s.default == "" or s.default is None:
        return "(empty)"
    if isinstance(s.default, bool):
        return "true" if s.default else "false"
    return f"`{s.default}`"


def _row(s: settings.Setting) -> str:
    help_text = s.help.replace("|", "\\|")
    if s.choices:
        help_text += f" (one of {', '.join(f'`{c}`' for c in s.choices)})"
    old = [*s.old_flags, *s.old_envs]
    if old:
        help_text += f"; formerly {', '.join(f'`{o}`' for o in old)}"
    return f"| `{s.flag}` | `{s.env}` | {_default(s)} | {help_text} |"


def render() -> str:
    out = [HEAD]
    table = "| flag | variable | default | what |\n|---|---|---|---|\n"
    out.append("## Every service\n")
    out.append(table + "\n".join(_row(s) for s in settings.COMMON) + "\n")
    for service in ("gateway", "drafter", "verifier"):
        out.append(f"## {service}\n")
        rows = [*settings.SERVICE[service], *settings.port_settings(service)]
        out.append(table + "\n".join(_row(s) for s in rows) + "\n")
    return "\n".join(out)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--check", action="store_true", help="fail if the file differs from the table")
    args = ap.parse_args(argv)
    text = render()
    if args.check:
        if not OUT.exists() or OUT.read_text() != text:
            print(f"{OUT} is stale: run python -m racer.settings_doc", file=sys.stderr)
            return 1
        return 0
    OUT.write_text(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
