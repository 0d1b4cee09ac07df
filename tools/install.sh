#!/usr/bin/env bash
# What `make run` and `make test` install, one short line per step; the full output of every
# step goes to a log file that is named on screen.
#
#   tools/install.sh venv      .venv: pip, torch 2.13.0 (CPU), relaytrain with its test extras
#   tools/install.sh system    Debian packages the tests drive (chromium, postgresql), via apt-get when absent
#
# PYTHON (default python3.11) makes the venv. A step that fails prints the last lines of the log
# and exits non-zero at once.
set -euo pipefail
cd "$(dirname "$0")/.."

VENV=.venv
PYTHON=${PYTHON:-python3.11}
#: what the tests run (a command on PATH, or a path glob) -> the Debian package that provides it:
#: the browser test's chromium, and PostgreSQL's server for the Prefect-on-PostgreSQL test
#: (Debian keeps its programs in /usr/lib/postgresql/VERSION/bin, off PATH)
SYSTEM_PACKAGES=("chromium:chromium" "/usr/lib/postgresql/*/bin/initdb:postgresql")

LOG=""
started=$SECONDS

step() {  # step LABEL COMMAND...: run COMMAND with its output in $LOG, print LABEL and seconds
    local label=$1 t0=$SECONDS
    shift
    printf '  %-52s' "$label" >&2
    {
        echo "=== $label"
        echo "+ $*"
    } >>"$LOG"
    local status=0
    "$@" >>"$LOG" 2>&1 || status=$?
    if [ "$status" -eq 0 ]; then
        printf '%4d s\n' $((SECONDS - t0)) >&2
    else
        printf ' failed\n\n' >&2
        tail -n 25 "$LOG" >&2
        printf '\nrelaytrain: %s failed (exit %d); the whole output is in %s\n' \
            "$label" "$status" "$LOG" >&2
        exit "$status"
    fi
}

install_venv() {
    mkdir -p "$VENV"
    LOG=$VENV/install.log
    : >"$LOG"
    echo "relaytrain: installing into $VENV (full output: $LOG)" >&2
    if ! command -v "$PYTHON" >/dev/null; then
        echo "relaytrain: $PYTHON not found: install Python 3.11, or run make PYTHON=/path/to/python3.11" >&2
        exit 1
    fi
    [ -x "$VENV/bin/python" ] || step "python venv ($PYTHON)" "$PYTHON" -m venv "$VENV"
    step "pip" "$VENV/bin/python" -m pip install --upgrade pip
    # torch first, by exact pin, so pip takes the CPU wheel this machine kind carries.
    step "torch 2.13.0 (CPU)" "$VENV/bin/python" -m pip install "torch==2.13.0"
    step "relaytrain and its dependencies (ray, prefect, ...)" \
        "$VENV/bin/python" -m pip install -e ".[test]"
    echo "relaytrain: installed in $((SECONDS - started)) s" >&2
}

present() {  # present CHECK: CHECK is a command on PATH, or a path glob that matches a file
    if [[ "$1" == /* ]]; then
        compgen -G "$1" >/dev/null
    else
        command -v "$1" >/dev/null
    fi
}

install_system() {
    local missing=() entry
    for entry in "${SYSTEM_PACKAGES[@]}"; do
        present "${entry%%:*}" || missing+=("${entry#*:}")
    done
    [ ${#missing[@]} -eq 0 ] && return 0
    local sudo=""
    if [ "$(id -u)" -ne 0 ]; then
        if command -v sudo >/dev/null && sudo -n true 2>/dev/null; then
            sudo="sudo -n"
        else
            sudo="not allowed"
        fi
    fi
    if ! command -v apt-get >/dev/null || [ "$sudo" = "not allowed" ]; then
        echo "relaytrain: the tests need ${missing[*]} (Debian packages), and this shell cannot install them (no apt-get, or not root and no password-less sudo)." >&2
        echo "  Install them, then run make test again:  sudo apt-get install ${missing[*]}" >&2
        exit 1
    fi
    mkdir -p "$VENV"
    LOG=$VENV/install-system.log
    : >"$LOG"
    echo "relaytrain: installing ${missing[*]} with apt-get (full output: $LOG)" >&2
    step "apt-get update" $sudo apt-get update
    step "apt-get install ${missing[*]}" \
        $sudo env DEBIAN_FRONTEND=noninteractive apt-get install -y "${missing[@]}"
}

case "${1:-}" in
    venv) install_venv ;;
    system) install_system ;;
    *)
        echo "usage: tools/install.sh venv|system" >&2
        exit 2
        ;;
esac
