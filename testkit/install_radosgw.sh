#!/usr/bin/env bash
# Install Ceph radosgw + one mon + one OSD (Debian/Ubuntu packages) for testkit/radosgw.py.
#
# Idempotent: returns at once when the binaries are already there. Needs root
# (or sudo). Installs with --no-install-recommends; no service is started or
# configured: testkit/radosgw.py runs its own private cluster on 127.0.0.1.
#
# Measured on Debian 12 (2 cores, package lists fresh): 19 s, 64 packages (Ceph
# 16.2.15), 66 MB download, 257 MiB installed (+66 MB of .debs in the apt cache);
# 0.01 s when already installed.
set -euo pipefail

PACKAGES=(radosgw ceph-mon ceph-osd ceph-common)
BINARIES=(ceph-mon ceph-osd radosgw radosgw-admin ceph monmaptool)

have_all() {
    local b
    for b in "${BINARIES[@]}"; do
        command -v "$b" >/dev/null 2>&1 || [ -x "/usr/bin/$b" ] || return 1
    done
}

if have_all; then
    echo "radosgw already installed: $(command -v radosgw || echo /usr/bin/radosgw)"
    exit 0
fi

if [ "$(id -u)" -eq 0 ]; then
    SUDO=()
elif command -v sudo >/dev/null 2>&1; then
    SUDO=(sudo)
else
    echo "install_radosgw.sh: needs root or sudo for apt-get" >&2
    exit 1
fi

# Keep package scripts from starting Ceph services on a host with an init
# system (policy-rc.d is honoured by invoke-rc.d and deb-systemd-invoke).
# An existing policy (Docker images ship one) is left alone.
POLICY=/usr/sbin/policy-rc.d
if [ ! -e "$POLICY" ]; then
    "${SUDO[@]}" sh -c "printf '#!/bin/sh\nexit 101\n' > $POLICY && chmod 755 $POLICY"
    trap '"${SUDO[@]}" rm -f "$POLICY"' EXIT
fi

apt_install() {
    "${SUDO[@]}" env DEBIAN_FRONTEND=noninteractive \
        apt-get install -y -q --no-install-recommends "${PACKAGES[@]}"
}
# Try with the current package lists first (fast); refresh them only on failure.
if ! apt_install; then
    "${SUDO[@]}" apt-get update -q
    apt_install
fi

have_all || { echo "install_radosgw.sh: binaries still missing after install" >&2; exit 1; }
echo "radosgw installed: $(radosgw --version 2>/dev/null | head -n1)"
