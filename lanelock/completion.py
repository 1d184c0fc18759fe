"""Shell completion: `lanelock completion bash|zsh|fish` prints the script; on TAB the script asks
`lanelock completion SHELL --complete LINE` (LINE: the command line up to the cursor) and gets one
line per candidate, `TYPE<tab>VALUE<tab>EXTRA`:

- `plain`: VALUE is a word to offer, EXTRA its description (zsh and fish show it; may be empty);
- `dir` / `file`: the shell completes directories / files itself (it knows quoting, `~` and the
  trailing slash); VALUE is the partial path, EXTRA what precedes it in the shell's word
  (`--lock-dir=` in `--lock-dir=/tm`).

What is being completed is decided by click's own resolution of the command tree (the one its
stock completion runs), so subcommands and options cannot drift from the CLI.
What click cannot know is added here, by an option's metavar:

- BACKEND: the lanes that exist under the lock root (complete_backend);
- DIR: directories;
- CMD, and the COMMAND that `run` and `duel` wrap: command names from PATH (a word with a slash is
  a path); once the command is named, the words after it are its own business and complete as
  files -- as sudo, time and nice complete.

Why not click's stock scripts: they pass bash's COMP_WORDS, which bash has already split at
COMP_WORDBREAKS, so `-b localhost:80<TAB>` reached lanelock as three words; and they have no
type for command names. Why not hand-written per-shell scripts: every option would be written
three more times, and drift.
"""

from __future__ import annotations

import os
import re

SHELLS = ("bash", "zsh", "fish")

# An environment assignment before the command (`LANELOCK_DIR=/x lanelock …`), skipped.
_ASSIGNMENT = re.compile(r"[A-Za-z_][A-Za-z0-9_]*=")
# A NUL ends the line: the word it is glued to is the one under the cursor ('' after a space).
_END = "\0"


def complete_backend(ctx, param, incomplete):
    """Offer the lanes that already exist under the lock root."""
    import os

    from .lanes import name_from_stem
    from .paths import resolve_root
    from .settings import Settings

    try:
        root = resolve_root(Settings({"lock_dir": ctx.params.get("lock_dir")}))
        names = os.listdir(root.path)
    except OSError:
        return []
    lanes = {name_from_stem(name[:-5].split("~", 1)[0]) for name in names if name.endswith(".lock")}
    return sorted(lane for lane in lanes if lane and lane.startswith(incomplete))


def script(shell: str) -> str:
    """The completion script for SHELL (what completions/ holds and packages install)."""
    return _SCRIPTS[shell]


def answer(shell: str, line: str, word: str | None = None, group=None) -> str:
    """The lines the SHELL script reads for the command line LINE (up to the cursor).

    word (bash): the part of the current word that bash will replace. bash splits words at
    COMP_WORDBREAKS (`:` and `=` among them), so for `localhost:80` it replaces only `80`: the
    offered words must then lose `localhost:` too (what bash-completion's
    __ltrim_colon_completions does). group: the click group to complete for (the `lanelock`
    command running this one, when not given)."""
    args, typed = split_line(line)
    items, incomplete = completions(args, typed, group)
    lines = []
    for item in items:
        value, extra = item.value, item.help or ""
        if item.type in ("dir", "file"):
            extra = typed[:len(typed) - len(incomplete)] if typed.endswith(incomplete) else ""
            value = incomplete
        elif shell == "bash" and word is not None and incomplete.endswith(word):
            head = incomplete[:len(incomplete) - len(word)]
            if head and value.startswith(head):
                value = value[len(head):]
        lines.append(f"{item.type}\t{_one_line(value)}\t{_one_line(extra)}\n")
    return "".join(lines)


def _one_line(text: str) -> str:
    return " ".join(str(text).split("\t")).replace("\n", " ")


def split_line(line: str) -> tuple[list[str], str]:
    """The words after the program name, and the (unquoted) word under the cursor."""
    from click.shell_completion import split_arg_string

    words = split_arg_string(line + _END)
    incomplete = words.pop()[:-1] if words and words[-1].endswith(_END) else ""
    while words and _ASSIGNMENT.match(words[0]):
        words.pop(0)
    return words[1:], incomplete


