#!/bin/sh
# Entrypoint of the compose stack's Prometheus (docker-compose.yml; the official image and the Debian one of
# deploy/compose-test/ alike): copies this folder (mounted read-only at /etc/prometheus) to a writable one, writes
# the expected number of api replicas into the copy's replicas.yml (the recording rule tserve:replicas_expected),
# and runs Prometheus on the copy with the arguments compose passes.
#
#   TSERVE_EXPECTED_REPLICAS  the expected count, when it differs from TSERVE_REPLICAS (GPU replicas: set it to
#                             TSERVE_GPU_REPLICAS when the CPU ones are scaled to 0)
#   TSERVE_REPLICAS           else this, the api replica count of docker-compose.yml (default 2)
#   TSERVE_PROMETHEUS_SOURCE  the folder to copy (default /etc/prometheus)
#   TSERVE_PROMETHEUS_CONFIG  the writable copy (default /tmp/tserve-prometheus); --config.file points into it
#
# A change to deploy/prometheus/ takes effect with `docker compose restart prometheus` (the copy is made at start).
set -eu
source_dir=${TSERVE_PROMETHEUS_SOURCE:-/etc/prometheus}
config_dir=${TSERVE_PROMETHEUS_CONFIG:-/tmp/tserve-prometheus}
expected=${TSERVE_EXPECTED_REPLICAS:-${TSERVE_REPLICAS:-2}}
usage_error=64 config_error=65  # sysexits.h: EX_USAGE (a bad variable), EX_DATAERR (a replicas.yml it cannot edit)
case $expected in
  '' | *[!0-9]*)
    echo "entrypoint.sh: the expected replica count '$expected' (TSERVE_EXPECTED_REPLICAS, else TSERVE_REPLICAS)" \
      "is not a whole number" >&2
    exit $usage_error ;;
esac
# 09 -> 9, as PromQL and the alert's text show it (shell arithmetic would read a leading 0 as octal)
expected=$(printf '%s\n' "$expected" | sed 's/^0*\(.\)/\1/')

mkdir -p "$config_dir"
cp "$source_dir"/*.yml "$config_dir"/
sed "s/^\( *expr: \)vector([0-9]*)\$/\1vector($expected)/" "$source_dir/replicas.yml" > "$config_dir/replicas.yml"
grep -q "^ *expr: vector($expected)\$" "$config_dir/replicas.yml" || {
  echo "entrypoint.sh: $source_dir/replicas.yml has no 'expr: vector(N)' line to set the expected count in" >&2
  exit $config_error
}
echo "entrypoint.sh: expecting $expected api replicas (tserve:replicas_expected)" >&2
exec prometheus --config.file="$config_dir/prometheus.yml" "$@"
