"""The controller loop: observe -> decide -> apply -> record, one pool, one leader.

One ``tick()`` reads as numbered steps (Kueue's scheduler, Kopf's collected effects):

0. lead      hold the pool's DB lease; a controller without it does nothing. While the tick
             works a background thread renews it (every third of the lease), and every
             backend action and every DB write of the tick is fenced: it goes ahead only while
             the lease is still this controller's at the epoch it took (the DB refuses a write
             with a stale epoch in the same transaction; locally, a lease not renewed in time
             stops the tick before its next action). A leader that lost its lease stops
             mid-tick, stands by and recovers from the DB when it leads again.
1. observe   backend inventory, what each workload holds, each service's metric, job status.
2. decide    the pure replica policy per service, then the pure co-scheduler for the pool.
3. apply     a. stop jobs the backend reports Failed (their GPUs return to the pool, the reason
                goes on record; the plan already counted them as not running and restarts them
                when GPUs allow), b. the plan's ordered steps, each confirmed before the next:
                training shrinks finish before inference gets their GPUs; inference drains
                before training grows. A grow still starting its joiners when inference wants
                the GPUs back is called off (nothing has moved yet) and the tick plans once
                more from what the job really holds. c. a job left on a layout dropped for its
                memory (observe: its measured peak passed the per-GPU budget, or it failed out
                of memory) moves in place to the next layout of its GPU count. d. replicas a
                coming scale-down removes leave the load balancer (drain ahead).
4. record    the decision (with its reason), allocations and reshard events in the DB. A tick
             that changes nothing is a *hold*: a run of identical holds is one decision row
             (its count and last time grow), so the log keeps changes, not a row per tick.

Only step 3 touches the backend's actuators and only step 4 writes the store. Between ticks
the lease holder enforces retention (``housekeep``): old history goes in small batches,
never inside a tick. At INFO the log says what changed and why, one line each (a decision
that acts, a rescale with its layout, bytes and pause, a hold that is not plain steady
state, a lease gained or lost); a failure that repeats tick after tick is logged when it
starts, when it changes and when it ends. When the
DB or the backend is unreachable the tick stops acting and says so (``ready`` False,
reason in ``last_error``) instead of guessing. Crash recovery (``recover()``, run before
the first decision): actions the DB shows in flight are reconciled with what the backend
reports, so a controller killed mid-shrink resumes from the backend's truth. With the Ray
backend in detached mode the workers outlive the controller and finish the directive they
were given; the reshard is then recorded ``done`` with the bytes and pause the job reports.

Operators' interventions (a pause, a service's replica override, a job's layout pin) are kept
in the DB with who set them and when: a controller loads them when it starts and again when it
takes the lease, so a restart or a failover keeps them (an override that ran out is dropped).
A job whose start or grow fails backs off exponentially (``start_backoff_seconds`` doubling up
to ``start_backoff_max_seconds``): the co-scheduler does not give it more GPUs until the next
attempt, and the reason and that time are in its status, the admin API and ``/metrics``.

Where the code is: ``loop`` (``Controller``: the tick, crash recovery, retention between ticks),
one module per step (``lease``, ``observe``, ``decide``, ``apply``, ``record``), ``interventions``
(the operators'), ``tables`` (the planner's throughput tables, pure) and ``base`` (the state and
the helpers the parts share). Callers import from ``elastic.controller``, which re-exports the
parts' names, private helpers included. A test that patches a helper patches it where it is looked
up: ``_call_within`` in ``lease`` (backend reads) and in ``observe`` (metric reads).
"""

from elastic.backends.base import paused_tag
from elastic.controller.apply import _bytes as _bytes
from elastic.controller.base import Backoff, TickResult, log
from elastic.controller.base import _call_within as _call_within
from elastic.controller.base import _dt as _dt
from elastic.controller.base import _recorded_layout as _recorded_layout
from elastic.controller.decide import _job_status as _job_status
from elastic.controller.decide import _trains as _trains
from elastic.controller.lease import _LEASE_MARGIN as _LEASE_MARGIN
from elastic.controller.loop import Controller
from elastic.controller.record import _HOLD_REASONS as _HOLD_REASONS
from elastic.controller.record import hold_digest
from elastic.controller.tables import check_feasible, job_throughput_tables, throughput_table

__all__ = [
    "Backoff",
    "Controller",
    "TickResult",
    "check_feasible",
    "hold_digest",
    "job_throughput_tables",
    "log",
    "paused_tag",
    "throughput_table",
]
