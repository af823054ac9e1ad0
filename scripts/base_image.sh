#!/usr/bin/env bash
# Make a base image for the Dockerfile where no public image registry is reachable: Debian
# bookworm (python3 3.11 and its venv module) from a Debian package mirror, imported into the
# local Docker engine. Needs root and debootstrap (installed with apt-get when missing).
#   scripts/base_image.sh [TAG]         default tag: batchspec-base:bookworm
#   DEBIAN_MIRROR=http://... scripts/base_image.sh
# then: docker build --build-arg PYTHON_IMAGE=batchspec-base:bookworm ...
set -euo pipefail
tag="${1:-batchspec-base:bookworm}"
mirror="${DEBIAN_MIRROR:-http://deb.debian.org/debian}"
if ! command -v debootstrap >/dev/null; then
  apt-get update -qq && apt-get install -y -qq debootstrap >/dev/null
fi
root="$(mktemp -d)"
trap 'rm -rf "$root"' EXIT
echo "base_image.sh: bootstrapping Debian bookworm from $mirror" >&2
debootstrap --variant=minbase --include=python3,python3-venv,ca-certificates \
  bookworm "$root" "$mirror" >/dev/null
rm -rf "$root"/var/cache/apt/archives/*.deb "$root"/var/lib/apt/lists/*
tar -C "$root" -c . | docker import --change 'CMD ["python3"]' - "$tag" >/dev/null
echo "base_image.sh: made $tag" >&2
