"""Past one node (issue 30): two "nodes" on 127.0.0.1, each a `torchrun --nnodes 2 --node_rank i
--nproc_per_node 1` of its own (gloo), train exactly as one node with 2 ranks does — same per-step
metrics, same final weights — with the logs and the checkpoint written once for the run (global rank
0), a node-local --out-dir refused on every rank, and an error on node 1's rank ending node 0's
through the rendezvous store torch.distributed was initialised with (MASTER_ADDR:MASTER_PORT).

What differs from one node is only the launcher's env: RANK (global) vs LOCAL_RANK (0 on both
"nodes"), LOCAL_WORLD_SIZE 1 vs WORLD_SIZE 2 (nanorl/distributed.py init, local_world_size,
check_shared_dir). Every launch sits under a timeout; a hang kills every descendant.
"""
import json
import os
import subprocess
import sys

import pytest
from test_lockstep import FAILING
from test_multirank import launch, train_args

from nanorl.task import make_default
from nanorl.weight_broadcast import free_port

pytestmark = pytest.mark.slow  # the slow tier (README): CI runs it, `-m slow`

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
ENV = {**os.environ, "OMP_NUM_THREADS": "1"}


@pytest.fixture(scope="module")
def task(tmp_path_factory):
    return make_default(str(tmp_path_factory.mktemp("task")), seed=0)


def two_nodes(args_per_node: list[list[str]], port: int, timeout: int = 600) -> list[tuple[int, str]]:
    """Start node 0 and node 1 (one torchrun each, 1 process each) at once; (returncode, output) per
    node. A timeout kills both process trees, then fails."""
    import psutil
    procs = []
    for node, args in enumerate(args_per_node):
        cmd = [sys.executable, "-m", "torch.distributed.run", "--nnodes", "2", "--node_rank", str(node),
               "--nproc_per_node", "1", "--master_addr", "127.0.0.1", "--master_port", str(port), *args]
        procs.append(subprocess.Popen(cmd, cwd=REPO, env=ENV, stdout=subprocess.PIPE,
                                      stderr=subprocess.STDOUT,
                                      text=True))
    out = []
    try:
        for p in procs:
            out.append((p.communicate(timeout=timeout)[0], p.returncode))
    except subprocess.TimeoutExpired:
        for p in procs:
            if p.poll() is None:
                for q in [*psutil.Process(p.pid).children(recursive=True), psutil.Process(p.pid)]:
                    q.kill()
            p.communicate()
        raise
    return [(rc, text) for text, rc in out]


def metrics(out) -> dict[int, dict]:
    rows = [json.loads(x) for x in open(out / "metrics.jsonl") if '"train/loss"' in x]
    assert [r["step"] for r in rows] == [1, 2], rows  # logged once per step, not once per node
    return {r["step"]: {k: v for k, v in r.items() if not k.startswith("perf/")} for r in rows}


def weights(out, step: int = 2) -> dict:
    from safetensors.torch import load_file
    ckpt = out / "checkpoints"
    assert sorted(os.listdir(ckpt)) == [f"step_{step:06d}"], os.listdir(ckpt)  # one, whole, no leftovers
    files = sorted((ckpt / f"step_{step:06d}").glob("*.safetensors"))
    assert files
    return {k: v for f in files for k, v in load_file(str(f)).items()}


# ppo: a critic through the wrapper; --fsdp: sharded weights, DCP checkpoint written by ranks on both nodes
@pytest.mark.parametrize("extra", [["--algo", "grpo"], ["--algo", "ppo", "--fsdp"]])
def test_two_nodes_equal_one_node_with_two_ranks(task, tmp_path, extra):
    one, two = tmp_path / "one_node", tmp_path / "two_nodes"
    res = launch(*train_args(task, one, "--steps", "2", *extra), port=free_port())
    assert res.returncode == 0, res.stderr[-3000:]
    nodes = two_nodes([train_args(task, two, "--steps", "2", *extra)] * 2, port=free_port())
    for rc, text in nodes:
        assert rc == 0, text[-3000:]
    # rank 0 (node 0) prints the run's lines; node 1's rank logs nothing of its own
    assert "ranks in sync: parameters identical on 2 ranks" in nodes[0][1]
    assert "ranks in sync" not in nodes[1][1] and "accuracy after:" not in nodes[1][1]
    assert metrics(two) == metrics(one)  # bitwise, metric by metric
    a, b = weights(one), weights(two)
    assert sorted(a) == sorted(b)
    for k in a:
        assert a[k].equal(b[k]), k


def test_a_node_local_out_dir_is_refused_on_every_rank(task, tmp_path):
    """Node 1 passes a directory node 0 never wrote to (what a node-local disk looks like): both ranks
    stop at start-up with the same message, naming the rank that cannot see rank 0's files."""
    args = [train_args(task, tmp_path / "shared", "--steps", "1"),
            train_args(task, tmp_path / "local1", "--steps", "1")]
    nodes = two_nodes(args, port=free_port(), timeout=300)
    for rc, text in nodes:
        assert rc != 0
        assert "is not shared by every node (rank 1 on" in text, text[-3000:]


def test_an_error_on_node_1_ends_node_0(task, tmp_path):
    """fail_together across nodes: rank 1 (node 1) raises at step 1, rank 0 (node 0) learns it from the
    process group's store (hosted by node 0's launcher at MASTER_ADDR:MASTER_PORT) and stops with it."""
    script = tmp_path / "failing.py"
    script.write_text(FAILING.format(repo=REPO))
    args = [str(script), *train_args(task, tmp_path / "out", "--steps", "3")[1:]]
    nodes = two_nodes([args, args], port=free_port(), timeout=300)
    assert all(rc != 0 for rc, _ in nodes)
    assert "rank 1 failed: RuntimeError: planted failure" in nodes[1][1], nodes[1][1][-3000:]
    assert "rank 0 stops: rank 1 failed: RuntimeError: planted failure" in nodes[0][1] or \
        "rank 0 stopped because rank 1 failed: RuntimeError: planted failure" in nodes[0][1], \
        nodes[0][1][-3000:]


UNCHECKED = """
import sys
sys.path.insert(0, {repo!r})
import os
import train
from nanorl import distributed
distributed.check_shared_dir = lambda *a: None
if os.environ["RANK"] == "1":  # node 1's disk is not node 0's: rank 0's save directory is not there
    real = os.path.isdir
    os.path.isdir = lambda p: False if "/.tmp-step_" in str(p) else real(p)
train.main(sys.argv[1:])
"""


def test_a_checkpoint_rank_0_wrote_where_a_node_cannot_see_it_fails_clearly(task, tmp_path):
    """Past the start-up check (skipped here), checkpoint.save itself refuses a directory node 1 does not
    see, on every rank, instead of a manifest that silently lacks node 1's share of the hashes. One
    machine has one disk: node 1's blindness is simulated (os.path.isdir on its rank)."""
    script = tmp_path / "unchecked.py"
    script.write_text(UNCHECKED.format(repo=REPO))
    args = [[str(script), *train_args(task, tmp_path / "out", "--steps", "1")[1:]]] * 2
    nodes = two_nodes(args, port=free_port(), timeout=300)
    for rc, text in nodes:
        assert rc != 0
        assert "is not visible on rank 1: --out-dir must be shared" in text, text[-3000:]
    # nothing half-made: neither the step directory nor its temporary one
    assert os.listdir(tmp_path / "out" / "checkpoints") == []
