#!/usr/bin/env bash
# `make images`: every image of the compose stack, built here from Debian packages and PyPI only, no image
# registry needed (tests/deploy/test_compose_stack.py runs them; .ci/run builds them before `make test`).
#
#   1. $BASE_IMAGE (tserve-base:bookworm): a Debian root filesystem made by mmdebstrap (python3, python3-venv,
#      python-is-python3, ca-certificates), imported into Docker. It carries this host's CA bundle
#      (/etc/ssl/certs/tserve-host-ca-bundle.crt) and an /etc/pip.conf that trusts it, so that pip works behind a
#      TLS-intercepting proxy as the host's does. Rebuilt only when this recipe changes (its hash is the label
#      tserve.base-recipe) or with REFRESH_BASE=1 (security updates).
#   2. on it, with `docker build --network host` (pip and apt reach the network as the host does; pip installs the
#      locked versions of requirements/serving.txt and requirements/locust.txt, with their hashes):
#      tserve:cpu (deploy/Dockerfile), tserve:locust (deploy/Dockerfile.locust), and the three images only the
#      compose test uses instead of the official ones, from Debian's packages: tserve-nginx:test,
#      tserve-prometheus:test and tserve-redis:test (deploy/compose-test/). Grafana has no Debian package: the test
#      runs without it.
#
# BASE_ONLY=1 makes the base alone (`make image-gpu` builds tserve:gpu on it: deploy/Makefile.fragment).
# Needs: root (or sudo), mmdebstrap and a running Docker daemon (Debian: apt-get install docker.io mmdebstrap).
# The API image bakes model_repository/ in: run `make repository` first when it is incomplete.
set -euo pipefail
cd "$(dirname "$0")/.."

