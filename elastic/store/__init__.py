"""elastic's state store: SQLAlchemy models, repository functions, Alembic migrations.

What it is for: runtime state and history (pools, services, jobs, allocations,
decisions, reshard events, in-flight actions, audit log, leader lease) in a SQLite file
by default or PostgreSQL by URL. ``Store.from_url(url)`` connects; ``upgrade(url)``
migrates; the functions re-exported from ``repo`` read and write.

What it must not do: scheduling. Nothing here decides; it records decisions made by the
pure packages and hands state back to them.
"""

from __future__ import annotations

from elastic.store.engine import (
    DEFAULT_URL,
    LeaseLost,
    NotFound,
    Store,
    StoreConflict,
    StoreError,
    StoreUnavailable,
    mask_url,
)
from elastic.store.migrate import UpgradeResult, current_revision, head_revision, upgrade
from elastic.store.models import FINISHED, IN_FLIGHT
from elastic.store.repo import (
    ActionRecord,
    AllocationRecord,
    AuditRecord,
    DecisionRecord,
    FencedStore,
    InterventionRecord,
    JobRecord,
    LeaseRecord,
    PoolRecord,
    ReshardRecord,
    ServiceRecord,
    TableStats,
    WorkloadRecord,
    acquire_lease,
    allocation_history,
    begin_action,
    check_lease,
    clear_intervention,
    current_allocation,
    current_allocations,
    database_size,
    delete_job,
    delete_service,
    drop_expired_overrides,
    finish_action,
    finish_reshard,
    get_decision,
    get_job,
    get_pool,
    get_reshard,
    get_service,
    history_stats,
    in_flight_reshards,
    lease_holder,
    list_audit,
    list_decisions,
    list_interventions,
    list_jobs,
    list_pools,
    list_reshards,
    list_services,
    mark_reshard_running,
    open_actions,
    purge_history,
    record_audit,
    record_decision,
    release_allocation,
    release_lease,
    renew_lease,
    set_allocation,
    set_intervention,
    set_job_status,
    set_service_status,
    signing_key,
    start_reshard,
    take_lease,
    upsert_job,
    upsert_pool,
    upsert_service,
)

__all__ = [
    "FINISHED", "IN_FLIGHT", "DEFAULT_URL", "LeaseLost", "NotFound", "Store", "StoreConflict", "StoreError",
    "StoreUnavailable", "mask_url", "UpgradeResult", "current_revision", "head_revision", "upgrade", "ActionRecord",
    "AllocationRecord", "AuditRecord", "DecisionRecord", "FencedStore", "InterventionRecord", "JobRecord",
    "LeaseRecord", "PoolRecord", "ReshardRecord", "ServiceRecord", "TableStats", "WorkloadRecord", "acquire_lease",
    "allocation_history", "begin_action", "check_lease", "clear_intervention", "current_allocation",
    "current_allocations", "database_size", "delete_job", "delete_service", "drop_expired_overrides",
    "finish_action", "finish_reshard", "get_decision", "get_job", "get_pool", "get_reshard", "get_service",
    "history_stats", "in_flight_reshards", "lease_holder", "list_audit", "list_decisions", "list_interventions",
    "list_jobs", "list_pools", "list_reshards", "list_services", "mark_reshard_running", "open_actions",
    "purge_history", "record_audit", "record_decision", "release_allocation", "release_lease", "renew_lease",
    "set_allocation", "set_intervention", "set_job_status", "set_service_status", "signing_key", "start_reshard",
    "take_lease", "upsert_job", "upsert_pool", "upsert_service",
]
