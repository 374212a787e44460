#!/usr/bin/env bash
# Debian packages for `make images` and the real node: buildah and mmdebstrap (images),
# containerd, runc, the CNI plugins and iptables (the node). Installs only what is missing.
set -euo pipefail
want=(buildah mmdebstrap containerd runc containernetworking-plugins iptables)
missing=()
for pkg in "${want[@]}"; do
  dpkg-query -W -f='${Status}' "$pkg" 2>/dev/null | grep -q "install ok installed" || missing+=("$pkg")
done
if ((${#missing[@]})); then
  echo "installing: ${missing[*]}"
  SUDO=""; [ "$(id -u)" = 0 ] || SUDO=sudo
  $SUDO apt-get update -q
  DEBIAN_FRONTEND=noninteractive $SUDO apt-get install -y -q --no-install-recommends "${missing[@]}"
fi
