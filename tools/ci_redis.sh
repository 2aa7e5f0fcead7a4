#!/usr/bin/env bash
# Make redis-server and redis-cli available for the remote tier's tests and benchmark.
# Idempotent: does nothing when redis-server is already on PATH. Installs Debian's
# redis-server package with apt otherwise, and makes sure it is NOT left running as a system
# service (the tests start their own servers on free 127.0.0.1 ports). Does not pip-install
# anything (redis-py comes with the package's dependencies).
set -euo pipefail

if command -v redis-server >/dev/null 2>&1 && command -v redis-cli >/dev/null 2>&1; then
    echo "ci_redis: $(redis-server --version)"
    exit 0
fi

SUDO=""
if [ "$(id -u)" -ne 0 ]; then
    if command -v sudo >/dev/null 2>&1; then
        SUDO="sudo"
    else
        echo "ci_redis: redis-server is missing and neither root nor sudo is available;" \
             "install the redis-server package (the remote tier's tests will be skipped)" >&2
        exit 1
    fi
fi
if ! command -v apt-get >/dev/null 2>&1; then
    echo "ci_redis: redis-server is missing and apt-get is not available;" \
         "install Redis >= 6.2 by other means (the remote tier's tests will be skipped)" >&2
    exit 1
fi

export DEBIAN_FRONTEND=noninteractive
# keep the package's service from starting where invoke-rc.d honours policy-rc.d
policy=/usr/sbin/policy-rc.d
made_policy=0
if [ ! -e "$policy" ]; then
    printf '#!/bin/sh\nexit 101\n' | $SUDO tee "$policy" >/dev/null
    $SUDO chmod 755 "$policy"
    made_policy=1
fi
cleanup() { if [ "$made_policy" = 1 ]; then $SUDO rm -f "$policy"; fi; }
trap cleanup EXIT

$SUDO apt-get update -qq
$SUDO apt-get install -y -qq --no-install-recommends redis-server redis-tools >/dev/null

# no system service: stop and disable it if a service manager started it anyway
if command -v systemctl >/dev/null 2>&1 && [ -d /run/systemd/system ]; then
    $SUDO systemctl disable --now redis-server >/dev/null 2>&1 || true
elif command -v service >/dev/null 2>&1; then
    $SUDO service redis-server stop >/dev/null 2>&1 || true
fi

echo "ci_redis: installed $(redis-server --version)"
