#!/usr/bin/env bash
# System services the test suite starts for real: etcd (3.4, Debian's etcd-server) and
# Prometheus (with promtool); and the tools of the multi-host test bed (tests/netbed.py):
# ip and tc (iproute2), unshare (util-linux), iptables (one-way loss). Installed with apt on
# Debian/Ubuntu when missing. Elsewhere, install etcd >= 3.4, Prometheus >= 2.40, iproute2,
# util-linux and iptables so that `etcd`, `prometheus`, `promtool`, `ip`, `tc`, `unshare`
# and `iptables` are on PATH. Under CI=true a missing tool is an error (the tests would
# fail, not skip). The bed itself needs root; without it its tests skip (fail under CI).
set -euo pipefail

need=()
command -v etcd >/dev/null 2>&1 || need+=(etcd-server)
{ command -v prometheus >/dev/null 2>&1 && command -v promtool >/dev/null 2>&1; } || need+=(prometheus)
{ command -v ip >/dev/null 2>&1 && command -v tc >/dev/null 2>&1; } || need+=(iproute2)
command -v unshare >/dev/null 2>&1 || need+=(util-linux)
command -v iptables >/dev/null 2>&1 || need+=(iptables)
[ ${#need[@]} -eq 0 ] && exit 0

if command -v apt-get >/dev/null 2>&1; then
  sudo=""
  [ "$(id -u)" -eq 0 ] || sudo="sudo"
  echo "installing ${need[*]} with apt-get"
  $sudo apt-get update -qq
  DEBIAN_FRONTEND=noninteractive $sudo apt-get install -y -qq --no-install-recommends "${need[@]}" >/dev/null
  # Debian starts no services here (and the tests start their own); stop any that did.
  for svc in etcd prometheus; do
    command -v systemctl >/dev/null 2>&1 && $sudo systemctl stop "$svc" >/dev/null 2>&1 || true
  done
else
  echo "missing: ${need[*]} — install etcd >= 3.4, Prometheus >= 2.40 (with promtool)," \
       "iproute2, util-linux and iptables" >&2
  [ "${CI:-}" = "true" ] && exit 1
fi
