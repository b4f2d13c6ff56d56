"""``elastic.torch.Manager`` with a local schedule: the user's own loop, rescaled in place.

The example Llama (float64, FSDP2 / TP / FSDP2 x TP from ``examples/llama/parallel.py``) is
trained on a real corpus (byte tokens of standard-library files, ``elastic.torch.data``) by a
plain user loop through FSDP4 -> FSDP2 x TP2 -> TP2 on two ranks (two leave) -> FSDP2 x TP2
on four (two join) -> FSDP3 on ranks whose order is permuted. Every step trains on exactly
the samples of a never-rescaled single process and its loss equals that process's to 1e-9;
the LR scheduler's state travels with the model. A ``build`` that raises on one rank abandons
that rescale on every rank: the job trains on in the old layout and still follows the curve.
Bad schedules are refused with the field named.
"""

from __future__ import annotations

import dataclasses
import sysconfig
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch

import tests.torch._layouts as L
from tests.reshard._mp import Pool, free_port

pytestmark = pytest.mark.slow

G = 12  # samples per step
STEPS_PER_LAYOUT = 2
SEQ = 32


def _cfg() -> Any:
    from examples.llama.model import LlamaConfig

    # 257 byte+EOD tokens, padded so that tp 2 divides the vocabulary
    return dataclasses.replace(LlamaConfig.tiny(), vocab=258, max_seq_len=SEQ)


def _schedule(kind: str) -> dict[int, Any]:
    from elastic.torch.manager import MeshLayout

    if kind == "single":
        return {0: MeshLayout.of([0], dp_shard=1)}
    layouts = [MeshLayout.of([0, 1, 2, 3], dp_shard=4, tp=1), MeshLayout.of([0, 1, 2, 3], dp_shard=2, tp=2),
               MeshLayout.of([1, 3], dp_shard=1, tp=2), MeshLayout.of([0, 1, 2, 3], dp_shard=2, tp=2),
               MeshLayout.of([2, 0, 3], dp_shard=3, tp=1)]
    return {i * STEPS_PER_LAYOUT: lay for i, lay in enumerate(layouts)}


def manager_job(rank: int, n: int, port: int, corpus_dir: str, kind: str, fail_build_at: int | None) -> dict:
    """``fail_build_at``: the step whose layout's first rank raises in ``build``."""
    import torch.distributed as dist

    from elastic.torch.data import TokenCorpus
    from elastic.torch.manager import Manager
    from examples.llama import parallel as par
    from examples.llama.model import Llama

    L.init(rank, n, port)
    try:
        schedule = _schedule(kind)
        built = []

        def build(world: Any) -> tuple:
            built.append(world.layout)
            model = Llama(_cfg()).to(torch.float64).init_weights(L.SEED)
            par.parallelize(model, world.mesh, loss_parallel=True)  # collective over the new mesh
            if (fail_build_at is not None and rank == world.layout.ranks[0] and world.layout == schedule[fail_build_at]
                    and built.count(world.layout) == [lay for s, lay in schedule.items() if s <= fail_build_at].count(
                        world.layout)):
                raise RuntimeError("out of memory on the new layout (simulated)")
            opt = torch.optim.AdamW(model.parameters(), lr=L.LR, weight_decay=0.1)
            sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1.0 / (1 + 0.1 * s))
            return model, opt, sched

        total = STEPS_PER_LAYOUT * 5
        mgr = Manager(build, global_batch=G, micro_batch_size=None, schedule=schedule, total_steps=total,
                      corpus=TokenCorpus.open(corpus_dir, seq_len=SEQ), seed=3)
        mgr.start()
        losses: dict[int, float] = {}
        samples: dict[int, list[int]] = {}
        lrs: dict[int, float] = {}
        for step in mgr.steps():
            model, opt = mgr.model, mgr.optimizer  # a rescale rebuilds them (a joiner's first)
            total_loss = torch.zeros((), dtype=torch.float64)
            mine: list[int] = []
            for batch in mgr.micro_batches(step):
                logits = model(batch.inputs)
                with par.loss_context(logits):
                    loss = par.loss_fn(logits, batch.labels)
                    (loss * batch.weight).backward()
                total_loss += par.unwrap_loss(loss).detach() * len(batch)
                mine += batch.sample_ids
            opt.step()
            opt.zero_grad()
            lrs[step] = opt.param_groups[0]["lr"]
            mgr.scheduler.step()
            w = mgr.world
            if w.dp_group is not None and w.dp_size > 1:
                dist.all_reduce(total_loss, group=w.dp_group)
                got: list[Any] = [None] * w.dp_size
                dist.all_gather_object(got, mine, group=w.dp_group)
                mine = [i for ids in got for i in ids]
            losses[step] = total_loss.item() / G
            samples[step] = sorted(mine)
            mgr.step_done(step)
        return {"losses": losses, "samples": samples, "lrs": lrs, "errors": mgr.errors,
                "records": [(r.step, r.role, r.done, r.bytes_moved, r.bytes_lower_bound) for r in mgr.records]}
    finally:
        dist.destroy_process_group()


