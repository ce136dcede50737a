# shellcheck shell=bash
# Sourced by scripts/demo.sh, scripts/test.sh and scripts/cluster-demo.sh (run from the
# repository root): the project venv and its installs, with one timed line per step.
#
#   venv_up                        create or reuse .venv (with $PYTHON, else the system
#                                  python3), activate it: .venv/bin first on PATH, PY set
#   install_tangram EXTRAS [REQ..] `pip install -e '.[EXTRAS]' REQ..` once per tree: skipped
#                                  when .venv already has this tree's build and these
#                                  requirements; a build that is current gets the
#                                  requirements only (the compiled core is not rebuilt)
#   pip_once LABEL PIP-ARGS..      `pip install PIP-ARGS..`, skipped when done before
#
# Why a venv: a stock Debian python3 is "externally managed" (PEP 668) and refuses pip
# installs outside one. The stamps live in .venv (tangram-install.*): `rm -rf .venv` starts over.

VENV="$PWD/.venv"
T0=$SECONDS

step() { echo "== [$((SECONDS - T0))s] $*"; }

# pip without -q but without its progress bars, its "already satisfied" lines and its
# warnings about a configured index directory that is missing: a line per package
# collected, built or installed, so a long install is visibly alive
_pip() {
  "$PY" -m pip install --disable-pip-version-check --progress-bar off "$@" 2>&1 \
    | sed -u -e '/^Requirement already satisfied/d' \
      -e "/^WARNING: Location '.*' is ignored: it is neither a file nor a directory/d" \
      -e 's/^/   /'
}

_real() { "$1" -c 'import os, sys; print(os.path.realpath(sys.executable))' 2>/dev/null; }

venv_up() {
  local base="${PYTHON:-python3}" made="" reuse=""
  if [[ -x "$VENV/bin/python" ]] && "$VENV/bin/python" -c 'import pip' 2>/dev/null; then
    reuse=1
    made=$(sed -n 's/^executable *= *//p' "$VENV/pyvenv.cfg" 2>/dev/null || true)
    if [[ -n "${PYTHON:-}" && -n "$made" && "$(_real "$PYTHON")" != "$(realpath "$made")" ]]; then
      step "PYTHON=$PYTHON, but .venv was made with $made: making it again"
      reuse=""
    fi
  fi
  if [[ -n "$reuse" ]]; then
    step "using the project venv .venv ($("$VENV/bin/python" -V 2>&1), made with ${made:-?})"
  else
    if ! command -v "$base" >/dev/null 2>&1; then
      echo "error: no $base to make the venv with: install python3 (3.10 or newer) or set PYTHON" >&2
      exit 1
    fi
    step "creating the project venv .venv with $base ($(command -v "$base"), $("$base" -V 2>&1))"
    rm -rf "$VENV"
    if ! "$base" -m venv "$VENV" >/dev/null 2>&1; then
      # Debian ships venv's ensurepip separately (python3-venv)
      rm -rf "$VENV"
      if [[ $(id -u) == 0 ]] && command -v apt-get >/dev/null 2>&1; then
        local pkg
        pkg="python$("$base" -c 'import sys; print("%d.%d" % sys.version_info[:2])')-venv"
        step "installing $pkg (apt-get): $base -m venv needs it"
        apt-get update -q
        DEBIAN_FRONTEND=noninteractive apt-get install -y -q python3-venv "$pkg"
        "$base" -m venv "$VENV"
      else
        echo "error: $base -m venv failed: install python3-venv (Debian: apt-get install" \
          "python3-venv) or set PYTHON to a Python that can make a venv" >&2
        "$base" -m venv "$VENV"  # shows why
        exit 1
      fi
    fi
  fi
  # shellcheck disable=SC1091
  . "$VENV/bin/activate"  # .venv/bin first on PATH: tests find its tangramd/tangramctl
  PY="$VENV/bin/python"
}

# What the build depends on: the build's inputs, this tree's place, the built files
_build_digest() {
  {
    echo "$PWD"
    "$PY" -V
    cat setup.py pyproject.toml tangram/_native.py tangramd/backends/_lodger.c
    cat tangram/model.py tangram/sched/*.py tangram/pools/*.py
    find tangram tangramd -name '*.so' -printf '%p %s %T@\n' | sort
  } 2>&1 | sha256sum | cut -d' ' -f1
}

_key() { printf '%s\n' "$@" | cat - pyproject.toml | sha256sum | cut -d' ' -f1; }

_installed_here() {  # the venv imports tangram from this tree (an editable install of it)
  [[ "$("$PY" -c 'import tangram, os; print(os.path.dirname(os.path.dirname(tangram.__file__)))' \
    2>/dev/null)" == "$PWD" ]]
}

install_tangram() {
  local extras="$1"
  shift
  local build key target="."
  [[ -n "$extras" ]] && target=".[$extras]"
  build=$(_build_digest)
  key=$(_key "$extras" "$@")
  if [[ "$(cat "$VENV/tangram-install.build" 2>/dev/null)" == "$build" ]] && _installed_here; then
    if grep -qxF "$key" "$VENV/tangram-install.done" 2>/dev/null; then
      step "arl-tangram${extras:+[$extras]} is installed in .venv and its build is current: nothing to install"
      return
    fi
    local reqs
    # the extras' requirements from pyproject.toml, without reinstalling (rebuilding) the package
    if reqs=$("$PY" - "$extras" <<'EOF'
import sys, tomllib
extras = [e for e in sys.argv[1].split(",") if e]
meta = tomllib.load(open("pyproject.toml", "rb"))["project"]
print("\n".join(r for e in extras for r in meta["optional-dependencies"][e]))
EOF
    ); then
      local -a req_list=()
      [[ -n "$reqs" ]] && mapfile -t req_list <<<"$reqs"
      if ((${#req_list[@]} + $# == 0)); then
        step "arl-tangram is installed in .venv and its build is current: nothing to install"
        return
      fi
      step "installing the requirements of [$extras]${*:+ and $*} into .venv (arl-tangram's build is current: not rebuilt)"
      _pip "${req_list[@]}" "$@"
      echo "$key" >>"$VENV/tangram-install.done"
      return
    fi
  fi
  if command -v cc >/dev/null 2>&1; then
    step "installing arl-tangram${extras:+[$extras]}${*:+ with $*} into .venv (editable; mypyc compiles the scheduling core: 1-2 min on 2 cores)"
  else
    step "installing arl-tangram${extras:+[$extras]}${*:+ with $*} into .venv (editable; no C compiler: the core stays interpreted)"
  fi
  _pip -e "$target" "$@"
  _build_digest >"$VENV/tangram-install.build"
  echo "$key" >>"$VENV/tangram-install.done"
}

pip_once() {
  local label="$1"
  shift
  local key
  key=$(_key "$@")
  if grep -qxF "$key" "$VENV/tangram-install.done" 2>/dev/null; then
    step "$label: installed in .venv already"
    return
  fi
  step "installing $label into .venv"
  _pip "$@"
  echo "$key" >>"$VENV/tangram-install.done"
}
