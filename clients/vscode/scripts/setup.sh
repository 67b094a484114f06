#!/usr/bin/env bash
# Idempotent set-up for the VS Code extension's tests (see README.md "Testing").
#  1. the extension's own deps:  npm ci (package-lock.json)          -> node_modules/
#  2. system packages:           chromium libkrb5-dev ripgrep (apt, only when missing)
#  3. the integration host:      code-server@4.99.4 in itest-host/   -> itest-host/node_modules/
#  4. the protocol client:         clients/typescript/src              -> src/sidecar-client/ (copied)
# Each step is skipped when its stamp file matches the hash of its lock file.
# Needs only the npm and apt registries; run as root on Debian 12. Exit code != 0 on any failure.
set -euo pipefail
HERE="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$HERE"
export npm_config_fund=false npm_config_audit=false npm_config_update_notifier=false

# one set-up at a time (pytest-xdist, two terminals...)
exec 9>"$HERE/.setup.lock"
flock -w 1800 9 || { echo "setup.sh: could not take $HERE/.setup.lock" >&2; exit 1; }

t0=$(date +%s)
log() { echo ">> setup.sh [+$(( $(date +%s) - t0 ))s]: $*" >&2; }
hash_of() { sha256sum "$@" | sha256sum | cut -c1-16; }
node_major=$(node -p 'process.versions.node.split(".")[0]' 2>/dev/null || echo 0)
[ "$node_major" -ge 20 ] || { echo "setup.sh: node >= 20 and npm are required (found: $(node --version 2>&1))" >&2; exit 1; }

# 1. extension dependencies
want=$(hash_of package.json package-lock.json)
if [ "$(cat node_modules/.setup-stamp 2>/dev/null || true)" != "$want" ]; then
  log "npm ci (extension)"
  npm ci --no-fund --no-audit
  echo "$want" > node_modules/.setup-stamp
else
  log "extension node_modules up to date"
fi

# 2. system packages (apt-get update only when something is missing)
missing=()
command -v chromium >/dev/null 2>&1 || missing+=(chromium)
command -v rg >/dev/null 2>&1 || missing+=(ripgrep)
dpkg -s libkrb5-dev >/dev/null 2>&1 || missing+=(libkrb5-dev)
if [ ${#missing[@]} -gt 0 ]; then
  [ "$(id -u)" = 0 ] || { echo "setup.sh: need root to apt-get install ${missing[*]}" >&2; exit 1; }
  log "apt-get install ${missing[*]}"
  export DEBIAN_FRONTEND=noninteractive
  apt-get -o DPkg::Lock::Timeout=600 update -q
  apt-get -o DPkg::Lock::Timeout=600 install -y -q --no-install-recommends "${missing[@]}"
else
  log "chromium, ripgrep, libkrb5-dev present"
fi

# 3. code-server (VS Code 1.99.3 web + node extension host) in its own folder
want=$(hash_of itest-host/package.json itest-host/package-lock.json)
if [ "$(cat itest-host/node_modules/.setup-stamp 2>/dev/null || true)" != "$want" ]; then
  # @vscode/ripgrep's postinstall downloads rg from GitHub: pre-seed its cache with Debian's rg
  T=$(node -e 'console.log(require("os").tmpdir())')
  for v in 1.15.11; do
    mkdir -p "$T/vscode-ripgrep-cache-$v"
    tar czf "$T/vscode-ripgrep-cache-$v/ripgrep-v13.0.0-10-x86_64-unknown-linux-musl.tar.gz" -C "$(dirname "$(command -v rg)")" rg
  done
  log "npm ci (itest-host: code-server, about a minute)"
  # unsafe_perm: postinstall refuses to run as root otherwise; yes: node-pty runs `npx node-gyp`;
  # nodedir: node-gyp would fetch headers from nodejs.org
  (cd itest-host && npm_config_yes=true npm_config_unsafe_perm=true npm_config_nodedir=/usr \
     npm ci --no-fund --no-audit)
  test -x itest-host/node_modules/.bin/code-server || { echo "setup.sh: code-server missing after npm ci" >&2; exit 1; }
  echo "$want" > itest-host/node_modules/.setup-stamp
else
  log "code-server up to date"
fi
# 4. the typed protocol client (clients/typescript/src) copied in for tsc: see scripts/vendor-client.mjs
node scripts/vendor-client.mjs
log "done in $(( $(date +%s) - t0 ))s"
