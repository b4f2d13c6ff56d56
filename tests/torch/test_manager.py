"""``elastic.torch.Manager`` with a local schedule: the user's own loop, rescaled in place.

The example Llama (float64, FSDP2 / TP / FSDP2 x TP from ``examples/llama/parallel.py``) is
trained on a real corpus (byte tokens of standard-library files, ``elastic.torch.data``) by a
plain user loop through FSDP4 -> FSDP2 x TP2 -> TP2 on two ranks (two leave) -> FSDP2 x TP2
on four (two join) -> FSDP3 on ranks whose order is permuted. Every step trains on exactly
the samples of a never-rescaled single process and its loss equals that process's to 1e-9;
the LR scheduler's state travels with the model; every full tensor is bitwise the same before
and after each rescale. The job is ``examples/llama/byo.py`` (``make example-byo``). A
``build`` that raises on one rank abandons that rescale on every rank: the job trains on in
the old layout and still follows the curve.
Bad schedules are refused with the field named.
"""

from __future__ import annotations

import pytest

from examples.llama import byo
from tests.reshard._mp import Pool, free_port

pytestmark = pytest.mark.slow

G = byo.G


@pytest.fixture(scope="module")
def reference(pool: Pool, corpus: str) -> dict:
    (out,) = pool.run(byo.train, 1, free_port(), corpus, byo.SINGLE, timeout=120)
    return out


def _check_curve(results: list[dict], reference: dict) -> None:
    got = byo.merge(results)
    # ranks report the same loss bit for bit: the loss is all-reduced over the same group order
    assert got["conflicts"] == [], got["conflicts"][:5]
    losses, samples, lrs = got["losses"], got["samples"], got["lrs"]
    assert sorted(losses) == sorted(reference["losses"]) == list(range(byo.TOTAL_STEPS))
    for s, want in reference["losses"].items():
        assert abs(losses[s] - want) <= 1e-9 * abs(want), f"step {s}: {losses[s]!r} vs one process {want!r}"
        assert samples[s] == reference["samples"][s] and len(samples[s]) == G, f"step {s}: other samples"
        assert lrs[s] == reference["lrs"][s], f"step {s}: the LR scheduler did not travel"
    assert len({tuple(v) for v in samples.values()}) == len(samples), "steps repeat their samples"
    assert got["before"] and all(got["after"][s] == d for s, d in got["before"].items()), "a rescale changed state"


def test_user_loop_rescaled_through_five_layouts_follows_one_process(pool: Pool, corpus: str,
                                                                     reference: dict) -> None:
    results = pool.run(byo.train, 4, free_port(), corpus, byo.SCHEDULE, timeout=300)
    _check_curve(results, reference)
    report = byo.compare(results, reference, byo.SCHEDULE)
    assert report["state_bitwise_equal"] and report["samples_equal"] and report["lr_equal"], report
    assert report["rescales"] == 4 and report["max_loss_rel_diff"] <= 1e-9, report
    roles = {r: [(step, role) for step, role, *_ in res["records"]] for r, res in enumerate(results)}
    assert roles[0] == [(2, "stays"), (4, "leaves"), (6, "joins"), (8, "stays")]
    assert roles[1] == [(2, "stays"), (4, "stays"), (6, "stays"), (8, "leaves")]
    for res in results:
        assert res["errors"] == []
        assert all(done and moved == bound for _, _, done, moved, bound in res["records"])


def test_a_build_that_raises_abandons_the_rescale_on_every_rank(pool: Pool, corpus: str, reference: dict) -> None:
    # rank 0's build of FSDP2 x TP2 on four (step 6) raises after the mesh's collectives: the job
    # stays on TP2 (ranks 1, 3) until FSDP3 at step 8
    results = pool.run(byo.train, 4, free_port(), corpus, byo.SCHEDULE, byo.TOTAL_STEPS, 6, timeout=300)
    _check_curve(results, reference)
    for r, res in enumerate(results):
        assert len(res["errors"]) == 1 and "step 6" in res["errors"][0], (r, res["errors"])
        assert "out of memory on the new layout" in res["errors"][0]
    assert sorted(results[1]["losses"]) == list(range(8))  # on TP2 through steps 6, 7; leaves at 8
    assert sorted(results[0]["losses"]) == [0, 1, 2, 3, 8, 9]  # out from 4, back only at 8


def test_a_model_with_other_keys_abandons_the_rescale(pool: Pool, corpus: str, reference: dict) -> None:
    # at step 8 every rank builds a model with a third block: the reshard refuses on every rank
    # before a byte moves, and the job trains on in FSDP2 x TP2 on four
    results = pool.run(byo.train, 4, free_port(), corpus, byo.SCHEDULE, byo.TOTAL_STEPS, 8, "keys", timeout=300)
    _check_curve(results, reference)
    for r, res in enumerate(results):
        assert len(res["errors"]) == 1 and "step 8" in res["errors"][0], (r, res["errors"])
        assert "no worker's old state holds" in res["errors"][0] and "layers.2." in res["errors"][0]
    assert sorted(results[1]["losses"]) == list(range(10))


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
