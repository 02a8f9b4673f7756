#!/usr/bin/env bash
# Add a node to an mqds StatefulSet:
#   1. kubectl scale statefulset <sts> --replicas=<N+1>     the new pod <sts>-<N> starts, outside the cluster
#   2. kubectl wait until its container has started          (its startup probe: the process serves)
#   3. mqds admin join <sts>-<N> --address <its DNS name>:7101
#   4. mqds admin rebalance                                   replicas move onto it; it turns ready
# See README "Deploying".
set -euo pipefail

usage() {
    cat <<'EOF'
usage: k8s/scale-up.sh [-n NAMESPACE] [--statefulset NAME] [--replicas N] [--address HOST:PORT]
                       [--service NAME] [--cluster-domain DOMAIN] [--no-rebalance]
                       [--timeout SECONDS] [--dry-run]

Adds one mqds node: scales the StatefulSet up by one, waits for the new pod's process, joins it
to the cluster and rebalances replicas onto it.

  -n, --namespace NS       namespace of the StatefulSet (default: kubectl's current namespace)
  --statefulset NAME       the StatefulSet (default: mqds)
  --replicas N             its current replica count (default: asked from kubectl)
  --address HOST:PORT      the new node's address (default: <pod>.<service>.<namespace>.svc.<domain>:7101,
                           what the pod advertises)
  --service NAME           the headless Service (default: mqds-headless)
  --cluster-domain DOMAIN  the cluster's DNS domain (default: cluster.local)
  --no-rebalance           join only; run 'mqds admin rebalance' later
  --timeout SECONDS        how long the pod's start and each mqds command may take (default: 1800)
  --dry-run                print the commands that would run, run none (except reading the replica count)
  -h, --help               this help

Environment:
  KUBECTL   the kubectl command (default: kubectl)
  MQDS      the mqds command line run against the cluster (admin calls: export MQDS_CLUSTER_SECRET
            for it; the default runs inside the pod, which has it) (default: kubectl exec into <sts>-0)
EOF
}

namespace="" statefulset="mqds" replicas="" address="" service="mqds-headless" domain="cluster.local"
rebalance=1 timeout=1800 dry_run=0
while [[ $# -gt 0 ]]; do
    case "$1" in
        -n | --namespace) namespace="${2:?$1 needs a value}"; shift 2 ;;
        --statefulset) statefulset="${2:?$1 needs a value}"; shift 2 ;;
        --replicas) replicas="${2:?$1 needs a value}"; shift 2 ;;
        --address) address="${2:?$1 needs a value}"; shift 2 ;;
        --service) service="${2:?$1 needs a value}"; shift 2 ;;
        --cluster-domain) domain="${2:?$1 needs a value}"; shift 2 ;;
        --no-rebalance) rebalance=0; shift ;;
        --timeout) timeout="${2:?$1 needs a value}"; shift 2 ;;
        --dry-run) dry_run=1; shift ;;
        -h | --help) usage; exit 0 ;;
        *) echo "scale-up.sh: unknown argument $1 (see --help)" >&2; exit 2 ;;
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
if ! [[ "$replicas" =~ ^[0-9]+$ ]] || ((replicas < 1)); then
    echo "scale-up.sh: replica count '$replicas' is not a positive number (pass --replicas N)" >&2
    exit 2
fi
if [[ ! "$timeout" =~ ^[0-9]+$ ]]; then
    echo "scale-up.sh: --timeout '$timeout' is not a number of seconds" >&2
    exit 2
fi
node="$statefulset-$replicas"
if [[ -z "$address" ]]; then
    if [[ -z "$namespace" ]]; then
        namespace="$("${kubectl[@]}" config view --minify -o 'jsonpath={..namespace}')"
        namespace="${namespace:-default}"
    fi
    address="$node.$service.$namespace.svc.$domain:7101"
fi

if [[ -n "${MQDS:-}" ]]; then
    read -r -a mqds <<<"$MQDS"
else
    mqds=("${kubectl[@]}" exec "${ns[@]}" "$statefulset-0" -c mqds -- mqds)
fi

echo "scale-up.sh: adding node $node at $address to $statefulset ($replicas -> $((replicas + 1)) replicas)"
run "${kubectl[@]}" scale statefulset "$statefulset" "${ns[@]}" --replicas="$((replicas + 1))"
# The pod object appears shortly after the scale; 'kubectl wait' needs it to exist.
echo "+ ${kubectl[*]} get pod $node ${ns[*]}   (until the pod exists)"
if [[ "$dry_run" == 0 ]]; then
    deadline=$((SECONDS + timeout))
    until "${kubectl[@]}" get "pod/$node" "${ns[@]}" >/dev/null 2>&1; do
        if ((SECONDS > deadline)); then
            echo "scale-up.sh: pod $node did not appear within ${timeout}s" >&2
            exit 1
        fi
        sleep 2
    done
fi
run "${kubectl[@]}" wait --for=jsonpath='{.status.containerStatuses[0].started}'=true "pod/$node" "${ns[@]}" \
    --timeout="${timeout}s"
run "${mqds[@]}" admin join "$node" --address "$address" --timeout "$timeout"
if [[ "$rebalance" == 1 ]]; then
    run "${mqds[@]}" admin rebalance --timeout "$timeout"
fi
if [[ "$dry_run" == 1 ]]; then
    echo "scale-up.sh: dry run: nothing was changed"
else
    echo "scale-up.sh: $node joined the cluster"
fi
