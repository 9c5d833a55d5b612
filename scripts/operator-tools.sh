#!/usr/bin/env bash
# Installs the operator-side checkers the tests drive (issue 14), cheaply when already present:
#   - promtool (Debian's `prometheus` package): `promtool check metrics` on a live /metrics
#   - chromium (Debian): the headless browser the /console test drives through puppeteer-core
#   - openapi-spec-validator and schemathesis (PyPI) in a venv under target/tools/venv
# Tests find them through HUBCAST_TOOLS_VENV (default target/tools/venv) and PATH.
set -euo pipefail
cd "$(dirname "$0")/.."

need_apt=()
command -v promtool >/dev/null 2>&1 || need_apt+=(prometheus)
command -v chromium >/dev/null 2>&1 || need_apt+=(chromium)
command -v python3 >/dev/null 2>&1 || need_apt+=(python3 python3-venv)
if [ ${#need_apt[@]} -gt 0 ]; then
  export DEBIAN_FRONTEND=noninteractive
  apt-get update -qq
  apt-get install -y -qq --no-install-recommends "${need_apt[@]}" >/dev/null
fi

venv="${HUBCAST_TOOLS_VENV:-target/tools/venv}"
# Reinstalled only when the pinned list changed (its copy in the venv is the stamp).
if ! cmp -s scripts/operator-tools.txt "$venv/requirements.txt"; then
  [ -x "$venv/bin/pip" ] || python3 -m venv "$venv" \
    || { apt-get install -y -qq --no-install-recommends python3-venv >/dev/null; python3 -m venv "$venv"; }
  "$venv/bin/pip" install -q --disable-pip-version-check -r scripts/operator-tools.txt
  cp scripts/operator-tools.txt "$venv/requirements.txt"
fi
