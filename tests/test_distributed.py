"""tilefuse.distributed under `mpirun -n 2`: each test launches tests/dist_worker.py on two ranks
(a tiny MLP, a few steps: the ranks share the machine's cores)."""
import json
import os
import subprocess
import time

import numpy as np
import pytest

pytest.importorskip("mpi4py", reason="tilefuse.distributed needs mpi4py (pip install 'tilefuse[dist]')")
from tilefuse import distributed  # noqa: E402

WORKER = os.path.join(os.path.dirname(os.path.abspath(__file__)), "dist_worker.py")


def _mpirun(mode: str, timeout: float = 300, ranks: int = 2, **env):
    try:
        cmd = distributed.mpirun_command(ranks, WORKER, mode)
    except distributed.DistributedError as e:
        pytest.skip(str(e))
    # containers often forbid the cross-process memory copy (ptrace); plain shared memory works
    env = dict(os.environ, OMPI_MCA_btl_sm_single_copy_mechanism="none", **env)
    t0 = time.perf_counter()
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, env=env)
    return proc, time.perf_counter() - t0


def _result(proc) -> dict:
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    line = next(ln for ln in proc.stdout.splitlines() if ln.startswith("RESULT "))
    return json.loads(line[len("RESULT "):])


def test_two_ranks_match_one_process_on_the_doubled_batch():
    # Rank 1 starts from other parameters: the broadcast from rank 0 must replace them. The
    # worker also checks the ranks end bit-identical (check_identical raises otherwise).
    out = _result(_mpirun("match")[0])
    for variant, r in out.items():
        assert r["buckets"] == 3 and r["segments"] == 3, (variant, r)
        assert r["max_diff"] < 1e-5, (variant, r)


def test_int8_compression_trains_with_a_quarter_of_the_bytes():
    out = _result(_mpirun("compress")[0])
    f32, i8 = out["float32"], out["int8"]
    assert np.mean(i8["losses"][-3:]) < 0.1 * i8["losses"][0]
    np.testing.assert_allclose(i8["losses"], f32["losses"], rtol=0.05, atol=2e-3)
    # int8 values plus one float32 scale per bucket and step (3 buckets, 30 steps)
    assert i8["bytes_sent"] == f32["bytes_sent"] // 4 + 3 * 30 * 4


def test_hierarchical_all_reduce_across_two_simulated_nodes():
    # 4 ranks grouped 2 by 2 as nodes: reduce within a node, exchange between the two leaders,
    # broadcast within the node; rank 0 is a leader, so it sends float32 or int8 between nodes
    out = _result(_mpirun("nodes", ranks=4, TILEFUSE_DIST_RANKS_PER_NODE="2")[0])
    assert out["hierarchical"] and out["nodes"] == 2
    f32, i8 = out["float32"], out["int8"]
    assert f32["max_diff"] < 1e-5, out
    assert i8["max_diff"] < 1e-2, out
    assert i8["bytes_sent"] == f32["bytes_sent"] // 4 + i8["buckets"] * 5 * 4
    assert i8["node_bytes_sent"] == f32["node_bytes_sent"] > 0


@pytest.mark.parametrize("mode, message", [
    ("raise", "RuntimeError: boom on rank 1"),
    ("hang", "rank 0: the gradient all-reduce did not complete within 3 s"),
])
def test_a_failing_rank_ends_the_job_with_its_error(mode, message):
    proc, seconds = _mpirun(mode, timeout=120)
    assert proc.returncode != 0
    assert message in proc.stderr, proc.stderr[-3000:]
    assert "aborting the job" in proc.stderr
    assert seconds < 60
