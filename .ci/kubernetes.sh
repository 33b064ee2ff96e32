#!/usr/bin/env bash
# A Kubernetes 1.20.2 control plane for the tests (tests/support/kube_cluster.py), built from
# Debian's source package `kubernetes` (the whole tree, dependencies vendored) with Debian's
# Go 1.19, plus Debian's etcd 3.4. Nothing is installed on the system: the packages are
# downloaded with a private apt state and unpacked into the cache.
#
# Prints the directory holding kube-apiserver, kube-scheduler, kube-controller-manager and
# etcd as the last line of stdout (progress goes to stderr). The result is cached under
#   ${TORCHYARD_CI_CACHE:-${XDG_CACHE_HOME:-$HOME/.cache}/torchyard-ci}/kubernetes-1.20.2-<hash of this script>/bin
# and a second run only prints that path. A cold build takes about a quarter of an hour on
# two loaded cores; the Go build cache is kept beside it, so a rebuild (a changed script)
# takes a few minutes.
#
#   --cached-only   print the directory if it is built, else exit 3 without building
set -euo pipefail

version=1.20.2
cache_root="${TORCHYARD_CI_CACHE:-${XDG_CACHE_HOME:-$HOME/.cache}/torchyard-ci}"
key="$(sha256sum "${BASH_SOURCE[0]}" | cut -c1-16)"
dest="$cache_root/kubernetes-$version-$key"

if [ -f "$dest/.complete" ]; then
    echo "$dest/bin"
    exit 0
fi
if [ "${1:-}" = "--cached-only" ]; then
    echo "no complete Kubernetes build at $dest (run .ci/kubernetes.sh to build it)" >&2
    exit 3
fi

log() { echo "kubernetes.sh: $*" >&2; }

mkdir -p "$cache_root"
# One build at a time; a second caller waits and then finds the result.
exec 9>"$cache_root/.kubernetes.lock"
flock 9
if [ -f "$dest/.complete" ]; then
    echo "$dest/bin"
    exit 0
fi

start=$(date +%s)
work="$(mktemp -d "$cache_root/kubernetes-build.XXXXXX")"
trap 'rm -rf "$work"' EXIT
log "building Kubernetes $version in $work"