@pytest.fixture(scope="module")
def corpus(tmp_path_factory: pytest.TempPathFactory) -> str:
    from elastic.torch.data import prepare_corpus

    out = tmp_path_factory.mktemp("corpus")
    stdlib = Path(sysconfig.get_paths()["stdlib"])
    prepare_corpus(out, [stdlib / "dataclasses.py", stdlib / "functools.py", stdlib / "textwrap.py"])
    return str(out)


@pytest.fixture(scope="module")
def pool() -> Iterator[Pool]:
    p = Pool(4)
    try:
        yield p
    finally:
        p.close()


@pytest.fixture(scope="module")
def reference(pool: Pool, corpus: str) -> dict:
    (out,) = pool.run(manager_job, 1, free_port(), corpus, "single", None, timeout=120)
    return out


def _merge(results: list[dict]) -> tuple[dict, dict, dict]:
    losses: dict[int, float] = {}
    samples: dict[int, list[int]] = {}
    lrs: dict[int, float] = {}
    for r in results:
        for s, v in r["losses"].items():
            assert abs(losses.setdefault(s, v) - v) <= 1e-12 * abs(v), f"step {s}: ranks disagree"
        for s, v in r["samples"].items():
            assert samples.setdefault(s, v) == v
        for s, v in r["lrs"].items():
            assert lrs.setdefault(s, v) == v
    return losses, samples, lrs


def _check_curve(results: list[dict], reference: dict) -> None:
    losses, samples, lrs = _merge(results)
    assert sorted(losses) == sorted(reference["losses"]) == list(range(STEPS_PER_LAYOUT * 5))
    for s, want in reference["losses"].items():
        assert abs(losses[s] - want) <= 1e-9 * abs(want), f"step {s}: {losses[s]!r} vs one process {want!r}"
        assert samples[s] == reference["samples"][s] and len(samples[s]) == G, f"step {s}: other samples"
        assert lrs[s] == reference["lrs"][s], f"step {s}: the LR scheduler did not travel"
    assert len({tuple(v) for v in samples.values()}) == len(samples), "steps repeat their samples"


def test_user_loop_rescaled_through_five_layouts_follows_one_process(pool: Pool, corpus: str,
                                                                     reference: dict) -> None:
    results = pool.run(manager_job, 4, free_port(), corpus, "chain", None, timeout=300)
    _check_curve(results, reference)
    roles = {r: [(step, role) for step, role, *_ in res["records"]] for r, res in enumerate(results)}
    assert roles[0] == [(2, "stays"), (4, "leaves"), (6, "joins"), (8, "stays")]
    assert roles[1] == [(2, "stays"), (4, "stays"), (6, "stays"), (8, "leaves")]
    for res in results:
        assert res["errors"] == []
        assert all(done and moved == bound for _, _, done, moved, bound in res["records"])


def test_a_build_that_raises_abandons_the_rescale_on_every_rank(pool: Pool, corpus: str, reference: dict) -> None:
    # rank 0's build of FSDP2 x TP2 on four (step 6) raises after the mesh's collectives: the job
    # stays on TP2 (ranks 1, 3) until FSDP3 at step 8
    results = pool.run(manager_job, 4, free_port(), corpus, "chain", 6, timeout=300)
    _check_curve(results, reference)
    for r, res in enumerate(results):
        assert len(res["errors"]) == 1 and "step 6" in res["errors"][0], (r, res["errors"])
        assert "out of memory on the new layout" in res["errors"][0]
    assert sorted(results[1]["losses"]) == list(range(8))  # on TP2 through steps 6, 7; leaves at 8
    assert sorted(results[0]["losses"]) == [0, 1, 2, 3, 8, 9]  # out from 4, back only at 8


def test_bad_schedules_are_refused_naming_the_field() -> None:
    from elastic.model import SpecError
    from elastic.torch.manager import MeshLayout

    cases = [
        (MeshLayout.of([0, 1, 2], dp_shard=2, tp=2), "4 positions but 3 ranks"),
        (MeshLayout.of([0, 0], dp_shard=2), "distinct ranks"),
        (MeshLayout.of([0, 5], dp_shard=2), "distinct ranks of the world"),
        (MeshLayout.of([1, 0], tp=2), "ranks along mesh dim 'tp' do not ascend"),
        (MeshLayout.of([0, 1, 2, 3], dp=2, dp_shard=2), "one data-parallel dim"),
    ]
    for lay, fragment in cases:
        with pytest.raises(SpecError, match="schedule\\[2\\]") as e:
            lay.check(4, "schedule[2]")
        assert fragment in str(e.value), (lay, str(e.value))
    MeshLayout.of([2, 0, 3, 1], dp_shard=4).check(4)  # a permuted data-parallel dim is fine
