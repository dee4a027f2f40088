#!/bin/sh
# The image's entrypoint. A command that starts with a flag is Locust's, as with the official Locust image
# (whose entrypoint is `locust`): Locust's Kubernetes operator sets only a container's args (`--master ...`).
# Anything else runs as given: `locust ...`, `loadlab sim ...`, `python ...` (compose and the manifests
# in deploy/k8s name the program).
case "${1:-}" in
    -*) exec locust "$@" ;;
esac
exec "$@"
