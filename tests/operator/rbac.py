"""The operator's ClusterRole versus the API calls it made in a recorded run (emulator call log)."""

from __future__ import annotations

from pathlib import Path

import yaml

RBAC = Path(__file__).resolve().parents[2] / "manifests" / "rbac.yaml"

# Granted but not reachable against the emulator in the pods runtime: the coordinator runtime reads a
# worker pod to learn why it exited (``KubernetesJobHandle._exit_reason``) and its coordinator pod,
# applies each job's Secret (its coordinator secret) and reads it back to re-attach to a running job
# after a restart; this test runs the pods runtime.
NOT_EXERCISED = {("get", "", "pods"), ("patch", "", "secrets"), ("create", "", "secrets"), ("get", "", "secrets")}


# A server-side apply (PATCH) of an object that does not exist yet is authorised by the API server
# as `create` (kubernetes.io/docs/reference/using-api/api-concepts/#patch-and-apply); the
# emulator only records the PATCH, so an apply of pods/services implies these grants.
APPLY_CREATES = {("patch", "", "pods"): ("create", "", "pods"), ("patch", "", "services"): ("create", "", "services"),
                 ("patch", "", "secrets"): ("create", "", "secrets")}


def granted() -> set[tuple[str, str, str]]:
    role = next(d for d in yaml.safe_load_all(RBAC.read_text()) if d and d["kind"] == "ClusterRole")
    return {(verb, group, res) for rule in role["rules"] for group in rule["apiGroups"]
            for res in rule["resources"] for verb in rule["verbs"]}


def assert_rbac_exact(calls: set[tuple[str, str, str]]) -> None:
    """Every call is granted (else the operator fails on a real cluster) and every grant is used."""
    rules = granted()
    calls = set(calls) | {APPLY_CREATES[c] for c in calls if c in APPLY_CREATES}
    missing = sorted(calls - rules)
    unused = sorted(rules - calls - NOT_EXERCISED)
    assert not missing, f"manifests/rbac.yaml lacks {missing}"
    assert not unused, f"manifests/rbac.yaml grants {unused} that the operator never used"
