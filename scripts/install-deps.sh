#!/usr/bin/env bash
# Installs the Debian 12 packages decodelab builds and tests with. Idempotent; uses sudo when not root.
set -euo pipefail
SUDO=""
if [ "$(id -u)" -ne 0 ]; then SUDO="sudo"; fi
PACKAGES=(
  build-essential cmake ninja-build pkg-config git
  nlohmann-json3-dev libcpp-httplib-dev libcli11-dev libspdlog-dev libfmt-dev
  libpcre2-dev libsqlite3-dev libssl-dev libgtest-dev libgmock-dev libbenchmark-dev
  python3 python3-jinja2
  chromium  # headless check that `lab report` charts draw (tests/lab/lab_report_test.cc)
)
missing=()
for p in "${PACKAGES[@]}"; do
  dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q "install ok installed" || missing+=("$p")
done
if [ ${#missing[@]} -gt 0 ]; then
  echo "installing: ${missing[*]}"
  $SUDO apt-get update -qq
  DEBIAN_FRONTEND=noninteractive $SUDO apt-get install -y -qq "${missing[@]}"
else
  echo "all build dependencies are installed"
fi
