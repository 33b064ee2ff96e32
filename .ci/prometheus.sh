#!/usr/bin/env bash
# Prometheus for the tests (tests/service/test_prometheus.py): Debian's `prometheus` package,
# downloaded with `apt-get download` (the system's apt sources; nothing is installed on the
# system) and unpacked with `dpkg-deb -x` into the cache:
#   ${TORCHYARD_CI_CACHE:-${XDG_CACHE_HOME:-$HOME/.cache}/torchyard-ci}/prometheus-<version>
# Prints the path of the `prometheus` binary as the last line of stdout (progress goes to
# stderr); a second run only prints it.
#
#   --cached-only   print the path if it is unpacked, else exit 3 without downloading
set -euo pipefail

cache_root="${TORCHYARD_CI_CACHE:-${XDG_CACHE_HOME:-$HOME/.cache}/torchyard-ci}"
found() {
    local bin
    for bin in "$cache_root"/prometheus-*/usr/bin/prometheus; do
        if [ -x "$bin" ] && [ -f "${bin%/usr/bin/prometheus}/.complete" ]; then
            echo "$bin"
            return 0
        fi
    done
    return 1
}
if found; then
    exit 0
fi
if [ "${1:-}" = "--cached-only" ]; then
    echo "no Prometheus unpacked under $cache_root (run .ci/prometheus.sh)" >&2
    exit 3
fi

mkdir -p "$cache_root"
# One download at a time; a second caller waits and then finds the result.
exec 9>"$cache_root/.prometheus.lock"
flock 9
if found; then
    exit 0
fi
work="$(mktemp -d "$cache_root/prometheus-download.XXXXXX")"
trap 'rm -rf "$work"' EXIT
echo "prometheus.sh: downloading Debian's prometheus package" >&2
# apt-get download writes into the current directory; a private lists folder is not needed
# (the system's lists name the package), and nothing is installed.
(cd "$work" && { apt-get download prometheus >&2 2>&1 || { apt-get update -qq >&2 && apt-get download prometheus >&2; }; })
deb="$(ls "$work"/prometheus_*.deb | head -n 1)"
version="$(dpkg-deb -f "$deb" Version | tr -c 'A-Za-z0-9.+\n-' '_')"
dest="$cache_root/prometheus-$version"
rm -rf "$dest"
dpkg-deb -x "$deb" "$dest"
"$dest/usr/bin/prometheus" --version >&2
touch "$dest/.complete"
echo "$dest/usr/bin/prometheus"
