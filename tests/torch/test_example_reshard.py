"""The README's "Reshard your own model" example runs as documented and keeps the loss curve.

``examples/reshard_own_model.py`` under ``torch.distributed.run`` on four gloo processes:
FSDP2 on four -> tensor parallel on two (two leave) -> FSDP2 on four (two join). Its losses
must be those of one process training the same model on the same batches without a reshard.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from torch import nn

pytestmark = pytest.mark.slow

ROOT = Path(__file__).resolve().parents[2]


def _one_process_losses(steps: int) -> list[float]:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(16, 64), nn.ReLU(), nn.Linear(64, 16))
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    out = []
    for step in range(steps):
        x = torch.randn(8, 16, generator=torch.Generator().manual_seed(step))
        loss = (model(x) - x.flip(1)).pow(2).mean()
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        out.append(loss.item())
    return out


def test_example_reshards_and_keeps_the_loss_curve(tmp_path: Path) -> None:
    env = {**os.environ, "GLOO_SOCKET_IFNAME": "lo", "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT)}
    proc = subprocess.run(
        [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "4", "--master-addr", "127.0.0.1",
         "--master-port", "0", "--rdzv-backend", "c10d", "--rdzv-endpoint", "127.0.0.1:0",
         # each rank's output to its own file: lines of four processes on one pipe can interleave
         "--log-dir", str(tmp_path / "logs"), "--redirects", "3",
         str(ROOT / "examples" / "reshard_own_model.py")],
        cwd=tmp_path, env=env, capture_output=True, text=True, timeout=240,
    )
    if proc.returncode != 0:  # each rank's own stderr says where it ended
        ranks = "".join(f"\n--- {f.relative_to(tmp_path)}\n{f.read_text()[-3000:]}"
                        for f in sorted((tmp_path / "logs").rglob("std*.log")))
        pytest.fail(f"exit {proc.returncode}\n{proc.stderr[-3000:]}{ranks}")
    out = {int(f.parent.name): f.read_text() for f in (tmp_path / "logs").rglob("stdout.log")}
    assert sorted(out) == [0, 1, 2, 3], sorted((tmp_path / "logs").rglob("*"))
    stdout = "".join(out[r] for r in range(4))
    losses = {int(m[1]): float(m[2]) for m in re.finditer(r"^step (\d+): loss ([\d.]+)$", out[0], re.M)}
    want = _one_process_losses(9)
    assert sorted(losses) == list(range(9))
    for step, got in losses.items():
        assert abs(got - want[step]) <= 1e-5, f"step {step}: {got} vs one process {want[step]:.6f}"
    roles = re.findall(r"^rank (\d) (stays|leaves|joins): (\w+) on \[[\d, ]+\], (\d+) bytes moved "
                       r"\(lower bound (\d+)\)", stdout, re.M)
    assert sorted((int(r), role, layout) for r, role, layout, _, _ in roles) == sorted(
        [(0, "stays", "tp"), (1, "stays", "tp"), (2, "leaves", "tp"), (3, "leaves", "tp"),
         (0, "stays", "fsdp"), (1, "stays", "fsdp"), (2, "joins", "fsdp"), (3, "joins", "fsdp")])
    assert all(moved == bound and int(moved) > 0 for *_, moved, bound in roles)
