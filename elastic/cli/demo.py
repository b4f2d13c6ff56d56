"""``elastic demo``: the whole product on a local Ray with 8 logical GPUs (see elastic.demo)."""

from __future__ import annotations

import typer


def register(app: typer.Typer) -> None:
    @app.command("demo")
    def demo(
        minutes: float = typer.Option(5.0, help="length of the compressed day"),
        tick_seconds: float = typer.Option(2.0, help="controller tick interval"),
        db: str = typer.Option("sqlite:///./elastic.db", envvar="ELASTIC_DB_URL", help="state database URL"),
        summary_json: str = typer.Option("demo-summary.json", help="write the summary JSON here"),
        plot: str = typer.Option("demo-timeline.png", help="write the timeline plot here"),
        live: bool = typer.Option(True, help="show the live table"),
        peak_rps: float = typer.Option(11.0, help="request rate at the day's peak"),
        timeline_csv: str = typer.Option("", help="also write the per-second samples (load, replicas, "
                                         "training GPUs, busy shares) as CSV here"),
        kill_worker_at: str = typer.Option("", help="chaos: kill one training worker at this time of day "
                                           "(HH:MM, e.g. 13:00); the job recovers in place from its replica"),
    ) -> None:
        """Run a compressed day: inference follows the load, training takes the rest and reshards in place."""
        from elastic.cli import fail
        from elastic.demo import day_offset, run_demo

        if minutes <= 0 or tick_seconds <= 0:
            fail(f"--minutes={minutes} and --tick-seconds={tick_seconds} must be > 0")
        if kill_worker_at:
            try:
                day_offset(kill_worker_at)
            except ValueError as e:
                fail(str(e))
        try:
            run_demo(minutes, tick_seconds=tick_seconds, db_url=db, summary_json=summary_json, plot=plot,
                     live=live, peak_rps=peak_rps, timeline_csv=timeline_csv or None,
                     kill_worker_at=kill_worker_at or None)
        except KeyboardInterrupt:
            # workloads stopped, Ray shut down and the lease handed back on the way out
            fail("interrupted: the day did not finish, so no summary or plot was written", code=130)