SUITE=${DEBIAN_SUITE:-bookworm}
MIRROR=${DEBIAN_MIRROR:-http://deb.debian.org/debian}
SECURITY_MIRROR=${DEBIAN_SECURITY_MIRROR:-http://deb.debian.org/debian-security}
CA_BUNDLE=${CA_BUNDLE:-/etc/ssl/certs/ca-certificates.crt}
BASE_IMAGE=${BASE_IMAGE:-tserve-base:$SUITE}
TSERVE_IMAGE=${TSERVE_IMAGE:-tserve:cpu}
TSERVE_LOCUST_IMAGE=${TSERVE_LOCUST_IMAGE:-tserve:locust}
NGINX_TEST_IMAGE=${NGINX_TEST_IMAGE:-tserve-nginx:test}
PROMETHEUS_TEST_IMAGE=${PROMETHEUS_TEST_IMAGE:-tserve-prometheus:test}
REDIS_TEST_IMAGE=${REDIS_TEST_IMAGE:-tserve-redis:test}
export DOCKER_BUILDKIT=0   # the classic builder: BuildKit would fetch its dockerfile frontend from a registry

SUDO=$([ "$(id -u)" -eq 0 ] || echo sudo)
step() { printf '\n=== %s (%s)\n' "$1" "$(date +%T)"; }

docker version --format 'docker daemon {{.Server.Version}}' >/dev/null \
  || { echo "images.sh: no Docker daemon answers (start it: sudo dockerd, or sudo systemctl start docker)" >&2; exit 1; }
[ -r "$CA_BUNDLE" ] || { echo "images.sh: CA bundle $CA_BUNDLE not found (apt-get install ca-certificates)" >&2; exit 1; }

# --- 1. the base image -------------------------------------------------------------------------------------------
# minbase: Essential and Priority:required packages (passwd's useradd included) plus apt; no docs, man pages or
# translations. The apt lists are left out (mmdebstrap's cleanup): derived images run apt-get update.
MMDEBSTRAP=(--variant=minbase --include=python3,python3-venv,python-is-python3,ca-certificates
  --dpkgopt='path-exclude=/usr/share/man/*' --dpkgopt='path-exclude=/usr/share/locale/*'
  --dpkgopt='path-exclude=/usr/share/doc/*' --dpkgopt='path-include=/usr/share/doc/*/copyright'
  --customize-hook='cp "$TSERVE_CA_BUNDLE" "$1/etc/ssl/certs/tserve-host-ca-bundle.crt"'
  --customize-hook='printf "[global]\ncert = /etc/ssl/certs/tserve-host-ca-bundle.crt\n" > "$1/etc/pip.conf"'
  "$SUITE" - "deb $MIRROR $SUITE main" "deb $MIRROR $SUITE-updates main" "deb $SECURITY_MIRROR $SUITE-security main")
IMPORT=(--change 'ENV PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin' --change 'ENV LANG=C.UTF-8'
  --change 'CMD ["python3"]')
RECIPE=$({ printf '%s\n' "${MMDEBSTRAP[@]}" "${IMPORT[@]}"; cat "$CA_BUNDLE"; } | sha256sum | cut -c1-16)
current=$(docker image inspect --format '{{index .Config.Labels "tserve.base-recipe"}}' "$BASE_IMAGE" 2>/dev/null || true)
if [ "$current" = "$RECIPE" ] && [ "${REFRESH_BASE:-0}" = 0 ]; then
  step "base image $BASE_IMAGE: up to date (recipe $RECIPE; REFRESH_BASE=1 rebuilds it)"
else
  command -v mmdebstrap >/dev/null || { echo "images.sh: mmdebstrap not found (apt-get install mmdebstrap)" >&2; exit 1; }
  step "base image $BASE_IMAGE: mmdebstrap $SUITE (recipe $RECIPE)"
  # imported under a temporary tag, tagged only when mmdebstrap succeeded (a cut-off tar must not pass for a base)
  $SUDO env TSERVE_CA_BUNDLE="$CA_BUNDLE" mmdebstrap "${MMDEBSTRAP[@]}" \
    | docker import "${IMPORT[@]}" --change "LABEL tserve.base-recipe=$RECIPE" - "$BASE_IMAGE-partial"
  docker tag "$BASE_IMAGE-partial" "$BASE_IMAGE" && docker rmi "$BASE_IMAGE-partial" >/dev/null
fi

[ "${BASE_ONLY:-0}" = 0 ] || { step "done (BASE_ONLY=1: the base image alone)"; exit 0; }

# --- 2. the images on it -----------------------------------------------------------------------------------------
build() {  # build IMAGE DOCKERFILE [CONTEXT]: with no context the Dockerfile is sent alone (it copies nothing)
  local image=$1 dockerfile=$2 context=${3:-}
  step "$image ($dockerfile)"
  if [ -n "$context" ]; then
    docker build --network host --build-arg BASE_IMAGE="$BASE_IMAGE" -f "$dockerfile" -t "$image" "$context"
  else
    docker build --network host --build-arg BASE_IMAGE="$BASE_IMAGE" -t "$image" - < "$dockerfile"
  fi
}
build "$TSERVE_IMAGE" deploy/Dockerfile .
build "$TSERVE_LOCUST_IMAGE" deploy/Dockerfile.locust .
build "$NGINX_TEST_IMAGE" deploy/compose-test/Dockerfile.nginx
build "$PROMETHEUS_TEST_IMAGE" deploy/compose-test/Dockerfile.prometheus
build "$REDIS_TEST_IMAGE" deploy/compose-test/Dockerfile.redis

step "done"
for image in "$BASE_IMAGE" "$TSERVE_IMAGE" "$TSERVE_LOCUST_IMAGE" "$NGINX_TEST_IMAGE" "$PROMETHEUS_TEST_IMAGE" \
             "$REDIS_TEST_IMAGE"; do
  docker image inspect --format "{{.Size}} $image" "$image" | awk '{printf "%-28s %6.0f MB\n", $2, $1 / 1e6}'
done
