# shellcheck shell=bash
# Shared by the launch scripts (sourced, not run): --dry-run, command echo, usage, errors.
#
# Every command a script runs goes through `run`, which prints it first as one shell-quoted line
# ("+ gcloud ...") that can be copied and pasted; with --dry-run it only prints. So a dry run shows
# exactly what a real run would execute, and the tests check those lines.

DRY_RUN="${DRY_RUN:-0}"

# Quote one word for display: plain when safe, else single quotes; `--flag=value` keeps the flag bare.
_quote() {
  local s="$1"
  if [[ "$s" =~ ^[A-Za-z0-9_./:=@%+,-]*$ && -n "$s" ]]; then
    printf '%s' "$s"
  elif [[ "$s" =~ ^(--[A-Za-z0-9._-]+=)(.*)$ ]]; then
    printf '%s' "${BASH_REMATCH[1]}"
    _quote "${BASH_REMATCH[2]}"
  else
    printf "'%s'" "${s//\'/\'\\\'\'}"
  fi
}

# run CMD ARGS...: print the command, then execute it unless this is a dry run.
run() {
  local word line="+"
  for word in "$@"; do
    line+=" $(_quote "$word")"
  done
  printf '%s\n' "$line"
  if [[ "$DRY_RUN" != 1 ]]; then
    "$@"
  fi
}

die() {
  printf '%s: error: %s\n' "$(basename "$0")" "$*" >&2
  exit 2
}

# Prints the comment block at the top of the calling script (after the shebang, before any
# #SBATCH directives) as its help.
usage() {
  awk 'NR == 1 { next } /^#SBATCH/ || !/^#/ { exit } { sub(/^# ?/, ""); print }' "$0"
}

# The --zone / --project flags shared by every gcloud call (PROJECT empty: gcloud's default project).
gcloud_scope_flags() {
  GCLOUD_SCOPE=(--zone="$ZONE")
  if [[ -n "${PROJECT:-}" ]]; then
    GCLOUD_SCOPE+=(--project="$PROJECT")
  fi
}

# Parses the options every script accepts; anything else after `--` is left in EXTRA_ARGS.
parse_common_args() {
  EXTRA_ARGS=()
  while (($#)); do
    case "$1" in
      --dry-run) DRY_RUN=1 ;;
      -h | --help) usage; exit 0 ;;
      --) shift; EXTRA_ARGS=("$@"); break ;;
      *) die "unknown argument '$1' (see --help)" ;;
    esac
    shift
  done
}

# Fails with the variable's name when a required setting is empty.
require() {
  local name
  for name in "$@"; do
    [[ -n "${!name:-}" ]] || die "$name is not set (export $name=... or see --help)"
  done
}
