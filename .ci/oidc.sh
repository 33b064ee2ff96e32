#!/usr/bin/env bash
# An OpenID provider for the tests (tests/support/oidc.py, tests/support/oidc_provider.js):
# npm's `oidc-provider` (a certified OpenID Connect provider library), installed with npm into
# the cache, never into the repository:
#   ${TORCHYARD_CI_CACHE:-${XDG_CACHE_HOME:-$HOME/.cache}/torchyard-ci}/oidc-provider-<version>
# Prints that folder (it holds node_modules/oidc-provider) as the last line of stdout
# (progress goes to stderr); a second run only prints it. Version 8 supports Node 18, 20 and 22.
#
#   --cached-only   print the folder if it is installed, else exit 3 without installing
set -euo pipefail

version=8.8.1
cache_root="${TORCHYARD_CI_CACHE:-${XDG_CACHE_HOME:-$HOME/.cache}/torchyard-ci}"
dest="$cache_root/oidc-provider-$version"

if [ -f "$dest/.complete" ]; then
    echo "$dest"
    exit 0
fi
if [ "${1:-}" = "--cached-only" ]; then
    echo "no oidc-provider installed at $dest (run .ci/oidc.sh)" >&2
    exit 3
fi
if ! command -v node >/dev/null || ! command -v npm >/dev/null; then
    echo "oidc.sh: node and npm are needed (Debian: apt-get install nodejs npm)" >&2
    exit 1
fi

mkdir -p "$cache_root"
# One install at a time; a second caller waits and then finds the result.
exec 9>"$cache_root/.oidc-provider.lock"
flock 9
if [ -f "$dest/.complete" ]; then
    echo "$dest"
    exit 0
fi
rm -rf "$dest"
mkdir -p "$dest"
echo '{"name": "torchyard-test-oidc", "private": true, "type": "module"}' >"$dest/package.json"
echo "oidc.sh: installing oidc-provider@$version" >&2
npm install --prefix "$dest" --no-audit --no-fund --omit=dev --save-exact "oidc-provider@$version" >&2
node -e 'import(process.argv[1]).then(() => {})' "$dest/node_modules/oidc-provider/lib/index.js" >&2
touch "$dest/.complete"
echo "$dest"