# --- the packages: Debian's source of kubernetes, Go 1.19, etcd, reflect2 1.0.2 -----------
# A private apt state (lists, caches) with the system's Debian sources, as deb and deb-src;
# the system's apt configuration and state are not touched.
downloads="$cache_root/kubernetes-downloads"
mkdir -p "$downloads"
apt_dir="$work/apt"
mkdir -p "$apt_dir/lists/partial" "$apt_dir/cache/archives/partial" "$apt_dir/sources.list.d"
for f in /etc/apt/sources.list.d/*.sources; do
    [ -f "$f" ] || continue
    # deb822 stanzas of Debian's archive only (third-party repositories rarely serve deb-src).
    awk 'BEGIN { RS = ""; ORS = "\n\n" }
         /URIs:[^\n]*debian/ && !/Enabled: *no/ { sub(/Types: *deb( deb-src)?/, "Types: deb deb-src"); print }' \
        "$f" >"$apt_dir/sources.list.d/$(basename "$f")"
done
: >"$apt_dir/sources.list"
if [ -f /etc/apt/sources.list ]; then
    grep -E '^deb .*debian' /etc/apt/sources.list | sed -e 'p' -e 's/^deb /deb-src /' >"$apt_dir/sources.list" || true
fi
apt_opts=(
    -o "Dir::Etc::SourceList=$apt_dir/sources.list"
    -o "Dir::Etc::SourceParts=$apt_dir/sources.list.d"
    -o "Dir::State::Lists=$apt_dir/lists"
    -o "Dir::Cache=$apt_dir/cache"
    -o "Debug::NoLocking=1"
    -o "APT::Sandbox::User=root"
)
packages=(etcd-server golang-1.19-go golang-1.19-src golang-github-modern-go-reflect2-dev)
have_downloads() {
    local p
    ls "$downloads"/kubernetes_*.dsc >/dev/null 2>&1 || return 1
    for p in "${packages[@]}"; do
        ls "$downloads/${p}"_*.deb >/dev/null 2>&1 || return 1
    done
}
if ! have_downloads; then
    log "downloading the packages (private apt lists)"
    apt-get "${apt_opts[@]}" update -qq >&2
    mkdir -p "$work/dl"
    (
        cd "$work/dl"
        apt-get "${apt_opts[@]}" source --download-only -qq "kubernetes" >&2
        apt-get "${apt_opts[@]}" download -qq "${packages[@]}" >&2
    )
    mv -f "$work/dl"/* "$downloads/"
fi

log "unpacking"
tools="$work/tools"
mkdir -p "$tools"
for p in "${packages[@]}"; do
    deb="$(ls -1 "$downloads/${p}"_*.deb | tail -n 1)"
    dpkg-deb -x "$deb" "$tools"
done
export GOROOT="$tools/usr/lib/go-1.19"
# golang-1.19-go links src/ to golang-1.19-src's tree; both are unpacked into $tools.
[ -e "$GOROOT/src/runtime" ] || { log "Go's source tree is missing under $GOROOT/src"; exit 1; }
export PATH="$GOROOT/bin:$PATH"

export GOPATH="$work/gopath"
k8s="$GOPATH/src/k8s.io/kubernetes"
mkdir -p "$k8s"
dsc="$(ls -1 "$downloads"/kubernetes_*.dsc | tail -n 1)"
orig="$(ls -1 "$downloads"/kubernetes_*.orig.tar.* | tail -n 1)"
log "source: $(basename "$dsc") (the upstream tree, vendor/ included)"
# Debian's own patches (debian/patches) change kubectl only, which is not built here.
tar -xf "$orig" -C "$k8s" --strip-components=1
[ -f "$k8s/cmd/kube-apiserver/apiserver.go" ] || { log "unexpected source layout in $orig"; exit 1; }

# reflect2 1.0.1 (vendored) reads Go's runtime internals that changed in Go 1.18: the
# apiserver then dies with "fatal error: fault". Debian's 1.0.2 is the fixed release.
rm -rf "$k8s/vendor/github.com/modern-go/reflect2"
cp -r "$tools/usr/share/gocode/src/github.com/modern-go/reflect2" "$k8s/vendor/github.com/modern-go/reflect2"

# --- build -----------------------------------------------------------------------------
export GO111MODULE=off GOFLAGS= GOPROXY=off CGO_ENABLED=0
# The Go build cache outlives this script's versions. -trimpath keeps the temporary
# GOPATH out of the cache keys, so a rebuild in another temporary directory is warm.
export GOCACHE="$cache_root/kubernetes-go-cache"
cd "$k8s"

log "generating pkg/generated/openapi (openapi-gen over the +k8s:openapi-gen packages)"
go build -trimpath -o "$work/openapi-gen" ./vendor/k8s.io/kube-openapi/cmd/openapi-gen
# The packages tagged for OpenAPI, as import paths: the staging repositories under
# k8s.io/kubernetes/vendor, as upstream's Makefile.generated_files passes them.
openapi_dirs="$(
    {
        grep -rl --include='*.go' '^// *+k8s:openapi-gen=' pkg cmd plugin | sed 's|^|k8s.io/kubernetes/|'
        (cd staging/src && grep -rl --include='*.go' '^// *+k8s:openapi-gen=' k8s.io) \
            | sed 's|^|k8s.io/kubernetes/vendor/|'
    } | xargs -r -n1 dirname | grep -v -e '/_' -e '/testdata' | LC_ALL=C sort -u | paste -sd, -
)"
"$work/openapi-gen" \
    --input-dirs "$openapi_dirs" \
    --output-package k8s.io/kubernetes/pkg/generated/openapi \
    --output-file-base zz_generated.openapi \
    --output-base "$GOPATH/src" \
    --go-header-file hack/boilerplate/boilerplate.generatego.txt \
    --report-filename "$work/openapi-violations.txt" >&2
[ -f pkg/generated/openapi/zz_generated.openapi.go ] || { log "openapi-gen wrote nothing"; exit 1; }

ver_pkg=k8s.io/kubernetes/vendor/k8s.io/component-base/version
ldflags="-s -w -X $ver_pkg.gitVersion=v$version -X $ver_pkg.gitMajor=1 -X $ver_pkg.gitMinor=20"
ldflags+=" -X $ver_pkg.gitTreeState=clean -X $ver_pkg.buildDate=1970-01-01T00:00:00Z"
out="$work/out"
mkdir -p "$out/bin"
for cmd in kube-apiserver kube-scheduler kube-controller-manager; do
    log "go build $cmd"
    go build -trimpath -ldflags "$ldflags" -o "$out/bin/$cmd" "./cmd/$cmd"
done
cp "$tools/usr/bin/etcd" "$out/bin/etcd"
"$out/bin/kube-apiserver" --version >&2
"$out/bin/etcd" --version >&2

# --- publish atomically ------------------------------------------------------------------
touch "$out/.complete"
rm -rf "$dest"
mv "$out" "$dest"
# Keep the newest few builds of other script versions.
ls -1dt "$cache_root"/kubernetes-"$version"-* 2>/dev/null | tail -n +4 | xargs -r rm -rf || true
log "built in $(($(date +%s) - start)) s"
echo "$dest/bin"
