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
                                           "(HH:MM, e.g. 13:00); the job recovers in place from its replica (the reference trainer "
                                           "then keeps a whole optimizer state per replica and no memory limit: "
                                           "data-parallel layouts only)"),
        job: str = typer.Option("", "--job", help="train a user's own loop (elastic.torch.Manager) instead of "
                                "the reference trainer: 'llama' (the example Llama, examples.llama.job:main or "
                                "examples/llama/job.py), or any 'package.module:function' or script .py, which "
                                "needs --job-model. Its workers get --corpus DIR (byte tokens of a few "
                                "standard-library files, prepared first), then the example's --dtype float32 "
                                "and --job-args. To compare, run `elastic demo` and `elastic demo --job llama` "
                                "one after the other: each prints which trainer ran and its figures against "
                                "the goals (utilisation >= 0.90, SLO >= 0.99)"),
        job_model: str = typer.Option("", "--job-model", help="with --job: the model file the planner sizes the "
                                      "job from (an example's own by default)"),
        job_args: str = typer.Option("", "--job-args", help="with --job: more arguments for the entrypoint, "
                                     "one string split as a shell would (e.g. \"--log /tmp/steps\")"),
    ) -> None:
        """Run a compressed day: inference follows the load, training takes the rest and reshards in place."""
        import shlex

        from elastic.cli import fail
        from elastic.demo import day_offset, resolve_job, run_demo

        if minutes <= 0 or tick_seconds <= 0:
            fail(f"--minutes={minutes} and --tick-seconds={tick_seconds} must be > 0")
        if kill_worker_at:
            try:
                day_offset(kill_worker_at)
            except ValueError as e:
                fail(str(e))
        if (job_model or job_args) and not job:
            fail("--job-model and --job-args go with --job (the reference trainer takes neither)")
        user_job = None
        if job:
            try:
                user_job = resolve_job(job, job_model or None, shlex.split(job_args))
            except ValueError as e:
                fail(str(e))
        try:
            run_demo(minutes, tick_seconds=tick_seconds, db_url=db, summary_json=summary_json, plot=plot,
                     live=live, peak_rps=peak_rps, timeline_csv=timeline_csv or None,
                     kill_worker_at=kill_worker_at or None, job=user_job)
        except KeyboardInterrupt:
            # workloads stopped, Ray shut down and the lease handed back on the way out
            fail("interrupted: the day did not finish, so no summary or plot was written", code=130)
