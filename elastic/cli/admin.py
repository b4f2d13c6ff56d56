"""``elastic status|get|decisions|reshards|rescale|checkpoint|override|controller``: a client of a
running controller's admin API (``elastic serve``, the operator) over HTTP.

What it is for: see where every GPU is and why, and intervene (pin a layout, ask for a
checkpoint, pin a service's replicas, pause the controller) from a shell, without curl.
Every command takes ``--api`` (default ``$ELASTIC_API``, else ``elastic serve``'s
``http://127.0.0.1:8080``), ``--token`` (default ``$ELASTIC_TOKEN``; writes need an
``admin`` token, reads one only when the server requires it), ``--json`` (the API's JSON as
it came) and ``--timeout``.

Errors are one line on stderr, never a traceback: the API's RFC 9457 problem (HTTP status,
detail, the field it names), exit 2 for a 4xx (the request was wrong: fix it and retry),
exit 1 for a 5xx, an unreachable API or no answer in time (the server's side).

What it must not do: decide or validate what the server validates (it would drift from
it). The one exception is ``rescale --gpus N``, which asks the planner locally for the
layout the controller itself would pick for N GPUs; the server then validates that layout.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from datetime import UTC, datetime, timedelta
from typing import TYPE_CHECKING, Any
from urllib.parse import quote

import typer

if TYPE_CHECKING:  # the CLI imports the model lazily, where a command needs it
    from elastic.layout import Layout

API_ENV = "ELASTIC_API"
TOKEN_ENV = "ELASTIC_TOKEN"
DEFAULT_API = "http://127.0.0.1:8080"  # `elastic serve --api-port` default, on loopback
PREFIX = "/api/v1"
DEFAULT_TIMEOUT_S = 10.0
KINDS = {"service": "services", "services": "services", "svc": "services",
         "job": "jobs", "jobs": "jobs", "pool": "pools", "pools": "pools"}

_API = typer.Option(DEFAULT_API, "--api", envvar=API_ENV, metavar="URL",
                    help="the controller's admin API base URL")
_TOKEN = typer.Option(None, "--token", envvar=TOKEN_ENV, metavar="TOKEN", show_default=False,
                      help="bearer token (an 'admin' one for writes); prefer the env var: argv is visible in ps")
_JSON = typer.Option(False, "--json", help="print the API's JSON instead of a table")
_TIMEOUT = typer.Option(DEFAULT_TIMEOUT_S, "--timeout", metavar="SECONDS", help="how long to wait for an answer")


# ---- HTTP --------------------------------------------------------------------------------------------

class ApiError(Exception):
    """A request that did not succeed: ``message`` is the one line to print, ``code`` the exit status."""

    def __init__(self, message: str, code: int) -> None:
        super().__init__(message)
        self.message, self.code = message, code


@dataclass(frozen=True)
class Conn:
    """Where the API is and how to talk to it (from the common options)."""

    api: str
    token: str | None
    timeout: float

    def request(self, method: str, path: str, *, body: Any = None, params: dict[str, Any] | None = None,
                timeout: float | None = None) -> Any:
        """``method`` on ``/api/v1{path}``: the decoded JSON of a 2xx answer, else ``ApiError``."""
        import httpx

        url = self.api.rstrip("/") + PREFIX + path
        headers = {"Accept": "application/json, application/problem+json"}
        if self.token:
            headers["Authorization"] = f"Bearer {self.token}"
        wait = timeout if timeout is not None else self.timeout
        query = {k: v for k, v in (params or {}).items() if v is not None}
        try:
            r = httpx.request(method, url, json=body, params=query, headers=headers, timeout=wait)
        except httpx.TimeoutException:
            raise ApiError(f"{method} {url}: no answer within {wait:g} s; the controller may be busy "
                           "(retry, or raise --timeout)", 1) from None
        except (httpx.UnsupportedProtocol, httpx.InvalidURL) as e:
            raise ApiError(f"--api {self.api!r} is not a usable URL ({e}); e.g. {DEFAULT_API}", 2) from None
        except httpx.TransportError as e:
            raise ApiError(f"cannot reach the admin API at {self.api} ({_first_line(str(e)) or type(e).__name__}); "
                           f"start `elastic serve` there, or point --api / {API_ENV} at a running controller",
                           1) from None
        if r.is_success:
            return _decoded(r, url)
        raise ApiError(problem_line(r, write=method != "GET", sent_token=bool(self.token)),
                       2 if 400 <= r.status_code < 500 else 1)


def _decoded(r: Any, url: str) -> Any:
    if r.status_code == 204 or not r.content:
        return {}
    try:
        doc = r.json()
    except ValueError:
        doc = None
    if not isinstance(doc, dict):  # every admin API answer is a JSON object
        raise ApiError(f"{url} answered HTTP {r.status_code} without a JSON object; is --api / {API_ENV} an "
                       "elastic controller's admin API?", 1)
    return doc


def problem_line(r: Any, *, write: bool, sent_token: bool) -> str:
    """One line for an error answer: status, the problem's title and detail (which names the field),
    and for 401/403 which token to give."""
    try:
        body = r.json()
    except ValueError:
        body = None
    if isinstance(body, dict) and body.get("detail"):
        title, detail = body.get("title") or r.reason_phrase, str(body["detail"])
        field = body.get("field")
        if field and not detail.startswith(f"{field}:"):
            detail = f"{field}: {detail}"
    else:  # not an elastic problem: a proxy, another server on that port
        title = r.reason_phrase
        detail = (_first_line(r.text)[:200] or "no details") + f"; is --api / {API_ENV} an elastic controller?"
    line = f"HTTP {r.status_code} {title}: {detail}"
    need = "an 'admin' token (this is a write)" if write else "a token"
    if r.status_code == 401:
        line += (f"; no token was sent: pass {need} with --token or {TOKEN_ENV}" if not sent_token
                 else f"; check --token / {TOKEN_ENV}: the server needs {need}")
    elif r.status_code == 403:
        line += f"; pass an 'admin' token with --token or {TOKEN_ENV}"
    return " ".join(line.split())


def _first_line(text: str) -> str:
    return text.strip().splitlines()[0].strip() if text.strip() else ""


def connect(api: str, token: str | None, timeout: float) -> Conn:
    """Check the common options (one line, exit 2, before any request)."""
    from elastic.cli import fail

    if not timeout > 0:
        fail(f"--timeout={timeout:g}: give a positive number of seconds")
    token = (token or "").strip() or None
    if token is not None and not re.fullmatch(r"[\x21-\x7e]+", token):
        fail(f"--token / {TOKEN_ENV}: a token is printable ASCII without spaces")
    return Conn(api.strip(), token, timeout)


def ask(conn: Conn, method: str, path: str, **kw: Any) -> Any:
    """``Conn.request``, with a failure printed as one line on stderr and the process exiting."""
    from rich.markup import escape

    from elastic.cli import fail

    try:
        return conn.request(method, path, **kw)
    except ApiError as e:
        fail(escape(e.message), code=e.code)


# ---- output ------------------------------------------------------------------------------------------

def _emit_json(data: Any) -> None:
    typer.echo(json.dumps(data, indent=2))


def _table(columns: list[str], rows: list[list[Any]], title: str | None = None, drop: tuple[str, ...] = ()) -> None:
    from rich import box
    from rich.table import Table
    from rich.text import Text

    from elastic.cli import console
    from elastic.cli._fit import fit

    t = Table(*columns, box=box.SIMPLE_HEAD, title=title, title_justify="left", pad_edge=False)
    for row in rows:
        t.add_row(*(Text(_cell(v)) for v in row))  # Text: values are data, never Rich markup
    # the columns in ``drop`` give way first, least important first, where the words of all cannot
    # fit (--json has them all); what stays is sized so that no name or number is cut or folded
    fit(t, console, drop)
    console.print(t)


def _fields(rows: list[tuple[str, Any]]) -> None:
    """A compact two-column key/value table."""
    from rich.table import Table
    from rich.text import Text

    from elastic.cli import console

    t = Table.grid(padding=(0, 2))
    t.add_column(style="bold")
    t.add_column()
    for k, v in rows:
        t.add_row(k, Text(_cell(v)))
    console.print(t)


def _say(text: str) -> None:
    from elastic.cli import console

    console.print(text, markup=False, highlight=False, soft_wrap=True)


def _cell(v: Any) -> str:
    if v is None:
        return "-"
    if isinstance(v, bool):
        return "yes" if v else "no"
    if isinstance(v, float):
        return f"{v:,.0f}" if abs(v) >= 1000 else f"{v:g}"
    return str(v)


def when(ts: str | None) -> str:
    """``2023-11-14T22:14:20.123Z`` -> ``2023-11-14 22:14:20Z`` (the API's times are UTC)."""
    if not ts:
        return "-"
    return re.sub(r"\.\d+", "", ts).replace("T", " ").replace("+00:00", "Z")


def human_bytes(n: int | None) -> str:
    if n is None:
        return "-"
    size, unit = float(n), "B"
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(size) < 1024 or unit == "TiB":
            break
        size /= 1024
    return f"{int(size)} B" if unit == "B" else f"{size:.1f} {unit}"


def _range(spec: dict[str, Any], lo: str, hi: str) -> str:
    return f"{spec.get(lo, '?')}-{spec.get(hi, '?')}"


def service_row(w: dict[str, Any]) -> list[Any]:
    spec, st = w.get("spec") or {}, w.get("status") or {}
    return [w.get("name"), w.get("pool"), st.get("currentReplicas"), st.get("desiredReplicas"),
            _range(spec, "min_replicas", "max_replicas"), spec.get("gpus_per_replica"), st.get("observedValue"),
            (spec.get("metric") or {}).get("target"), st.get("reason")]


SERVICE_COLUMNS = ["NAME", "POOL", "REPLICAS", "DESIRED", "MIN-MAX", "GPU/REPLICA", "LOAD", "TARGET", "REASON"]


def job_row(w: dict[str, Any]) -> list[Any]:
    spec, st = w.get("spec") or {}, w.get("status") or {}
    return [w.get("name"), w.get("pool"), st.get("phase"), st.get("layout"), st.get("worldSize"),
            _range(spec, "min_gpus", "max_gpus"), st.get("step"), st.get("checkpointStep"),
            st.get("tokensPerSecond"), st.get("loss"), st.get("reason")]


JOB_COLUMNS = ["NAME", "POOL", "PHASE", "LAYOUT", "GPUS", "MIN-MAX", "STEP", "CHECKPOINT", "TOKENS/S", "LOSS",
               "REASON"]


def allocation_text(alloc: dict[str, int]) -> str:
    return ", ".join(f"{w} {n}" for w, n in sorted(alloc.items())) or "none"


def pool_row(p: dict[str, Any]) -> list[Any]:
    spec, alloc = p.get("spec") or {}, p.get("allocated_gpus") or {}
    used, total = sum(alloc.values()), p.get("total_gpus")
    return [p.get("name"), spec.get("hardware"), f"{spec.get('nodes', '?')} x {spec.get('gpus_per_node', '?')}", total,
            used, None if total is None else total - used, p.get("leader") or "none", allocation_text(alloc)]


POOL_COLUMNS = ["NAME", "HARDWARE", "NODES", "GPUS", "IN USE", "IDLE", "LEADER", "ALLOCATION"]
_GET = {"services": (SERVICE_COLUMNS, service_row), "jobs": (JOB_COLUMNS, job_row), "pools": (POOL_COLUMNS, pool_row)}
# what gives way in a narrow terminal, least important first (NAME and the counts stay)
_DROP = {"services": ("GPU/REPLICA", "POOL", "MIN-MAX", "TARGET"),
         "jobs": ("CHECKPOINT", "LOSS", "POOL", "MIN-MAX", "TOKENS/S"),
         "pools": ("ALLOCATION", "HARDWARE", "LEADER")}


def decision_time(d: dict[str, Any]) -> str:
    """A change's time; a run of holds as ``first .. last x N`` (N ticks that changed nothing)."""
    count = int(d.get("count") or 1)
    first = when(d.get("first_at") or d.get("tick_at"))
    if count <= 1:
        return first
    last = when(d.get("last_at"))
    if last[:11] == first[:11]:  # same day: the time of day is enough
        last = last[11:]
    return f"{first} .. {last} x {count}"


def decision_rows(items: list[dict[str, Any]]) -> list[list[Any]]:
    """One row per plan step (id and time on the first); a decision without steps is one row."""
    rows: list[list[Any]] = []
    for d in items:
        plan = d.get("plan") or {}
        steps = [(s.get("action"), s.get("workload"), s.get("reason"), s.get("message"))
                 for s in plan.get("steps") or []]
        if plan.get("error"):
            steps.append(("error", None, d.get("reason"), plan["error"]))
        if not steps:
            steps = [("hold" if d.get("hold") else None, None, d.get("reason"), d.get("message"))]
        for i, (action, workload, reason, message) in enumerate(steps):
            head = [d.get("id"), decision_time(d), d.get("pool")] if i == 0 else ["", "", ""]
            rows.append(head + [action, workload, reason, message])
    return rows


DECISION_COLUMNS = ["ID", "TIME", "POOL", "ACTION", "WORKLOAD", "REASON", "MESSAGE"]


def reshard_row(r: dict[str, Any]) -> list[Any]:
    pause = r.get("pause_seconds")
    return [r.get("generation"), when(r.get("started_at")), f"{r.get('from_layout')} -> {r.get('to_layout')}",
            human_bytes(r.get("bytes_moved")), human_bytes(r.get("bytes_planned")),
            human_bytes(r.get("bytes_lower_bound")), None if pause is None else f"{pause:.2f} s", r.get("status"),
            r.get("error")]


RESHARD_COLUMNS = ["GEN", "STARTED", "LAYOUT", "MOVED", "PLANNED", "LOWER BOUND", "PAUSE", "STATUS", "ERROR"]


def status_fields(ctl: dict[str, Any], pools: list[dict[str, Any]]) -> list[tuple[str, Any]]:
    """``elastic status`` rows: the controller, its last tick, its pool's GPUs and lease."""
    t = ctl.get("last_tick") or {}
    pool = next((p for p in pools if p.get("name") == ctl.get("pool")), None)
    rows: list[tuple[str, Any]] = [
        ("controller", f"{ctl.get('owner')} (pool {ctl.get('pool')})"),
        ("leader", ctl.get("leader")),
        ("ready", ctl.get("ready")),
        ("paused", ctl.get("paused")),
        ("last error", ctl.get("last_error")),
        ("last tick", "none yet" if not t else
         f"{when(t.get('at'))}  {'acted' if t.get('acted') else 'no action'}  {t.get('reason')}  "
         f"{t.get('seconds', 0):.2f} s" + (f"  error: {t['error']}" if t.get("error") else "")),
    ]
    if t:
        rows.append(("", t.get("message")))
    if pool is not None:
        alloc = pool.get("allocated_gpus") or {}
        total, used = pool.get("total_gpus"), sum(alloc.values())
        idle = "" if total is None else f", {total - used} idle"
        rows += [("lease holder", pool.get("leader") or "none"),
                 ("GPUs", f"{total if total is not None else '?'} total, {used} in use{idle}: "
                          f"{allocation_text(alloc)}")]
    overrides = ctl.get("overrides") or {}
    rows.append(("overrides", "; ".join(f"{s} {o.get('replicas')} replicas until {when(o.get('until'))}"
                                        for s, o in sorted(overrides.items())) or "none"))
    rows.append(("pinned", "; ".join(f"{j} {L}" for j, L in sorted((ctl.get("pinned") or {}).items())) or "none"))
    return rows


def database_fields(dbi: dict[str, Any]) -> list[tuple[str, Any]]:
    """``elastic status`` rows of the state database: its size, then per history table the rows
    kept, the oldest kept row and how long rows are kept."""
    rows: list[tuple[str, Any]] = [("database", f"{dbi.get('dialect')}, {human_bytes(dbi.get('size_bytes'))}")]
    for t in dbi.get("tables") or []:
        days = t.get("retention_days")
        kept = "kept" if days is None else f"kept {days:g} d"
        rows.append((f"  {t.get('table')}", f"{t.get('rows')} rows, oldest {when(t.get('oldest'))}, {kept}"))
    return rows


# ---- inputs ------------------------------------------------------------------------------------------

_DURATION = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*(s|m|h|d)?\s*$")
_UNIT_S = {"s": 1, "m": 60, "h": 3600, "d": 86400}


def parse_duration(text: str) -> timedelta:
    """``90``, ``90s``, ``30m``, ``2h``, ``1d`` -> timedelta (ValueError otherwise)."""
    m = _DURATION.match(text)
    if m is None or float(m.group(1)) <= 0:
        raise ValueError(f"'{text}' is not a positive duration; e.g. 90s, 30m, 2h, 1d")
    return timedelta(seconds=float(m.group(1)) * _UNIT_S[m.group(2) or "s"])


def override_until(until: str | None, for_: str | None, now: datetime) -> datetime:
    """The override's end: ``--until`` (RFC 3339 with offset) or now + ``--for`` (default 1h)."""
    if until is not None and for_ is not None:
        raise ValueError("give --until or --for, not both")
    if until is None:
        return (now + parse_duration(for_ or "1h")).replace(microsecond=0)
    try:
        t = datetime.fromisoformat(until.strip())
    except ValueError:
        raise ValueError(f"--until '{until}' is not an RFC 3339 time; e.g. 2030-01-01T12:00:00Z") from None
    if t.tzinfo is None:
        raise ValueError(f"--until '{until}' has no UTC offset; add one, e.g. {until}Z or {until}+02:00")
    return t


def planned_layout(job: dict[str, Any], pool: dict[str, Any], gpus: int) -> Layout:
    """The layout the controller's own throughput table picks for ``gpus`` GPUs (SpecError if none)."""
    from elastic.controller import throughput_table
    from elastic.model import PoolSpec, SpecError, TrainingSpec, load_hardware, load_model

    spec, ps = TrainingSpec.model_validate(job.get("spec")), PoolSpec.model_validate(pool.get("spec"))
    if not spec.min_gpus <= gpus <= min(spec.max_gpus, ps.total_gpus):
        raise SpecError(f"--gpus {gpus}: job '{spec.name}' runs on {spec.min_gpus}-{spec.max_gpus} GPUs in pool "
                        f"'{ps.name}' of {ps.total_gpus}")
    try:
        model = load_model(spec.model)
    except SpecError as e:
        raise SpecError(f"--gpus needs the job's model here to plan ({e}); pass --layout instead") from None
    table = throughput_table(model, load_hardware(ps.hardware), gpus, gpus_per_node=ps.gpus_per_node,
                             **spec.planner_options())
    if gpus not in table:
        fits = ", ".join(str(n) for n in sorted(table) if n >= spec.min_gpus) or "none"
        raise SpecError(f"--gpus {gpus}: no layout of {spec.model} (global_batch {spec.global_batch}) uses exactly "
                        f"{gpus} {ps.hardware} GPUs; counts that work: {fits}")
    return table[gpus][0]


# ---- commands ----------------------------------------------------------------------------------------

def register(app: typer.Typer) -> None:
    _register_reads(app)
    _register_writes(app)


def _register_reads(app: typer.Typer) -> None:
    @app.command("status")
    def status_cmd(api: str = _API, token: str | None = _TOKEN, as_json: bool = _JSON,
                   timeout: float = _TIMEOUT) -> None:
        """The running controller: leader, ready, paused, last tick, its pool's GPUs, overrides, pins."""
        conn = connect(api, token, timeout)
        ctl, pools = ask(conn, "GET", "/controller"), ask(conn, "GET", "/pools")
        try:
            dbi: dict[str, Any] | None = conn.request("GET", "/database")
        except ApiError:  # a controller that predates the endpoint: the rest still says a lot
            dbi = None
        if as_json:
            _emit_json({"controller": ctl, "pools": pools.get("items", []), "database": dbi})
            return
        _fields(status_fields(ctl, pools.get("items", [])) + (database_fields(dbi) if dbi else []))

    @app.command("get")
    def get_cmd(kind: str = typer.Argument(..., metavar="services|jobs|pools", help="what to list"),
                name: str | None = typer.Argument(None, help="show only this one"),
                pool: str | None = typer.Option(None, "--pool", help="services/jobs of this pool only"),
                api: str = _API, token: str | None = _TOKEN, as_json: bool = _JSON,
                timeout: float = _TIMEOUT) -> None:
        """List inference services, training jobs or pools, or show one (spec and status)."""
        from elastic.cli import fail

        plural = KINDS.get(kind.lower())
        if plural is None:
            fail(f"'{kind}' is not something to get; say services, jobs or pools")
        conn = connect(api, token, timeout)
        if name is not None:
            one = ask(conn, "GET", f"/{plural}/{quote(name, safe='')}")
            items = [one]
        else:
            params = {"pool": pool} if plural != "pools" else {}
            one = ask(conn, "GET", f"/{plural}", params=params)
            items = one.get("items", [])
            if plural == "pools" and pool is not None:
                items = [p for p in items if p.get("name") == pool]
                one = {"items": items}
        if as_json:
            _emit_json(one)
            return
        columns, row = _GET[plural]
        _table(columns, [row(w) for w in items], drop=_DROP[plural])
        if name is not None and (message := (one.get("status") or {}).get("message")):
            _say(f"{name}: {message}")

    @app.command("decisions")
    def decisions_cmd(limit: int = typer.Option(20, "--limit", help="newest decisions to show (API: 1-500)"),
                      pool: str | None = typer.Option(None, "--pool", help="only this pool's"),
                      all_: bool = typer.Option(False, "--all", help="include holds (runs of ticks that changed "
                                                                     "nothing, shown as first .. last x N)"),
                      api: str = _API, token: str | None = _TOKEN, as_json: bool = _JSON,
                      timeout: float = _TIMEOUT) -> None:
        """The decision log, latest changes first: each plan step with its action, workload, reason and
        message. ``--all`` includes the holds between them."""
        conn = connect(api, token, timeout)
        out = ask(conn, "GET", "/decisions", params={"limit": limit, "pool": pool,
                                                     "changes": None if all_ else "true"})
        if as_json:
            _emit_json(out)
            return
        _table(DECISION_COLUMNS, decision_rows(out.get("items", [])), drop=("POOL", "ID"))
        if not all_ and not out.get("items"):
            _say("no changes on record; --all shows the holds too")
        _more_hint(out)

    @app.command("reshards")
    def reshards_cmd(job: str = typer.Argument(..., help="training job name"),
                     limit: int = typer.Option(20, "--limit", help="newest reshards to show (API: 1-500)"),
                     api: str = _API, token: str | None = _TOKEN, as_json: bool = _JSON,
                     timeout: float = _TIMEOUT) -> None:
        """A training job's reshard history, newest first: layouts, bytes, pause, outcome."""
        conn = connect(api, token, timeout)
        out = ask(conn, "GET", f"/jobs/{quote(job, safe='')}/reshards", params={"limit": limit})
        if as_json:
            _emit_json(out)
            return
        _table(RESHARD_COLUMNS, [reshard_row(r) for r in out.get("items", [])], title=f"reshards of {job}",
               drop=("LOWER BOUND", "PLANNED", "STARTED"))
        _more_hint(out)


def _more_hint(out: dict[str, Any]) -> None:
    if (out.get("metadata") or {}).get("continue"):
        _say("(older entries exist; raise --limit to see them)")


def _register_writes(app: typer.Typer) -> None:
    @app.command("rescale")
    def rescale_cmd(job: str = typer.Argument(..., help="training job name"),
                    layout: str | None = typer.Option(None, "--layout", help="pin this layout, e.g. tp2.pp1.dp2"),
                    gpus: int | None = typer.Option(None, "--gpus", help="pin the layout the planner picks for "
                                                                         "exactly this many GPUs"),
                    unpin: bool = typer.Option(False, "--unpin", help="let the co-scheduler choose again"),
                    api: str = _API, token: str | None = _TOKEN, as_json: bool = _JSON,
                    timeout: float = _TIMEOUT) -> None:
        """Pin a training job to a layout (the controller rescales at its next tick), or unpin it."""
        from elastic.cli import fail
        from elastic.model import SpecError

        if sum((layout is not None, gpus is not None, unpin)) != 1:
            fail("give exactly one of --layout L, --gpus N or --unpin")
        conn = connect(api, token, timeout)
        name = quote(job, safe="")
        if gpus is not None:
            rec = ask(conn, "GET", f"/jobs/{name}")
            try:
                pool = ask(conn, "GET", f"/pools/{quote(str(rec.get('pool')), safe='')}")
                layout = str(planned_layout(rec, pool, gpus))
            except SpecError as e:
                fail(_escaped(str(e)))
            except ValueError as e:  # a spec the server holds that this version cannot read
                fail(_escaped(f"--gpus: cannot read job '{job}''s spec here ({_first_line(str(e))}); "
                              "pass --layout instead"))
        out = ask(conn, "POST", f"/jobs/{name}/rescale", body={"layout": layout})
        if as_json:
            _emit_json(out)
            return
        estimate = ""
        if out.get("tokens_per_second") is not None:
            estimate = (f" (planner: {out['tokens_per_second']:,.0f} tokens/s, "
                        f"{human_bytes(out.get('gpu_memory_bytes'))} on the busiest GPU)")
        _say(f"{out.get('job', job)}: {out.get('message')}{estimate}")

    @app.command("checkpoint")
    def checkpoint_cmd(job: str = typer.Argument(..., help="training job name"),
                       wait: float = typer.Option(0.0, "--wait", metavar="SECONDS",
                                                  help="wait this long for every rank to write it (0: ask only)"),
                       api: str = _API, token: str | None = _TOKEN, as_json: bool = _JSON,
                       timeout: float = _TIMEOUT) -> None:
        """Save a running training job's state at its next step boundary (before maintenance)."""
        conn = connect(api, token, timeout)
        # the server may legitimately take the whole --wait: the HTTP timeout covers it plus a margin
        out = ask(conn, "POST", f"/jobs/{quote(job, safe='')}/checkpoint", body={"wait_seconds": wait},
                  timeout=max(timeout, wait + timeout))
        if as_json:
            _emit_json(out)
            return
        _say(f"{out.get('job', job)}: {out.get('message')}")

    @app.command("override")
    def override_cmd(service: str = typer.Argument(..., help="inference service name"),
                     replicas: int | None = typer.Option(None, "--replicas", help="replica count to hold"),
                     for_: str | None = typer.Option(None, "--for", metavar="DURATION",
                                                     help="how long: 90s, 30m, 2h, 1d (default 1h)"),
                     until: str | None = typer.Option(None, "--until", metavar="TIME",
                                                      help="until this RFC 3339 time, e.g. 2030-01-01T12:00:00Z"),
                     clear: bool = typer.Option(False, "--clear", help="remove the override; the policy decides"),
                     api: str = _API, token: str | None = _TOKEN, as_json: bool = _JSON,
                     timeout: float = _TIMEOUT) -> None:
        """Pin an inference service's replica count for a while (the policy still runs), or clear it."""
        from elastic.cli import fail

        if clear == (replicas is not None):
            fail("give --replicas N (with --for or --until) or --clear")
        if clear and (for_ is not None or until is not None):
            fail("--clear takes no --for/--until")
        conn = connect(api, token, timeout)
        path = f"/services/{quote(service, safe='')}/override"
        if clear:
            out = ask(conn, "DELETE", path)
        else:
            try:
                end = override_until(until, for_, datetime.now(UTC))
            except ValueError as e:
                fail(_escaped(str(e)))
            out = ask(conn, "PUT", path, body={"replicas": replicas, "until": end.isoformat()})
        if as_json:
            _emit_json(out)
            return
        _say(f"{out.get('service', service)}: {out.get('message')}")

    ctl_app = typer.Typer(help="Pause or resume the controller (it keeps observing; a paused one does not act).",
                          no_args_is_help=True)
    app.add_typer(ctl_app, name="controller")
    for verb in ("pause", "resume"):
        _controller_verb(ctl_app, verb)


def _controller_verb(ctl_app: typer.Typer, verb: str) -> None:
    doc = {"pause": "Stop the controller acting (no scaling, no rescales) until `elastic controller resume`.",
           "resume": "Let a paused controller act again from its next tick."}[verb]

    def act(api: str = _API, token: str | None = _TOKEN, as_json: bool = _JSON, timeout: float = _TIMEOUT) -> None:
        conn = connect(api, token, timeout)
        out = ask(conn, "POST", f"/controller/{verb}")
        if as_json:
            _emit_json(out)
            return
        state = "paused" if out.get("paused") else "acting"
        _say(f"controller {out.get('owner')} of pool {out.get('pool')}: {state}")

    act.__doc__ = doc
    ctl_app.command(verb)(act)


def _escaped(text: str) -> str:
    from rich.markup import escape

    return escape(text)