def completions(args: list[str], incomplete: str, group=None):
    """(CompletionItems, the incomplete value they complete) for the words ARGS before the
    cursor and the partial word INCOMPLETE."""
    import click
    # Private to click, but the very functions its own completion runs (since 8.0): which
    # command the words reach, and which parameter the incomplete word belongs to.
    from click.shell_completion import CompletionItem, _resolve_context, _resolve_incomplete

    if group is None:   # the group whose `completion` command runs now (this module is below it)
        group = click.get_current_context().find_root().command
    ctx = _resolve_context(group, {}, "lanelock", list(args))
    wrapped = _wrapped_command(ctx.command)
    if wrapped is not None and ctx.params.get(wrapped.name):
        # `run … -- CMD ARGS`, `run … CMD ARGS`: the command is named, its words are files.
        return [CompletionItem(incomplete, type="file")], incomplete
    target, incomplete = _resolve_incomplete(ctx, list(args), incomplete)
    if isinstance(target, click.Parameter):
        if target is wrapped or target.metavar == "CMD":
            return command_names(incomplete), incomplete
        if target.metavar == "DIR":
            return [CompletionItem(incomplete, type="dir")], incomplete
        if target.metavar == "BACKEND":
            return [CompletionItem(lane) for lane in complete_backend(ctx, target, incomplete)], \
                incomplete
        if ctx.command.name == "set" and target.name == "key":
            from .settings import SETTINGS

            return [CompletionItem(name, help=setting.help) for name, setting in SETTINGS.items()
                    if name.startswith(incomplete)], incomplete
    return target.shell_complete(ctx, incomplete), incomplete


def _wrapped_command(command):
    """The COMMAND argument of a command that wraps one (run, duel), else None."""
    import click

    for param in command.params:
        if isinstance(param, click.Argument) and param.nargs == -1 and param.name == "command":
            return param
    return None


def command_names(incomplete: str):
    """Executables on PATH whose names start with INCOMPLETE (what lanelock can run: no shell
    builtins, functions or aliases); a word with a slash is a path, left to the shell."""
    from click.shell_completion import CompletionItem

    if "/" in incomplete:
        return [CompletionItem(incomplete, type="file")]
    names = set()
    for directory in os.environ.get("PATH", "").split(os.pathsep):
        if not directory:
            continue
        try:
            entries = list(os.scandir(directory))
        except OSError:
            continue
        for entry in entries:
            if entry.name in names or not entry.name.startswith(incomplete):
                continue
            try:
                if entry.is_file() and os.access(entry.path, os.X_OK):
                    names.add(entry.name)
            except OSError:
                continue
    return [CompletionItem(name) for name in sorted(names)]


# -- the scripts ---------------------------------------------------------------------------------
# Each passes the line up to the cursor and reads TYPE<tab>VALUE<tab>EXTRA lines (see above).

_BASH = r"""# bash completion for lanelock (lanelock completion bash)
_lanelock_completion() {
    local IFS=$'\n' line type value extra
    local -a reply
    COMPREPLY=()
    reply=($(lanelock completion bash --word "$2" \
                 --complete "${COMP_LINE:0:COMP_POINT}" 2>/dev/null)) || return 0
    for line in "${reply[@]}"; do
        IFS=$'\t' read -r type value extra <<< "$line"
        case $type in
            dir)   compopt -o filenames; COMPREPLY=($(compgen -d -- "$2")); return 0 ;;
            file)  compopt -o filenames; COMPREPLY=($(compgen -f -- "$2")); return 0 ;;
            plain) COMPREPLY+=("$value") ;;
        esac
    done
    return 0
}
complete -o nosort -F _lanelock_completion lanelock
"""

_ZSH = r"""#compdef lanelock
# zsh completion for lanelock (lanelock completion zsh)

_lanelock() {
    local line
    local -a reply fields plain described
    (( $+commands[lanelock] )) || return 1
    reply=("${(@f)$(lanelock completion zsh --complete "${(j: :)words[1,CURRENT]}" 2>/dev/null)}")
    for line in $reply; do
        fields=("${(@ps:\t:)line}")
        case $fields[1] in
            dir|file)
                [[ -n $fields[3] ]] && compset -P "${(b)fields[3]}"
                if [[ $fields[1] == dir ]]; then _path_files -/; else _files; fi
                return ;;
            plain)
                if [[ -n $fields[3] ]]; then
                    described+=("${fields[2]//:/\\:}:${fields[3]}")
                else
                    plain+=("$fields[2]")
                fi ;;
        esac
    done
    (( $#described )) && _describe -V unsorted described -U
    (( $#plain )) && compadd -U -V unsorted -a plain
    return 0
}

# Autoloaded from $fpath, this file is the body of _lanelock: it defines the real _lanelock (so
# the next TAB calls that) and completes this once. Sourced, it registers the function.
if [[ $zsh_eval_context[-1] == loadautofunc ]]; then
    _lanelock "$@"
else
    compdef _lanelock lanelock
fi
"""

_FISH = r"""# fish completion for lanelock (lanelock completion fish)
function __lanelock_complete
    lanelock completion fish --complete (commandline -cp) 2>/dev/null \
        | while read -l -d \t type value extra
        switch $type
            case dir
                for path in (__fish_complete_directories $value)
                    echo $extra$path
                end
            case file
                for path in (__fish_complete_path $value)
                    echo $extra$path
                end
            case plain
                if test -n "$extra"
                    printf '%s\t%s\n' $value $extra
                else
                    echo $value
                end
        end
    end
end
complete -c lanelock -f -a '(__lanelock_complete)'
"""

_SCRIPTS = {"bash": _BASH, "zsh": _ZSH, "fish": _FISH}
