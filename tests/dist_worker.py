"""The program tests/test_distributed.py runs under `mpirun -n 2`: `python dist_worker.py MODE`.

match     10 SGD steps on 2 ranks (several buckets; with and without overlap; hierarchical) vs
          one process on the doubled batch; prints JSON from rank 0
compress  int8 compression on one repeated batch: losses, bytes sent vs float32, ranks identical; prints JSON
raise     rank 1 raises at step 3 (the job must end with its error)
nodes     under TILEFUSE_DIST_RANKS_PER_NODE=2 on 4 ranks (two "nodes"): the automatic
          hierarchical all-reduce, float32 and int8, vs one process; prints JSON from rank 0
hang      rank 1 stops at step 3 (rank 0 must time out: 3 s from step 3 on, once both compiled)
"""
import json
import sys
import time

import numpy as np

import tilefuse as tx
import tilefuse.numpy as tnp
import tilefuse.optim as optim
from tilefuse import distributed

SIZES = (12, 32, 32, 4)
BATCH = 8  # global


def init_params(seed):
    rng = np.random.default_rng(seed)
    return [{"w": (rng.standard_normal((a, b)) / np.sqrt(a)).astype(np.float32),
             "b": np.zeros(b, np.float32)} for a, b in zip(SIZES[:-1], SIZES[1:])]


def loss_fn(params, x, y):
    h = x
    for i, p in enumerate(params):
        h = h @ p["w"] + p["b"]
        if i < len(params) - 1:
            h = tnp.tanh(h)
    return tnp.mean((h - y) ** 2)


def batch(step):
    rng = np.random.default_rng(100 + step)
    x = rng.standard_normal((BATCH, SIZES[0])).astype(np.float32)
    return x, np.sin(x[:, :SIZES[-1]] * 2.0)


def flat(params):
    return np.concatenate([np.asarray(v).ravel() for v in tx.tree_leaves(params)])


def train(dp, params, steps, at_step3=None, data=batch):
    params, state = dp.init(params)
    losses = []
    for step in range(steps):
        if at_step3 is not None and step == 3:
            at_step3(dp.world)
        params, state, loss = dp.step(params, state, *data(step))
        losses.append(loss)
    return params, losses


def single_process(params, opt, steps):
    @tx.jit
    def step(params, state, x, y):
        loss, grads = tx.value_and_grad(loss_fn)(params, x, y)
        updates, state = opt.update(grads, state, params)
        return optim.apply_updates(params, updates), state, loss
    state = opt.init(params)
    for i in range(steps):
        params, state, _ = step(params, state, *batch(i))
    return params


def match():
    world = distributed.init(timeout=60)
    opt = optim.sgd(0.1, momentum=0.9)
    start = init_params(0)
    mine = tx.tree_map(lambda a: a + world.rank, start)  # rank 0's values must win the broadcast
    ref = flat(single_process(start, opt, 10))
    out = {}
    for name, kw in {"overlap": {}, "no_overlap": {"overlap": False},
                     "hierarchical": {"topology": "hierarchical"}}.items():
        dp = distributed.data_parallel(loss_fn, opt, bucket_mb=0.0005, **kw)
        params, losses = train(dp, mine, 10)
        dp.check_identical(params)
        out[name] = {"max_diff": float(np.max(np.abs(flat(params) - ref))), "buckets": dp.stats["buckets"],
                     "segments": dp.stats["segments"]}
    if world.rank == 0:
        print("RESULT " + json.dumps(out), flush=True)


def compress():
    world = distributed.init(timeout=60)
    opt = optim.sgd(0.1, momentum=0.9)
    out = {}
    for name, kw in {"float32": {}, "int8": {"compress": "int8"}}.items():
        dp = distributed.data_parallel(loss_fn, opt, bucket_mb=0.0005, **kw)
        params, losses = train(dp, init_params(0), 30, data=lambda step: batch(0))
        dp.check_identical(params)
        out[name] = {"losses": losses, "bytes_sent": dp.stats["bytes_sent"], "steps": dp.stats["steps"]}
    if world.rank == 0:
        print("RESULT " + json.dumps(out), flush=True)


def nodes():
    world = distributed.init(timeout=60)
    opt = optim.sgd(0.1, momentum=0.9)
    ref = flat(single_process(init_params(0), opt, 5))
    out = {"hierarchical": world.hierarchical, "nodes": world.nodes}
    for name, kw in {"float32": {}, "int8": {"compress": "int8"}}.items():
        dp = distributed.data_parallel(loss_fn, opt, bucket_mb=0.0005, **kw)
        params, losses = train(dp, init_params(0), 5)
        dp.check_identical(params)
        out[name] = {"max_diff": float(np.max(np.abs(flat(params) - ref))), "buckets": dp.stats["buckets"],
                     "bytes_sent": dp.stats["bytes_sent"], "node_bytes_sent": dp.stats["node_bytes_sent"]}
    if world.rank == 0:
        print("RESULT " + json.dumps(out), flush=True)


def fail(mode):
    dp = distributed.data_parallel(loss_fn, optim.sgd(0.1), timeout=60)

    def stop(world):
        world.timeout = 3
        if world.rank == 1 and mode == "raise":
            raise RuntimeError("boom on rank 1")
        if world.rank == 1:
            time.sleep(600)
    train(dp, init_params(0), 6, stop)


if __name__ == "__main__":
    mode = sys.argv[1]
    {"match": match, "compress": compress, "nodes": nodes}.get(mode, lambda: fail(mode))()
