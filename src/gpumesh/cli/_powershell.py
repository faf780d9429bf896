"""PowerShell completion (Windows PowerShell 5.1 and pwsh 7), registered with
click on import: ``gpumesh`` imports it at a Tab press (``_GPUMESH_COMPLETE``
set) and ``gpumesh completion`` does, never a command that runs."""

from __future__ import annotations

import os
import re

from click.shell_completion import CompletionItem, ShellComplete, add_completion_class

__all__ = ["PowerShellComplete"]

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
