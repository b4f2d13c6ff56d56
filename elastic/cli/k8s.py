"""``elastic crds`` (write or check the CRD YAML) and ``elastic operator`` (run the Kopf operator)."""

from __future__ import annotations

from pathlib import Path

import typer


def register(app: typer.Typer) -> None:
    @app.command("crds")
    def crds_cmd(out: Path = typer.Option(Path("manifests/crds"), "--out", help="directory for the CRD YAML files"),
                 check: bool = typer.Option(False, "--check", help="only report drift; exit 1 if any file differs")
                 ) -> None:
        """Generate the elastic.dev CustomResourceDefinitions from the pydantic models."""
        from elastic.cli import console, fail
        from elastic.crds import drifted, write_crds

        if check:
            stale = drifted(out)
            if stale:
                fail(f"{out}: out of date: {', '.join(stale)}; run `elastic crds --out {out}`", code=1)
            console.print(f"{out}: up to date")
            return
        for p in write_crds(out):
            console.print(f"wrote {p}")

    @app.command("operator")
    def operator_cmd(namespace: list[str] = typer.Option(None, "--namespace", "-n",
                                                         help="watch only these namespaces (default: all)"),
                     liveness: str = typer.Option("http://0.0.0.0:8080/healthz", "--liveness",
                                                  help="Kopf liveness endpoint ('' to disable)"),
                     verbose: bool = typer.Option(False, "--verbose")) -> None:
        """Run the Kubernetes operator (same as `kopf run -m operators.main --all-namespaces --standalone`).

        Settings come from the environment (see manifests/configmap.yaml)."""
        import kopf

        import operators.main  # noqa: F401 - registers the handlers

        kopf.configure(verbose=verbose)
        kopf.run(standalone=True, clusterwide=not namespace, namespaces=namespace or (),
                 liveness_endpoint=liveness or None)
