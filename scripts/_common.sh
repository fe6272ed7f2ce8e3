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

# The by-host layout (whole hosts decode, whole hosts train): its sampler-host count comes from
# SAMPLER_HOSTS or from a `--config.mesh.sampler_hosts=N` among the trainer's arguments (EXTRA_ARGS);
# afterwards SAMPLER_HOSTS holds it (0: the per-host split) and EXTRA_ARGS passes it on exactly once.
by_host_layout() {
  local arg found=""
  for arg in "${EXTRA_ARGS[@]}"; do
    if [[ "$arg" == --config.mesh.sampler_hosts=* ]]; then
      found="${arg#*=}"
    fi
  done
  if [[ -n "$found" ]]; then
    [[ -z "${SAMPLER_HOSTS:-}" || "$SAMPLER_HOSTS" == "$found" ]] ||
      die "SAMPLER_HOSTS=$SAMPLER_HOSTS and --config.mesh.sampler_hosts=$found disagree"
    SAMPLER_HOSTS="$found"
  elif [[ -n "${SAMPLER_HOSTS:-}" && "$SAMPLER_HOSTS" != 0 ]]; then
    EXTRA_ARGS+=("--config.mesh.sampler_hosts=$SAMPLER_HOSTS")
  fi
  SAMPLER_HOSTS="${SAMPLER_HOSTS:-0}"
  [[ "$SAMPLER_HOSTS" =~ ^[0-9]+$ ]] || die "SAMPLER_HOSTS='$SAMPLER_HOSTS' is not a non-negative integer"
}

# The by-host layout's secret (tunixlike/hosts/seal.py): every host's messages are sealed with it, so
# each must read the same file, given by path (never the value on a command line). $1: what to say
# where the file must be.
require_hosts_secret() {
  ((SAMPLER_HOSTS > 0)) || return 0
  [[ -n "${TUNIXLIKE_HOSTS_SECRET_FILE:-}" ]] ||
    die "SAMPLER_HOSTS=$SAMPLER_HOSTS needs TUNIXLIKE_HOSTS_SECRET_FILE, $1, readable by you only (umask 077; head -c 32 /dev/urandom | base64 > FILE)"
}

# The roles of the by-host layout as a comment line; $1: the number of hosts, if known here. The
# program decides them the same way: the last SAMPLER_HOSTS processes decode, the others train.
print_roles() {
  local hosts="${1:-}" learners
  ((SAMPLER_HOSTS > 0)) || return 0
  if [[ -z "$hosts" ]]; then
    printf '# by-host layout: the last %d hosts decode (sampler hosts), the others train (learner hosts)\n' \
      "$SAMPLER_HOSTS"
    return 0
  fi
  learners=$((hosts - SAMPLER_HOSTS))
  ((learners >= 1)) || die "SAMPLER_HOSTS=$SAMPLER_HOSTS leaves no learner host among $hosts hosts"
  printf '# by-host layout: learner hosts %s, sampler hosts %s\n' "$(_span 0 $((learners - 1)))" \
    "$(_span "$learners" $((hosts - 1)))"
}

_span() {
  if (($1 == $2)); then printf '%d' "$1"; else printf '%d-%d' "$1" "$2"; fi
}
