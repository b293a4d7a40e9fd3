#!/usr/bin/env bash
# System packages the test suite needs (none yet beyond Python; etcd and Prometheus come
# with the issues that test against them). Kept as the one place `make test` installs from.
set -euo pipefail
exit 0
