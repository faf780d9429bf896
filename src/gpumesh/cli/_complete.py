"""Shell completion: names from the local store, and the PowerShell script.

Click drives completion: the script a shell sources (``gpumesh completion
SHELL``) runs ``gpumesh`` again at each Tab press with ``_GPUMESH_COMPLETE``
set, and click asks the parameter being typed for its ``shell_complete``.
The functions here answer for peers, groups and jobs from the node's own
database (read-only, no network, see :mod:`gpumesh.store.names`); anything
in the way gives no suggestions, never an error.

Click's own PowerShell support (click 8.5 and later) is replaced by
:class:`PowerShellComplete`, so every supported click completes the same way
and the word under the cursor, not the end of the line, is completed.
"""

from __future__ import annotations

import os
import re
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING

import click
from click.shell_completion import CompletionItem, ShellComplete, add_completion_class

from gpumesh.protocol.states import JobRole

if TYPE_CHECKING:
    from gpumesh.store.names import NameHint

# The lookups (and the sqlite3 they need) are imported at a Tab press only: the
# commands that name these completers must not pay for them when they run.

__all__ = [
    "SHELLS",
    "PowerShellComplete",
    "complete_group",
    "complete_job",
    "complete_peer",
    "complete_peer_path",
    "complete_submitted_job",
]

SHELLS = ("bash", "zsh", "fish", "powershell")


def _db_path(ctx: click.Context) -> Path | None:
    from gpumesh.settings import home_dir

    home = ctx.find_root().params.get("home")
    try:
        return home_dir(home) / "gpumesh.db"
    except (RuntimeError, OSError):  # no --home, no $GPUMESH_HOME and no home directory
        return None


def _items(
    ctx: click.Context, lookup: Callable[[Path], list[NameHint]], incomplete: str
) -> list[CompletionItem]:
    db_path = _db_path(ctx)
    if db_path is None:
        return []
    return [
        CompletionItem(entry.name, help=entry.hint or None)
        for entry in lookup(db_path)
        if entry.name.startswith(incomplete)
    ]


def complete_peer(
    ctx: click.Context, param: click.Parameter, incomplete: str
) -> list[CompletionItem]:
    """Names of paired peers."""
    from gpumesh.store.names import peer_names

    return _items(ctx, peer_names, incomplete)


def complete_group(
    ctx: click.Context, param: click.Parameter, incomplete: str
) -> list[CompletionItem]:
    """Names of the groups this node created or joined."""
    from gpumesh.store.names import group_names

    return _items(ctx, group_names, incomplete)


def complete_job(
    ctx: click.Context, param: click.Parameter, incomplete: str
) -> list[CompletionItem]:
    """Ids of jobs submitted from here and hosted here, newest first."""
    from gpumesh.store.names import job_ids

    return _items(ctx, job_ids, incomplete.lower())


def complete_submitted_job(
    ctx: click.Context, param: click.Parameter, incomplete: str
) -> list[CompletionItem]:
    """Ids of jobs submitted from here, newest first."""
    from gpumesh.store.names import job_ids

    return _items(ctx, lambda db: job_ids(db, role=JobRole.SUBMITTED), incomplete.lower())


def complete_peer_path(
    ctx: click.Context, param: click.Parameter, incomplete: str
) -> list[CompletionItem]:
    """``PEER:`` for each paired peer, and local paths.

    Paths on the peer are not offered: listing them would take a connection.
    """
    if ":" in incomplete:
        return []
    local = [CompletionItem(incomplete, type="file")]
    if incomplete.startswith(("/", ".", "~")):
        return local
    from gpumesh.store.names import peer_names

    peers = _items(ctx, peer_names, incomplete)
    return [CompletionItem(f"{p.value}:", help=p.help) for p in peers] + local


# The completer PowerShell runs at a Tab press. It hands gpumesh the line up to
# the cursor (COMP_WORDS) and the word being completed (COMP_CWORD), restores
# the variables it set, and turns each answer line (type, value, help, split by
# tabs) into a completion; a "file" or "dir" answer lists matching paths.
_SOURCE_POWERSHELL = """\
Register-ArgumentCompleter -Native -CommandName %(prog_name)s -ScriptBlock {
    param($wordToComplete, $commandAst, $cursorPosition)

    $line = $commandAst.ToString()
    $upTo = $cursorPosition - $commandAst.Extent.StartOffset
    if ($upTo -lt $line.Length) { $line = $line.Substring(0, [Math]::Max($upTo, 0)) }
    $saved = @{}
    $vars = @{
        '%(complete_var)s' = 'powershell_complete'
        'COMP_WORDS' = $line
        'COMP_CWORD' = "$wordToComplete"
    }
    foreach ($name in $vars.Keys) {
        $saved[$name] = [Environment]::GetEnvironmentVariable($name)
        [Environment]::SetEnvironmentVariable($name, $vars[$name])
    }
    try {
        $response = @(& %(prog_name)s 2>$null)
    } finally {
        foreach ($name in $saved.Keys) {
            [Environment]::SetEnvironmentVariable($name, $saved[$name])
        }
    }

    foreach ($answer in $response) {
        $type, $value, $help = "$answer" -split "`t", 3
        if ($type -eq 'plain') {
            $text = $value
            if ($value -match '[\\s''"`$;,(){}@&|<>#]') {
                $text = "'" + ($value -replace "'", "''") + "'"
            }
            if (-not $help) { $help = $value }
            $kind = if ($value.StartsWith('-')) { 'ParameterName' } else { 'ParameterValue' }
            [System.Management.Automation.CompletionResult]::new($text, $value, $kind, $help)
        } elseif ($type -eq 'file' -or $type -eq 'dir') {
            $found = Get-ChildItem -Path "$value*" -Directory:($type -eq 'dir') `
                -ErrorAction SilentlyContinue
            foreach ($item in $found) {
                $kind = if ($item.PSIsContainer) { 'ProviderContainer' } else { 'ProviderItem' }
                $path = Resolve-Path -Relative -LiteralPath $item.FullName
                [System.Management.Automation.CompletionResult]::new(
                    $path, $item.Name, $kind, $item.FullName)
            }
        }
    }
}
"""

_LINE_BREAKS = re.compile(r"[\t\r\n]+")


class PowerShellComplete(ShellComplete):
    """Completion for PowerShell (Windows PowerShell 5.1 and pwsh 7).

    The protocol, set by the script above: ``COMP_WORDS`` is the command line up
    to the cursor, ``COMP_CWORD`` the word being completed (possibly empty).
    Each answer is one line: type, value and help separated by tabs.
    """

    name = "powershell"
    source_template = _SOURCE_POWERSHELL

    def get_completion_args(self) -> tuple[list[str], str]:
        from click.shell_completion import split_arg_string

        words = split_arg_string(os.environ.get("COMP_WORDS", ""))
        incomplete = os.environ.get("COMP_CWORD", "")
        if incomplete:
            incomplete = (split_arg_string(incomplete) or [""])[0]
        args = words[1:]
        # The word being completed ends the line up to the cursor: it is not a complete arg.
        if incomplete and args and args[-1] == incomplete:
            args.pop()
        return args, incomplete

    def format_completion(self, item: CompletionItem) -> str:
        value = _LINE_BREAKS.sub(" ", str(item.value))
        help_text = _LINE_BREAKS.sub(" ", item.help or "")
        return f"{item.type}\t{value}\t{help_text}"


add_completion_class(PowerShellComplete)
