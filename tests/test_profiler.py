"""The profiler's host side on a CPU: a profiled step's timeline drawn from its stamps."""

from types import SimpleNamespace

import numpy as np


def test_timeline_png_draws_each_workers_tasks(tmp_path, monkeypatch):
    """One bar per finished task, coloured by op, one collection per worker (an artist per task took
    minutes on dsv2-lite's 38810 tasks); tasks that never ran (end stamp 0) are left out."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.collections import PolyCollection

    from megakernel import profiler
    labels = ["L0.attn.q_proj[0]", "L0.attn[0]", "L0.attn.q_proj[1]", "L0.mlp.down[0]", "L1.attn[0]"]
    queues = [[0, 1], [2, 3, 4]]
    stamps = np.array([[100, 110, 150, 3], [150, 160, 300, 3], [100, 100, 140, 7], [140, 200, 260, 7],
                       [260, 0, 0, 7]], dtype=np.int64)  # the last task never ran
    plan = SimpleNamespace(workers=2, task_labels=labels, queue=lambda w: queues[w])
    drawn, close = [], plt.close

    def look_then_close(fig):  # the figure as drawn, before the profiler closes it
        drawn.extend(c for ax in fig.axes for c in ax.collections if isinstance(c, PolyCollection))
        close(fig)
    monkeypatch.setattr(plt, "close", look_then_close)
    profiler._timeline_png(stamps, plan, 100, tmp_path / "t.png")
    assert (tmp_path / "t.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert [len(c.get_paths()) for c in drawn] == [2, 2]  # worker 0: both tasks; worker 1: the two that ran
    q_proj, attn, q_proj_again, down = (tuple(f) for c in drawn for f in c.get_facecolors())
    assert q_proj == q_proj_again and len({q_proj, attn, down}) == 3
