#!/usr/bin/env bash
# The agent sandbox (asyncgrpo/sandbox, docs/harness.md "The sandbox") runs every agent and every
# piece of model-written code under bubblewrap (Debian's `bubblewrap` package, the `bwrap` binary).
# `make test` runs this first: it installs bubblewrap when it is missing and this user may install
# packages, and otherwise stops with the exact command to run.
set -euo pipefail
command -v bwrap >/dev/null && exit 0
install=(apt-get install -y -q bubblewrap)
if ! command -v apt-get >/dev/null; then
    echo "asyncgrpo's agent sandbox needs bubblewrap: install it with your system's package manager" \
        "(dnf install bubblewrap, zypper install bubblewrap, ...); its binary must be on PATH as bwrap." >&2
    exit 1
fi
if [ "$(id -u)" -eq 0 ]; then
    sudo=()
elif command -v sudo >/dev/null && sudo -n true 2>/dev/null; then
    sudo=(sudo -n)
else
    echo "asyncgrpo's agent sandbox needs bubblewrap; run once:" >&2
    echo "    sudo apt-get update && sudo ${install[*]}" >&2
    exit 1
fi
echo "Installing Debian's bubblewrap (the sandbox of agents and model-written code) ..."
"${sudo[@]}" apt-get update -q
"${sudo[@]}" "${install[@]}"
