"""``elastic.torch.data``: a byte-token corpus from files on disk, and layout-invariant batches.

Preparation round-trips to the source bytes, is deterministic and crash-safe (a half-written
corpus never opens); the step schedule is a keyed permutation per epoch that depends only on
``(step, global_batch, seed, n)``; every data-parallel layout computes exactly the step's
samples, and the weights turn the reducer's result into the gradient of the global mean loss
(float64, checked against one process). Bad input names the field. ``elastic data prepare``
prints one line, or one error line with exit 2.
"""

from __future__ import annotations

import hashlib
import json
import pickle
import random
import subprocess
import sys
import sysconfig
from pathlib import Path

import numpy as np
import pytest
import torch

from elastic.model import SpecError
from elastic.torch import data as D
from elastic.torch.data import CorpusError, TokenCorpus, micro_batches, prepare_corpus, step_samples

STDLIB = Path(sysconfig.get_paths()["stdlib"])
SOURCES = [STDLIB / "textwrap.py", STDLIB / "json"]
SEQ = 16
ROOT = Path(__file__).resolve().parents[2]


def _listing() -> list[Path]:
    return [SOURCES[0], *D.source_files(SOURCES[1])]


@pytest.fixture(scope="module")
def corpus_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("corpus")
    prepare_corpus(out, SOURCES, max_bytes=200_000)
    return out


@pytest.fixture(scope="module")
def corpus(corpus_dir: Path) -> TokenCorpus:
    return TokenCorpus.open(corpus_dir, seq_len=SEQ, verify=True)


def _tree(root: Path) -> Path:
    """a.py 100 B, b.py empty, c.py 200 B, d.py 300 B, sub/e.py 50 B; plus files never listed."""
    for rel, size in (("a.py", 100), ("b.py", 0), ("c.py", 200), ("d.py", 300), ("sub/e.py", 50),
                      (".hidden/x.py", 10), ("__pycache__/y.py", 10), ("notes.txt", 10)):
        p = root / rel
        p.parent.mkdir(parents=True, exist_ok=True)
        p.write_bytes(bytes((i * 7 + len(rel)) % 256 for i in range(size)))
    return root


