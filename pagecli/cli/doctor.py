"""`pagecli doctor`: what this machine offers pagecli and what a run would pick, for bug reports."""

from __future__ import annotations

from typing import TYPE_CHECKING, Annotated

import typer

from pagecli.cli.app import app

if TYPE_CHECKING:
    from pagecli.doctor import DoctorReport

_MARKS = {"ok": " ", "note": "-", "problem": "!"}


@app.command()
def doctor(
    json_output: Annotated[bool, typer.Option("--json", help="Print the findings as JSON.")] = False,
    quick: Annotated[bool, typer.Option("--quick", help="Only what needs no torch: versions, CPU, caches, the "
                                                        "embedded model (GPU, kernels, default run skipped).")] = False,
) -> None:
    """Versions, GPU, CPU flags, native kernels, the backend and dtype a default run takes, caches, the
    embedded model. Exits 1 when a line points at a problem."""
    from pagecli.doctor import gather

    report = gather(quick)
    if json_output:
        typer.echo(report.to_json())
    else:
        typer.echo(render(report))
    if report.problems:
        raise typer.Exit(1)


def render(report: DoctorReport) -> str:
    """One line per finding under its section; '!' marks a problem and '-' a missing capability, each
    followed by what to do."""
    lines: list[str] = []
    section = None
    width = max((len(f.name) for f in report.findings), default=0)
    for finding in report.findings:
        if finding.section != section:
            section = finding.section
            lines.append(section)
        lines.append(f" {_MARKS.get(finding.status, ' ')} {finding.name:<{width}}  {finding.value}")
        if finding.action:
            lines.append(f"   {'':<{width}}  -> {finding.action}")
    problems = len(report.problems)
    lines.append(f"{problems} problem{'s' if problems != 1 else ''}; gathered in {report.seconds:.2f} s")
    return "\n".join(lines)
