#!/usr/bin/env bash
# System services the test suite starts for real: etcd (3.4, Debian's etcd-server) and
# Prometheus (with promtool). Installed with apt on Debian/Ubuntu when missing. Elsewhere,
# install etcd >= 3.4 and Prometheus >= 2.40 so that `etcd`, `prometheus` and `promtool`
# are on PATH. Under CI=true a missing tool is an error (the tests would fail, not skip).
set -euo pipefail

need=()
command -v etcd >/dev/null 2>&1 || need+=(etcd-server)
{ command -v prometheus >/dev/null 2>&1 && command -v promtool >/dev/null 2>&1; } || need+=(prometheus)
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
  echo "missing: ${need[*]} — install etcd >= 3.4 and Prometheus >= 2.40 (with promtool)" >&2
  [ "${CI:-}" = "true" ] && exit 1
fi
