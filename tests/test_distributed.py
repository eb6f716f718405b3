"""Two CPU processes (gloo) give the same statistics and operators as one, and agree on the memory budget."""

from __future__ import annotations

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from conftest import free_port, random_batches, tiny_model

from ghostlayers.calibration import memory
from ghostlayers.calibration.passes import calibrate
from ghostlayers.numerics import fitting


def _worker(rank: int, world: int, init: str, out: str) -> None:
    dist.init_process_group("gloo", init_method=init, rank=rank, world_size=world)
    try:
        model = tiny_model("llama").double()
        cal = calibrate(model, random_batches(num=5), [(2, 4)], progress=False)
        if rank == 0:
            torch.save(
                {
                    "w": fitting.fit("ghost", cal.pairs[(2, 4)]),
                    "lp": fitting.fit("linearpatch-rotate", cal.pairs[(2, 4)]),
                    "count": cal.pairs[(2, 4)].count,
                    "sequences": cal.pairs[(2, 4)].sequences,
                    "cos": cal.similarity.cosine,
                },
                out,
            )
    finally:
        dist.destroy_process_group()


def test_two_processes_match_one(tmp_path):
    out = tmp_path / "rank0.pt"
    mp.spawn(_worker, args=(2, f"file://{tmp_path / 'init'}", str(out)), nprocs=2, join=True)
    got = torch.load(out)
    cal = calibrate(tiny_model("llama").double(), random_batches(num=5), [(2, 4)], progress=False)
    expected = fitting.fit("ghost", cal.pairs[(2, 4)])
    assert float(got["count"]) == float(cal.pairs[(2, 4)].count) == 5 * 2 * 16
    assert float((got["w"] - expected).norm() / expected.norm()) < 1e-6
    # LinearPatch's per-sequence ratios and their count add across processes like the token sums
    assert float(got["sequences"]) == 5 * 2
    torch.testing.assert_close(got["lp"], fitting.fit("linearpatch-rotate", cal.pairs[(2, 4)]), rtol=1e-9, atol=1e-12)
    torch.testing.assert_close(got["cos"], cal.similarity.cosine, rtol=0, atol=1e-12, equal_nan=True)


def _budget_worker(rank: int, world: int, init: str, out: str) -> None:
    dist.init_process_group("gloo", init_method=init, rank=rank, world_size=world)
    try:
        memory.free_memory = lambda device: ((rank + 1) * 2**30, "free RAM")  # rank 1 has more free
        torch.save(memory.stats_budget(torch.device("cpu"), None), f"{out}.{rank}")
    finally:
        dist.destroy_process_group()


def test_ranks_take_the_smallest_free_memory(tmp_path):
    """Every rank gets the same budget, so all take the same route (else the all-reduce would hang)."""
    out = tmp_path / "budget"
    mp.spawn(_budget_worker, args=(2, f"file://{tmp_path / 'init'}", str(out)), nprocs=2, join=True)
    assert [torch.load(f"{out}.{rank}") for rank in range(2)] == [(2**29, "half of free RAM")] * 2


def test_a_rank_whose_peers_never_come_stops_with_one_error(model_folder, tmp_path):
    """``WORLD_SIZE=2 RANK=0`` with a master address but no second process: one error line naming the
    variables once ``$GHOSTLAYERS_RENDEZVOUS_TIMEOUT`` has passed, not a wait forever, and no folder or lock."""
    import os
    import subprocess
    import sys

    env = dict(os.environ, WORLD_SIZE="2", RANK="0", LOCAL_RANK="0", MASTER_ADDR="127.0.0.1",
               MASTER_PORT=str(free_port()), GHOSTLAYERS_RENDEZVOUS_TIMEOUT="3")  # fmt: skip
    out = tmp_path / "out"
    args = ["prune", "--model", str(model_folder), "--calibration", str(tmp_path / "calib.txt"), "--layers", "2:4",
            "--num-samples", "6", "--seq-len", "16", "--output", str(out)]  # fmt: skip
    done = subprocess.run([sys.executable, "-m", "ghostlayers", *args], env=env, capture_output=True, text=True,
                          timeout=300)  # fmt: skip
    assert done.returncode == 2, done.stderr[-2000:]
    flat = " ".join(done.stderr.split())
    assert flat.count("error:") == 1 and "did not join within 3 s" in flat and "MASTER_ADDR" in flat, flat
    assert not out.exists() and not list(tmp_path.glob(".out.ghostlayers-*"))
