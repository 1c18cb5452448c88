#!/usr/bin/env bash
# System packages the tests use: a real Prometheus and VictoriaMetrics, a real headless Chromium (Debian
# packages), and stress-ng for the load run (scripts/stress.sh).
# Idempotent: installs only what is missing. Needs root (or sudo) and the Debian package mirrors.
set -euo pipefail

PACKAGES=(
  prometheus       # DCGM/fleet tests: a real Prometheus the tests start on 127.0.0.1 (the package's service is not used)
  victoria-metrics # fleet tests: the same query API from VictoriaMetrics (and vmalert, to check the rule group)
  chromium         # HTML report tests: a real headless browser (driven through playwright's pip package)
  chromium-driver
  stress-ng        # scripts/stress.sh: keeps every core busy while the process and signal tests run (not in CI)
)

missing=()
for pkg in "${PACKAGES[@]}"; do
  dpkg -s "$pkg" >/dev/null 2>&1 || missing+=("$pkg")
done
[ ${#missing[@]} -eq 0 ] && exit 0

SUDO=""
[ "$(id -u)" -ne 0 ] && SUDO="sudo"
export DEBIAN_FRONTEND=noninteractive
$SUDO apt-get update -q
# --no-install-recommends keeps Prometheus from pulling its node exporter and the like.
$SUDO apt-get install -y -q --no-install-recommends "${missing[@]}"
