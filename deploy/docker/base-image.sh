#!/usr/bin/env bash
# A local Python base image for machines that reach a Debian mirror but no image registry:
#   deploy/docker/base-image.sh [IMAGE]     (default local/python:3.11; about 90 s)
# Debian bookworm's minimal root filesystem (debootstrap --variant=minbase) with python3 and
# python3-venv, imported as IMAGE. Then: make image BASE=local/python:3.11. Needs root,
# debootstrap and a Docker engine; does nothing when IMAGE exists already.
set -euo pipefail
IMAGE="${1:-local/python:3.11}"
MIRROR="${DEBIAN_MIRROR:-http://deb.debian.org/debian}"
DOCKER="${DOCKER:-docker}"
if "$DOCKER" image inspect "$IMAGE" >/dev/null 2>&1; then
  echo "$IMAGE exists"
  exit 0
fi
ROOTFS="$(mktemp -d)"
trap 'rm -rf "$ROOTFS"' EXIT
debootstrap --variant=minbase --include=python3,python3-venv bookworm "$ROOTFS" "$MIRROR" >/dev/null
rm -rf "$ROOTFS"/var/cache/apt/archives/*.deb "$ROOTFS"/var/lib/apt/lists/*
tar -C "$ROOTFS" -c . | "$DOCKER" import - "$IMAGE" >/dev/null
echo "$IMAGE built"
