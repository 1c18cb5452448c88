"""`diagnoser rules [CODE]`: the rule list, or one rule's page (like `ruff rule`)."""

from __future__ import annotations

import typer
from rich.console import Console
from rich.table import Table

from diagnoser.cli.common import handles_errors, print_json
from diagnoser.errors import InputError
from diagnoser.rules import RULES, Rule, get_rule


def rule_dict(r: Rule) -> dict[str, object]:
    return {
        "code": r.code, "name": r.name, "limiter": r.limiter.value, "summary": r.summary,
        "requires": list(r.requires), "uses": list(r.uses),
        "thresholds": {k: {"value": t.value, "meaning": t.meaning} for k, t in r.thresholds.items()},
        "detects": r.page.detects, "why": r.page.why, "fixes": r.page.fixes, "sources": r.page.sources,
    }


def rule_page(r: Rule) -> str:
    lines = [f"# {r.code} {r.name}", "", f"Limiter: {r.limiter.label}", "", r.summary, "",
             "## What it detects", r.page.detects, "", "## Why it limits throughput", r.page.why, "",
             "## Signals", "Requires: " + ", ".join(s.replace("|", " or ") for s in r.requires)]
    if r.uses:
        lines.append("Uses when present: " + ", ".join(r.uses))
    lines += ["", "## Thresholds (override in a --rules-config TOML file under [thresholds." + r.code + "])"]
    lines += [f"- {name} = {t.value:g}: {t.meaning}" for name, t in r.thresholds.items()]
    lines += ["", "## How to fix it", r.page.fixes, "", "## Sources", r.page.sources]
    return "\n".join(lines)


def register(app: typer.Typer) -> None:
    @app.command("rules")
    @handles_errors
    def rules_cmd(
        code: str = typer.Argument(None, help="A rule code (e.g. BW001) to print its page."),
        as_json: bool = typer.Option(False, "--json", help="Print as JSON."),
    ) -> None:
        """List every rule, or print one rule's page: what it detects, why it matters, how to fix it."""
        if code:
            r = get_rule(code)
            if r is None:
                raise InputError(f"no rule {code!r}; `diagnoser rules` lists them.")
            if as_json:
                print_json(rule_dict(r))
            else:
                typer.echo(rule_page(r))
            return
        if as_json:
            print_json([rule_dict(r) for r in RULES.values()])
            return
        table = Table("code", "name", "limiter", box=None, show_header=True)
        for r in RULES.values():
            table.add_row(r.code, r.name, r.limiter.value)
        Console(highlight=False).print(table)
        typer.echo(f"\n{len(RULES)} rules. `diagnoser rules CODE` prints one rule's page.")