def _corrupt(d: Path, how: str) -> None:
    meta_path = d / D.META_FILE
    meta = json.loads(meta_path.read_text())
    tokens = d / meta["tokens_file"]
    raw = tokens.read_bytes()
    if how == "truncated tokens":
        tokens.write_bytes(raw[:-2])
    elif how == "unwritten tail":
        tokens.write_bytes(raw[: len(raw) // 2] + bytes(len(raw) - len(raw) // 2))
    elif how == "half-written meta":
        text = meta_path.read_text()
        meta_path.write_text(text[: len(text) // 2])
    elif how == "no meta":
        meta_path.unlink()
    elif how == "no tokens":
        tokens.unlink()
    else:
        key, value = how.split("=")
        meta[key] = json.loads(value)
        meta_path.write_text(json.dumps(meta))


# --------------------------------------------------------------------------------------------
# preparation
# --------------------------------------------------------------------------------------------


def test_prepared_tokens_round_trip_to_the_source_bytes(corpus_dir: Path, corpus: TokenCorpus) -> None:
    files = [p for p in _listing() if p.stat().st_size]
    meta = D.read_meta(corpus_dir)
    taken = files[: meta.n_documents]
    assert meta.n_documents == len(taken) >= 3
    assert meta.n_source_bytes == sum(p.stat().st_size for p in taken) <= 200_000
    assert meta.n_tokens == meta.n_source_bytes + meta.n_documents
    raw = (corpus_dir / meta.tokens_file).read_bytes()
    assert hashlib.sha256(raw).hexdigest() == meta.sha256 and meta.tokens_file == D.tokens_file_name(meta.sha256)
    tokens = np.frombuffer(raw, dtype="<u2")
    assert tokens.max() == D.EOD_TOKEN and tokens[-1] == D.EOD_TOKEN
    ends = np.flatnonzero(tokens == D.EOD_TOKEN)
    docs = np.split(tokens, ends + 1)[:-1]
    assert [bytes(doc[:-1].astype(np.uint8)) for doc in docs] == [p.read_bytes() for p in taken]
    assert meta.source["files_left_out"] == len(files) - len(taken)
    assert len(corpus) == meta.n_tokens // (SEQ + 1)


def test_preparation_is_deterministic_and_a_smaller_cap_gives_a_prefix(tmp_path: Path) -> None:
    src = _tree(tmp_path / "src")
    a = prepare_corpus(tmp_path / "a", [src], max_bytes=10_000)
    b = prepare_corpus(tmp_path / "b", [src], max_bytes=10_000)
    assert a.sha256 == b.sha256 and a.tokens_file == b.tokens_file
    assert (tmp_path / "a" / D.META_FILE).read_bytes() == (tmp_path / "b" / D.META_FILE).read_bytes()
    # listing: a, b (empty, skipped), c, d, sub/e; never .hidden, __pycache__ or *.txt
    assert (a.n_documents, a.n_source_bytes, a.source["files_left_out"]) == (4, 650, 0)
    # 350 bytes: a + c = 300 fit, d would pass the cap; d and e are left out, the empty b is not
    c = prepare_corpus(tmp_path / "c", [src], max_bytes=350)
    assert (c.n_documents, c.n_source_bytes, c.source["files_left_out"]) == (2, 300, 2)
    full = (tmp_path / "a" / a.tokens_file).read_bytes()
    assert full.startswith((tmp_path / "c" / c.tokens_file).read_bytes())


def test_source_files_are_listed_by_relative_path_without_hidden_or_cache_dirs(tmp_path: Path) -> None:
    src = _tree(tmp_path)
    assert [p.relative_to(src).as_posix() for p in D.source_files(src)] == ["a.py", "b.py", "c.py", "d.py",
                                                                            "sub/e.py"]
    assert [p.name for p in D.source_files(src, "*.txt")] == ["notes.txt"]
    assert D.source_files(src, "*.py", skip_dirs=("sub",))[-1].name == "d.py"


def test_default_source_is_the_standard_library(tmp_path: Path) -> None:
    meta = prepare_corpus(tmp_path, max_bytes=100_000)
    assert meta.source["kind"] == "python-stdlib" and meta.source["roots"] == [str(D.stdlib_root())]
    assert 0 < meta.n_source_bytes <= 100_000
    assert TokenCorpus.open(tmp_path, seq_len=SEQ, verify=True).meta == meta


def test_preparing_again_replaces_the_corpus_and_its_old_token_file(tmp_path: Path) -> None:
    src = _tree(tmp_path / "src")
    first = prepare_corpus(tmp_path / "c", [src], max_bytes=350)
    second = prepare_corpus(tmp_path / "c", [src])
    assert first.sha256 != second.sha256
    assert sorted(p.name for p in (tmp_path / "c").iterdir()) == sorted([D.META_FILE, second.tokens_file])
    assert TokenCorpus.open(tmp_path / "c", seq_len=4, verify=True).meta.sha256 == second.sha256


def test_output_inside_a_source_is_not_read_back_as_text(tmp_path: Path) -> None:
    src = _tree(tmp_path)
    first = prepare_corpus(src / "corpus", [src], pattern="*")
    again = prepare_corpus(src / "corpus", [src], pattern="*")
    assert again.sha256 == first.sha256


def test_a_crash_before_the_metadata_switches_leaves_the_previous_corpus(tmp_path: Path,
                                                                       monkeypatch: pytest.MonkeyPatch) -> None:
    src = _tree(tmp_path / "src")
    old = prepare_corpus(tmp_path / "c", [src], max_bytes=350)

    def crash(path: Path, text: str) -> None:
        raise KeyboardInterrupt("killed while writing meta.json")

    monkeypatch.setattr(D, "_write_atomic", crash)
    with pytest.raises(KeyboardInterrupt):
        prepare_corpus(tmp_path / "c", [src])
    assert TokenCorpus.open(tmp_path / "c", seq_len=4, verify=True).meta.sha256 == old.sha256


def test_a_crash_while_tokenizing_leaves_no_corpus_and_no_temporary_file(tmp_path: Path,
                                                                        monkeypatch: pytest.MonkeyPatch) -> None:
    src = _tree(tmp_path / "src")
    reads: list[Path] = []

    def read(path: Path) -> bytes:
        reads.append(path)
        if len(reads) == 3:
            raise KeyboardInterrupt("killed mid-file")
        return path.read_bytes()

    monkeypatch.setattr(D, "_read", read)
    with pytest.raises(KeyboardInterrupt):
        prepare_corpus(tmp_path / "c", [src])
    assert list((tmp_path / "c").iterdir()) == []
    with pytest.raises(CorpusError, match="meta.json: missing"):
        TokenCorpus.open(tmp_path / "c")


@pytest.mark.parametrize(("how", "message"), [
    ("truncated tokens", "bytes, but n_tokens="),
    ("unwritten tail", "not completely written"),
    ("half-written meta", "unreadable metadata"),
    ("no meta", "meta.json: missing"),
    ("no tokens", ".u16: missing"),
    ("format_version=2", "format_version=2, this elastic reads 1"),
    ("format_version=true", "format_version=True"),
    ("format=\"other\"", "format='other'"),
    ("vocab_size=300", "vocab_size=300"),
    ("n_tokens=5", "n_tokens=5, but one token per source byte"),
    ("n_documents=-1", "n_documents=-1 must be an integer >= 0"),
    ("tokens_file=\"../x.u16\"", "tokens_file='../x.u16'"),
    ("sha256=\"abc\"", "sha256='abc'"),
])
def test_a_damaged_corpus_never_opens(tmp_path: Path, how: str, message: str) -> None:
    prepare_corpus(tmp_path, [_tree(tmp_path.parent / f"{tmp_path.name}-src")])
    _corrupt(tmp_path, how)
    with pytest.raises(CorpusError, match="elastic data prepare") as e:
        TokenCorpus.open(tmp_path, seq_len=4)
    assert message in str(e.value)


def test_changed_content_is_caught_by_verify(tmp_path: Path) -> None:
    meta = prepare_corpus(tmp_path, [_tree(tmp_path.parent / f"{tmp_path.name}-src")])
    tokens = tmp_path / meta.tokens_file
    raw = bytearray(tokens.read_bytes())
    raw[10] ^= 1
    tokens.write_bytes(bytes(raw))
    TokenCorpus.open(tmp_path, seq_len=4)  # same size, EOD at the end: only the checksum can tell
    with pytest.raises(CorpusError, match="does not match sha256"):
        TokenCorpus.open(tmp_path, seq_len=4, verify=True)


@pytest.mark.parametrize(("sources", "kwargs", "message"), [
    ("missing", {}, "--source {tmp}/missing: no such file or directory"),
    ("empty dir", {}, "--source {tmp}/empty dir: no files match '*.py'"),
    ("only empty", {}, "only empty files"),
    ("tree", {"max_bytes": 0}, "max_bytes=0: must be >= 1"),
    ("tree", {"max_bytes": 1.5}, "max_bytes=1.5"),
    ("tree", {"max_bytes": 50}, "smaller than the first file"),
    ("tree", {"pattern": ""}, "pattern=''"),
    ("none", {}, "sources=[]"),
    ("a string", {}, "give a list"),
])
def test_bad_preparation_input_is_refused_with_the_field(tmp_path: Path, sources: str, kwargs: dict,
                                                         message: str) -> None:
    (tmp_path / "empty dir").mkdir()
    (tmp_path / "only empty").mkdir()
    (tmp_path / "only empty" / "a.py").write_bytes(b"")
    given = {"none": [], "a string": str(tmp_path / "tree"), "tree": [_tree(tmp_path / "tree")]}.get(
        sources, [tmp_path / sources])
    with pytest.raises(CorpusError) as e:
        prepare_corpus(tmp_path / "out", given, **kwargs)
    assert message.format(tmp=tmp_path) in str(e.value)
    assert not (tmp_path / "out" / D.META_FILE).exists()


def test_output_that_is_a_file_is_refused(tmp_path: Path) -> None:
    (tmp_path / "f").write_text("x")
    with pytest.raises(CorpusError, match="exists and is not a directory"):
        prepare_corpus(tmp_path / "f", [_tree(tmp_path / "src")])


# --------------------------------------------------------------------------------------------
# reading
# --------------------------------------------------------------------------------------------


def test_samples_are_non_overlapping_windows_shifted_by_one(corpus: TokenCorpus) -> None:
    ids = [0, 5, len(corpus) - 1, 5]
    inputs, labels = corpus.samples(ids)
    assert inputs.shape == labels.shape == (4, SEQ) and inputs.dtype == torch.int64
    assert inputs.is_contiguous() and labels.is_contiguous()
    flat = np.asarray(corpus.tokens)
    for row, i in enumerate(ids):
        window = flat[i * (SEQ + 1):(i + 1) * (SEQ + 1)].astype(np.int64)
        assert inputs[row].tolist() == window[:-1].tolist() and labels[row].tolist() == window[1:].tolist()
        assert corpus.window(i).tolist() == window.tolist()
    with pytest.raises(IndexError, match="out of range"):
        corpus.samples([len(corpus)])
    with pytest.raises(IndexError, match="out of range"):
        corpus.window(-1)


def test_a_pickled_corpus_reopens_the_same_samples(corpus: TokenCorpus) -> None:
    again = pickle.loads(pickle.dumps(corpus))
    assert len(again) == len(corpus) and again.seq_len == corpus.seq_len
    assert torch.equal(again.samples([1, 2, 3])[0], corpus.samples([1, 2, 3])[0])


@pytest.mark.parametrize(("seq_len", "message"), [(0, "seq_len=0: must be >= 1"), (True, "seq_len=True"),
                                                  (10**9, "fewer than one window")])
def test_bad_seq_len_is_refused(corpus_dir: Path, seq_len: int, message: str) -> None:
    with pytest.raises(CorpusError) as e:
        TokenCorpus.open(corpus_dir, seq_len=seq_len)
    assert message in str(e.value)


def test_opening_a_missing_directory_says_how_to_create_it(tmp_path: Path) -> None:
    with pytest.raises(CorpusError, match=r"no such corpus directory; create it with `elastic data prepare "):
        TokenCorpus.open(tmp_path / "nope")


# --------------------------------------------------------------------------------------------
# schedule
# --------------------------------------------------------------------------------------------


def test_every_epoch_is_a_permutation_and_steps_cross_epochs_seamlessly() -> None:
    n, g = 37, 5
    stream = [i for step in range(3 * n // g + 1) for i in step_samples(step, g, n, seed=4)]
    epochs = [stream[e * n:(e + 1) * n] for e in range(3)]
    assert all(sorted(e) == list(range(n)) for e in epochs)
    assert epochs[0] != epochs[1] != epochs[2]
    for step in range(3 * n // g):
        first = step * g
        if first // n == (first + g - 1) // n:  # a step inside one epoch repeats nothing
            assert len(set(step_samples(step, g, n, seed=4))) == g


def test_the_permutation_is_a_bijection_for_every_size() -> None:
    for n in [*range(1, 70), 255, 256, 257, 4097]:
        assert sorted(D._permute(np.arange(n), n, seed=3, epoch=1).tolist()) == list(range(n))


def test_step_samples_depend_only_on_their_arguments() -> None:
    # pinned: a change here changes the data of every run, resumed ones included
    assert step_samples(0, 8, 1000, seed=0) == [495, 961, 616, 596, 824, 125, 265, 714]
    assert step_samples(7, 6, 37, seed=5) == [5, 6, 10, 35, 17, 15]
    before = step_samples(11, 7, 500, seed=9)
    torch.manual_seed(123)
    np.random.seed(123)
    random.seed(123)
    torch.rand(10)
    assert step_samples(11, 7, 500, seed=9) == before
    assert step_samples(11, 7, 500, seed=10) != before
    assert step_samples(12, 7, 500, seed=9) != before
    assert step_samples(np.int64(11), 7, 500, seed=9) == before


def test_huge_corpora_and_batches_larger_than_the_corpus() -> None:
    big = step_samples(10**12, 64, 2**40, seed=1)
    assert len(set(big)) == 64 and all(0 <= i < 2**40 for i in big)
    # G = 2.5 n: the step spans three epochs, every sample at most three times
    wide = step_samples(0, 25, 10)
    assert len(wide) == 25 and sorted(set(wide)) == list(range(10)) and max(map(wide.count, wide)) == 3
    assert step_samples(3, 4, 1) == [0, 0, 0, 0]


@pytest.mark.parametrize("global_batch", [12, 24])
@pytest.mark.parametrize("dp_size", [1, 2, 3, 4, 6])
@pytest.mark.parametrize("micro_batch_size", [1, 2, 3, 5, 24])
def test_every_layout_computes_each_sample_of_the_step_exactly_once(global_batch: int, dp_size: int,
                                                                    micro_batch_size: int) -> None:
    for step in (0, 3, 8):
        samples = step_samples(step, global_batch, 50, seed=2)
        per_rank = [D.rank_micro_batches(samples, r, dp_size, micro_batch_size) for r in range(dp_size)]
        assert [i for mbs in per_rank for mb in mbs for i in mb] == samples
        sizes = [[len(mb) for mb in mbs] for mbs in per_rank]
        # the same passes of the same sizes on every rank, none above the micro-batch size
        assert all(s == sizes[0] for s in sizes) and max(sizes[0]) <= micro_batch_size
        assert len(sizes[0]) == D.micro_batch_count(global_batch, dp_size, micro_batch_size)
        assert max(sizes[0]) - min(sizes[0]) <= 1


def _grad_of(model: torch.nn.Linear, loss: torch.Tensor) -> torch.Tensor:
    (g_w, g_b) = torch.autograd.grad(loss, (model.weight, model.bias))
    return torch.cat([g_w.reshape(-1), g_b])


def _mean_loss(model: torch.nn.Linear, inputs: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    # a tiny linear model over one-hot tokens; the mean over every label of the micro-batch
    x = torch.nn.functional.one_hot(inputs, D.VOCAB_SIZE).to(torch.float64)
    return ((model(x).squeeze(-1) - labels.to(torch.float64) / D.EOD_TOKEN) ** 2).mean()


@pytest.mark.parametrize("reduction", ["mean", "sum"])
@pytest.mark.parametrize(("dp_size", "micro_batch_size"), [(1, 12), (1, 5), (2, 6), (2, 4), (3, 1), (3, 3),
                                                           (4, 2), (6, 1), (6, 2)])
def test_weighted_rank_gradients_reduce_to_the_global_mean_loss_gradient(corpus: TokenCorpus, dp_size: int,
                                                                         micro_batch_size: int,
                                                                         reduction: str) -> None:
    g = 12
    gen = torch.Generator().manual_seed(0)
    model = torch.nn.Linear(D.VOCAB_SIZE, 1, dtype=torch.float64)
    with torch.no_grad():
        model.weight.copy_(torch.randn(model.weight.shape, generator=gen, dtype=torch.float64))
    # a step inside an epoch and one that crosses into the next
    for step in (1, len(corpus) // g):
        samples = step_samples(step, g, len(corpus), seed=7)
        want = _grad_of(model, _mean_loss(model, *corpus.samples(samples)))
        ranks, weights = [], 0.0
        for r in range(dp_size):
            grad = torch.zeros_like(want)
            for b in micro_batches(corpus, step, global_batch=g, dp_rank=r, dp_size=dp_size,
                                   micro_batch_size=micro_batch_size, seed=7, reduction=reduction):
                grad += _grad_of(model, _mean_loss(model, b.inputs, b.labels) * b.weight)
                weights += b.weight
            ranks.append(grad)
        reduced = torch.stack(ranks).sum(0) / (dp_size if reduction == "mean" else 1)
        torch.testing.assert_close(reduced, want, rtol=0, atol=1e-12)
        assert weights == pytest.approx(dp_size if reduction == "mean" else 1, abs=1e-12)


def test_resuming_from_a_step_gives_the_same_batches(corpus: TokenCorpus) -> None:
    def run(steps: range, source: TokenCorpus) -> list[tuple]:
        return [(s, b.sample_ids, b.inputs.tolist(), b.labels.tolist(), b.weight)
                for s in steps for b in micro_batches(source, s, global_batch=8, dp_rank=1, dp_size=2,
                                                       micro_batch_size=2, seed=3)]

    whole = run(range(0, 10), corpus)
    resumed = run(range(6, 10), pickle.loads(pickle.dumps(corpus)))
    assert resumed == whole[-len(resumed):] and len(resumed) == 4 * 2


def test_a_rank_sees_the_samples_its_block_names(corpus: TokenCorpus) -> None:
    batches = list(micro_batches(corpus, 4, global_batch=12, dp_rank=2, dp_size=3, micro_batch_size=3))
    samples = step_samples(4, 12, len(corpus))
    assert [i for b in batches for i in b.sample_ids] == samples[8:12]
    assert [len(b) for b in batches] == [2, 2] and all(b.weight == 3 * 2 / 12 for b in batches)
    for b in batches:
        assert torch.equal(b.inputs, corpus.samples(list(b.sample_ids))[0])


@pytest.mark.parametrize(("kwargs", "message"), [
    ({"step": -1}, "step=-1: must be >= 0"),
    ({"step": 1.5}, "step=1.5: give an integer"),
    ({"global_batch": 0}, "global_batch=0: must be >= 1"),
    ({"global_batch": 10, "dp_size": 4}, "global_batch=10 does not split over dp_size=4"),
    ({"global_batch": 2, "dp_size": 4}, "global_batch=2 does not split over dp_size=4"),
    ({"dp_rank": 4, "dp_size": 4}, "dp_rank=4 must lie in 0..3"),
    ({"dp_rank": -1}, "dp_rank=-1: must be >= 0"),
    ({"dp_size": 0}, "dp_size=0: must be >= 1"),
    ({"micro_batch_size": 0}, "micro_batch_size=0: must be >= 1"),
    ({"seed": "x"}, "seed='x'"),
    ({"reduction": "avg"}, "reduction='avg'"),
])
def test_bad_schedule_input_is_refused_at_the_call(corpus: TokenCorpus, kwargs: dict, message: str) -> None:
    args = {"step": 0, "global_batch": 12, "dp_rank": 0, "dp_size": 2, "micro_batch_size": 2, "seed": 0,
            **kwargs}
    step = args.pop("step")
    with pytest.raises(SpecError) as e:
        micro_batches(corpus, step, **args)  # not iterated: the call itself refuses
    assert message in str(e.value)


def test_an_empty_sample_source_is_refused() -> None:
    with pytest.raises(SpecError, match="n_samples=0: must be >= 1: the corpus has no sample"):
        step_samples(0, 4, 0)


# --------------------------------------------------------------------------------------------
# elastic data prepare
# --------------------------------------------------------------------------------------------


def _main(monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str], *args: str) -> tuple[int, str, str]:
    from elastic.cli import main

    monkeypatch.setattr(sys, "argv", ["elastic", *args])
    monkeypatch.setenv("COLUMNS", "400")
    try:
        main()
        code = 0
    except SystemExit as e:
        code = e.code if isinstance(e.code, int) else (0 if e.code is None else 1)
    out, err = capsys.readouterr()
    return code, out, err


def test_cli_prepare_prints_one_summary_line(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                             capsys: pytest.CaptureFixture[str]) -> None:
    src = _tree(tmp_path / "src")
    code, out, err = _main(monkeypatch, capsys, "data", "prepare", str(tmp_path / "c"), "--source", str(src / "sub"),
                           "--source", str(src / "a.py"), "--max-bytes", "1000")
    assert code == 0, err
    meta = TokenCorpus.open(tmp_path / "c", seq_len=4, verify=True).meta
    assert (meta.n_documents, meta.n_source_bytes) == (2, 150)
    assert out.strip().splitlines() == [f"corpus {tmp_path / 'c'}: 2 files, 152 tokens, 150 bytes, "
                                        f"sha256 {meta.sha256}"]
    code, out, err = _main(monkeypatch, capsys, "data", "prepare", str(tmp_path / "d"), "--source", str(src),
                           "--max-bytes", "350")
    assert code == 0 and out.strip().endswith("(2 files left out by --max-bytes)")


@pytest.mark.parametrize(("args", "message"), [
    (["--source", "{tmp}/missing"], "--source {tmp}/missing: no such file or directory"),
    (["--max-bytes", "0"], "max_bytes=0: must be >= 1 (--max-bytes: the cap on source bytes read)"),
    (["--source", "{tmp}", "--pattern", "*.nothing"], "--source {tmp}: no files match '*.nothing'; choose others with --pattern"),
])
def test_cli_bad_input_exits_2_with_one_line(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                            capsys: pytest.CaptureFixture[str], args: list[str],
                                            message: str) -> None:
    code, out, err = _main(monkeypatch, capsys, "data", "prepare", str(tmp_path / "c"),
                           *(a.format(tmp=tmp_path) for a in args))
    assert code == 2 and out == ""
    assert err.strip().splitlines() == [f"error: {message.format(tmp=tmp_path)}"]
    assert not (tmp_path / "c" / D.META_FILE).exists()


def test_cli_entry_point_reports_bad_input_without_a_traceback(tmp_path: Path) -> None:
    r = subprocess.run([sys.executable, "-c", "from elastic.cli import main; main()", "data", "prepare",
                        str(tmp_path / "c"), "--source", str(tmp_path / "missing")],
                       capture_output=True, text=True, timeout=300, cwd=ROOT, env={"COLUMNS": "400", "PATH": "/usr/bin"})
    assert r.returncode == 2 and "Traceback" not in r.stderr
    assert r.stderr.strip() == f"error: --source {tmp_path / 'missing'}: no such file or directory"


def test_cli_start_imports_neither_torch_nor_numpy() -> None:
    code = "import sys, elastic.cli; print([m for m in ('torch', 'numpy') if m in sys.modules])"
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, cwd=ROOT)
    assert r.returncode == 0, r.stderr
    assert r.stdout.strip() == "[]"


def test_cli_default_cap_is_the_library_default() -> None:
    from elastic.cli import data as cli_data

    assert cli_data._DEFAULT_MAX_BYTES == D.DEFAULT_MAX_BYTES
