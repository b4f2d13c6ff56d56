"""``elastic data prepare``: tokenize text on disk into a corpus that training jobs memory-map.

Only parsing and printing live here; the tokenizer, the file format and the crash-safe
publication are ``elastic.torch.data.prepare_corpus``'s. Imported at every ``elastic`` start,
so torch is imported inside the command, never at module level. Exit codes: 0 the corpus is
written (one summary line); 2 bad input (one line naming the field, no traceback).
"""

from __future__ import annotations

from pathlib import Path

import typer

# the module-level default mirrors elastic.torch.data.DEFAULT_MAX_BYTES without importing torch
_DEFAULT_MAX_BYTES = 64 * 1024 * 1024


def register(app: typer.Typer) -> None:
    data_app = typer.Typer(help="Training data: tokenize a local text corpus (no download).", no_args_is_help=True)
    app.add_typer(data_app, name="data")

    @data_app.command("prepare")
    def prepare_cmd(
        out: Path = typer.Argument(..., help="corpus directory to write (created; an earlier corpus is replaced)"),
        source: list[Path] | None = typer.Option(
            None, "--source", help="directory or file to read, repeatable (default: Python's standard library)"),
        pattern: str = typer.Option("*.py", "--pattern", help="file-name pattern inside --source directories"),
        max_bytes: int = typer.Option(_DEFAULT_MAX_BYTES, "--max-bytes",
                                      help="cap on source bytes read; whole files, in order"),
    ) -> None:
        """Byte-level tokens (+ end-of-document) of text files, as a memory-mapped token file and meta.json."""
        from elastic.cli import console
        from elastic.torch.data import prepare_corpus

        meta = prepare_corpus(out, source or None, pattern=pattern, max_bytes=max_bytes)
        left = meta.source.get("files_left_out", 0)
        console.print(f"corpus {out}: {meta.n_documents} files, {meta.n_tokens} tokens, "
                      f"{meta.n_source_bytes} bytes, sha256 {meta.sha256}"
                      + (f" ({left} files left out by --max-bytes)" if left else ""),
                      highlight=False, soft_wrap=True)
