"""The demo's timeline plot: the training layout strip names each stretch only where the name fits,
so no two names overlap however often the job rescales, and its legend names every layout."""

from __future__ import annotations

import itertools

from elastic.demo.report import _figure, _plot, layout_segments
from elastic.demo.samples import DemoRun, Sample
from elastic.model import Layout


def _run(layouts: list[tuple[float, str | None]], warmup: float = 40.0) -> DemoRun:
    """Samples every second from ``-warmup`` on; ``layouts``: (from second, layout) in order."""
    run = DemoRun(warmup=warmup)
    end = layouts[-1][0] + 30
    t = 0.0
    while t - warmup <= end:
        day = t - warmup
        lay = [x for a, x in layouts if a <= day][-1] if day >= layouts[0][0] else layouts[0][1]
        gpus = int(lay.split(".dp")[1].split(".")[0]) if lay else 0
        run.samples.append(Sample(t=t, rate=5.0, replicas=8 - max(gpus, 1), inference_busy=1.0, training_gpus=gpus,
                                  training_busy=gpus, layout=Layout.parse(lay) if lay else None, step=int(t), loss=1.0,
                                  tokens_per_second=1.0))
        t += 1.0
    return run


def test_segments_follow_the_layout_and_leave_out_stretches_without_one() -> None:
    run = _run([(-40, "tp1.pp1.dp7.z1"), (10, "tp1.pp1.dp6.z1"), (20, None), (25, "tp1.pp2.dp1")])
    assert [(a, b, str(lay)) for a, b, lay in layout_segments(run)] == [
        (-40.0, 10.0, "tp1.pp1.dp7.z1"), (10.0, 20.0, "tp1.pp1.dp6.z1"), (25.0, 55.0, "tp1.pp2.dp1")]


def test_no_two_layout_names_overlap_and_each_sits_in_its_stretch(tmp_path) -> None:
    # a busy day: a rescale every 2-3 s in the evening, long stretches at night
    flips = [(float(a), lay) for a, lay in zip(range(0, 300, 2), itertools.cycle(
        ["tp1.pp1.dp3.z1", "tp1.pp2.dp1", "tp1.pp1.dp4.z1", "tp1.pp1.dp5.z1"]), strict=False)]
    run = _run([(-40, "tp1.pp1.dp7.z1"), *flips, (320, "tp1.pp1.dp7.z1")])
    fig = _figure(run)
    strip = fig.axes[1]
    renderer = fig.canvas.get_renderer()
    segments = layout_segments(run)
    names = [x for x in strip.texts if x.get_text()]
    boxes = [x.get_window_extent(renderer) for x in names]
    assert names, "the long stretches carry their names"
    for (i, a), (j, b) in itertools.combinations(enumerate(boxes), 2):
        assert not a.overlaps(b), (names[i].get_text(), names[j].get_text())
    for text, box in zip(names, boxes, strict=True):
        x = text.get_position()[0]
        a, b, lay = next(s for s in segments if s[0] <= x <= s[1])
        left, right = (strip.transData.transform((v, 0.5))[0] for v in (a, b))
        assert text.get_text() == str(lay) and left <= box.x0 and box.x1 <= right
    legend = [t.get_text() for t in strip.get_legend().get_texts()]
    assert legend == list(dict.fromkeys(str(lay) for _, _, lay in segments))
    _plot(run, str(tmp_path / "t.png"), None, None)
    assert (tmp_path / "t.png").stat().st_size > 10_000
