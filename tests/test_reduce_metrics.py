"""distributed.reduce_metrics over 2 gloo ranks that log different keys (a rank whose rows were all
skipped by --skip-zero-advantage logs no update metrics): no collective mismatch, each metric the mean
over the ranks that logged it, *_max the max."""
import torch.distributed as dist
import torch.multiprocessing as mp

from nanorl import distributed


def _rank(rank: int, init: str, out: dict) -> None:
    dist.init_process_group("gloo", init_method=init, rank=rank, world_size=2)
    try:
        mine = {"rollout/reward_mean": 1.0 + rank, "train/ratio_max": 3.0 - rank}
        if rank == 1:
            mine.update({"train/loss": 0.5, "train/pg_loss": 0.25})
        out[rank] = distributed.reduce_metrics(mine, 2)
    finally:
        dist.destroy_process_group()


def test_ranks_with_different_keys_reduce_to_one_line(tmp_path):
    out = mp.Manager().dict()
    ctx = mp.get_context("spawn")
    procs = [ctx.Process(target=_rank, args=(r, f"file://{tmp_path / 'store'}", out)) for r in range(2)]
    for p in procs:
        p.start()
    for p in procs:
        # a collective mismatch hangs or raises: never wait longer than this
        p.join(timeout=120)
        if p.is_alive():
            p.kill()
    assert all(p.exitcode == 0 for p in procs), [p.exitcode for p in procs]
    want = {"rollout/reward_mean": 1.5, "train/ratio_max": 3.0, "train/loss": 0.5, "train/pg_loss": 0.25}
    assert out[0] == out[1] == want
