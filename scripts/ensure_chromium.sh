#!/usr/bin/env bash
# The report tests open report.html in headless Chromium (Debian's `chromium` package). `make test`
# runs this first: it installs Chromium when it is missing and this user may install packages, and
# otherwise stops with the exact command to run.
set -euo pipefail
for name in chromium chromium-browser google-chrome; do
    command -v "$name" >/dev/null && exit 0
done
install=(apt-get install -y -q chromium)
if ! command -v apt-get >/dev/null; then
    echo "make test needs headless Chromium for tests/unit/test_report.py: install Chromium with your" \
        "system's package manager (its binary must be on PATH as chromium)." >&2
    exit 1
fi
if [ "$(id -u)" -eq 0 ]; then
    sudo=()
elif command -v sudo >/dev/null && sudo -n true 2>/dev/null; then
    sudo=(sudo -n)
else
    echo "make test needs headless Chromium for tests/unit/test_report.py; run once:" >&2
    echo "    sudo apt-get update && sudo ${install[*]}" >&2
    exit 1
fi
echo "Installing Debian's chromium (headless browser for tests/unit/test_report.py) ..."
"${sudo[@]}" apt-get update -q
"${sudo[@]}" "${install[@]}"
