#!/usr/bin/env bash
# Remove the highest-ordinal node of an mqds StatefulSet without losing a replica:
#   1. mqds admin leave <sts>-<N-1>      every replica moves to the other nodes first; returns when done
#   2. kubectl scale statefulset <sts> --replicas=<N-1>
#   3. kubectl wait --for=delete pod/<sts>-<N-1>
#   4. kubectl delete pvc data-<sts>-<N-1>   the departed node's data (unless --keep-pvc)
# A failed leave stops the script before anything is scaled. See README "Deploying".
set -euo pipefail

usage() {
    cat <<'EOF'
usage: k8s/scale-down.sh [-n NAMESPACE] [--statefulset NAME] [--replicas N] [--keep-pvc]
                         [--timeout SECONDS] [--dry-run]

Removes the highest-ordinal mqds node: 'mqds admin leave' moves its replicas away, then the
StatefulSet is scaled down by one and the node's PersistentVolumeClaim is deleted.

  -n, --namespace NS    namespace of the StatefulSet (default: kubectl's current namespace)
  --statefulset NAME    the StatefulSet (default: mqds)
  --replicas N          its current replica count (default: asked from kubectl)
  --keep-pvc            keep the departed node's PersistentVolumeClaim
  --timeout SECONDS     how long the leave and the pod's termination may take (default: 1800)
  --dry-run             print the commands that would run, run none (except reading the replica count)
  -h, --help            this help

Environment:
  KUBECTL   the kubectl command (default: kubectl), e.g. "kubectl --context prod"
  MQDS      the mqds command line run against the cluster (admin calls: export MQDS_CLUSTER_SECRET
            for it; the default runs inside the pod, which has it) (default: kubectl exec into <sts>-0,
            "mqds" there talks to its own node); e.g. "mqds --endpoints HOST:PORT --tls-ca ca.pem"
EOF
}

namespace="" statefulset="mqds" replicas="" keep_pvc=0 timeout=1800 dry_run=0
while [[ $# -gt 0 ]]; do
    case "$1" in
        -n | --namespace) namespace="${2:?$1 needs a value}"; shift 2 ;;
        --statefulset) statefulset="${2:?$1 needs a value}"; shift 2 ;;
        --replicas) replicas="${2:?$1 needs a value}"; shift 2 ;;
        --keep-pvc) keep_pvc=1; shift ;;
        --timeout) timeout="${2:?$1 needs a value}"; shift 2 ;;
        --dry-run) dry_run=1; shift ;;
        -h | --help) usage; exit 0 ;;
        *) echo "scale-down.sh: unknown argument $1 (see --help)" >&2; exit 2 ;;
    esac
done

read -r -a kubectl <<<"${KUBECTL:-kubectl}"
ns=()
[[ -n "$namespace" ]] && ns=(-n "$namespace")

run() {
    echo "+ $*"
    [[ "$dry_run" == 1 ]] || "$@"
}

if [[ -z "$replicas" ]]; then
    replicas="$("${kubectl[@]}" get statefulset "$statefulset" "${ns[@]}" -o 'jsonpath={.spec.replicas}')"
fi
if ! [[ "$replicas" =~ ^[0-9]+$ ]]; then
    echo "scale-down.sh: replica count '$replicas' is not a number (pass --replicas N)" >&2
    exit 2
fi
if [[ ! "$timeout" =~ ^[0-9]+$ ]]; then
    echo "scale-down.sh: --timeout '$timeout' is not a number of seconds" >&2
    exit 2
fi
target=$((replicas - 1))
if ((target < 1)); then
    echo "scale-down.sh: $statefulset has $replicas replica(s); refusing to remove the last node" >&2
    exit 2
fi
node="$statefulset-$target"

if [[ -n "${MQDS:-}" ]]; then
    read -r -a mqds <<<"$MQDS"
else
    mqds=("${kubectl[@]}" exec "${ns[@]}" "$statefulset-0" -c mqds -- mqds)
fi

echo "scale-down.sh: removing node $node from $statefulset ($replicas -> $target replicas)"
if ! run "${mqds[@]}" admin leave "$node" --timeout "$timeout"; then
    echo "scale-down.sh: 'mqds admin leave $node' failed; nothing was scaled" >&2
    exit 1
fi
run "${kubectl[@]}" scale statefulset "$statefulset" "${ns[@]}" --replicas="$target"
run "${kubectl[@]}" wait --for=delete "pod/$node" "${ns[@]}" --timeout="${timeout}s"
if [[ "$keep_pvc" == 0 ]]; then
    run "${kubectl[@]}" delete pvc "data-$node" "${ns[@]}"
fi
if [[ "$dry_run" == 1 ]]; then
    echo "scale-down.sh: dry run: nothing was changed"
else
    echo "scale-down.sh: $statefulset has $target replicas; $node left the cluster"
fi
