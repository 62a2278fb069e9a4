"""The Python test guest: what it does comes from the run's config.

Config keys: ``epochs`` (reports, one an epoch; 2), ``fail_at`` (raise
ZeroDivisionError at that epoch unless resumed), ``checkpoint_every``
(report a checkpoint holding the epoch every n epochs; none). Every epoch
all-reduces a host tensor of the rank's number (mean) and reports it.

Hostile behaviour, before the first epoch, on the ranks listed in
``ranks`` (default every rank): ``alloc_mb`` (hold that many MiB),
``spin`` (loop forever), ``sleep_s`` (sleep that long), ``flood`` (print
that many bytes as fast as it can), ``escape`` (try ways out of the
sandbox; print how each ended, one line each), ``misuse`` (call kernels
wrongly; print how each call ended, one line each).
"""

import os
import time

import trainhost
from trainhost import Program, Tensor


def attempt(what, action):
    """Run one escape attempt and print how it ended."""
    try:
        result = action()
        print(f"{what}: allowed {result!r}")
    except trainhost.TrainhostError as e:
        print(f"{what}: refused by the host: {e}")
    except OSError as e:
        print(f"{what}: refused: {type(e).__name__}")
    except ValueError as e:
        print(f"{what}: refused by the SDK: {e}")


def misuse():
    a = Tensor.zeros([2, 3])
    b = Tensor.zeros([4, 5])
    out = Tensor.zeros([2, 5])
    attempt("gemm of mismatched shapes", lambda: out.gemm(1.0, a, b))
    attempt("dense of mismatched shapes", lambda: out.dense(a, b, None, "relu"))
    attempt("dense with an unknown activation", lambda: out.dense(a, Tensor.zeros([3, 5]), None, "gelu"))
    attempt("gather of a row past the end", lambda: a.gather_rows(Tensor.zeros([4, 3]), (0, 4)))
    attempt("labels past the classes", lambda: out.softmax_cross_entropy([0, 9], Tensor.zeros([2, 5])))
    attempt("all-reduce with an unknown op", lambda: Tensor.all_reduce_list([a], "prod"))
    params, velocity = [Tensor.zeros([2])], [Tensor.zeros([2]), Tensor.zeros([2])]
    attempt("sgd over lists of different lengths",
            lambda: Tensor.sgd_momentum_list(params, velocity, [Tensor.zeros([2])], 0.1, 0.9))
    program = Program()
    attempt("program of mismatched shapes", lambda: program.dense(out, a, b))
    program.gather_rows(a, Tensor.zeros([4, 3]))
    attempt("program run of too few rows", lambda: program.run([0]))


def escape():
    attempt("read /etc/passwd", lambda: open("/etc/passwd").read(10))
    attempt("list /", lambda: sorted(os.listdir("/")))
    attempt("read ../..", lambda: sorted(os.listdir(os.path.join(trainhost.scratch_dir(), "../.."))))
    ckpt = os.path.join(trainhost.scratch_dir(), "ckpt")
    os.makedirs(ckpt, exist_ok=True)
    attempt("symlink out", lambda: os.symlink("/etc", os.path.join(ckpt, "etc")))
    for path in [ckpt + "/../../etc", "/etc", "/"]:
        attempt(f"report {path}", lambda: trainhost.report({"loss": 1.0}, path))


def misbehave(cfg, rank):
    if rank not in cfg.get("ranks", [rank]):
        return
    held = None
    if "alloc_mb" in cfg:
        held = bytearray(cfg["alloc_mb"] << 20)
        print(f"allocated {len(held) >> 20} MiB")
    if cfg.get("spin"):
        while True:
            pass
    if "sleep_s" in cfg:
        time.sleep(cfg["sleep_s"])
    if "flood" in cfg:
        line = "x" * 1023
        for _ in range(cfg["flood"] // 1024):
            print(line)
    if cfg.get("escape"):
        escape()
    if cfg.get("misuse"):
        misuse()
    return held


@trainhost.entry
def train():
    cfg = trainhost.config()
    rank = trainhost.world_rank()
    held = misbehave(cfg, rank)
    start = 0
    restored = trainhost.get_checkpoint()
    if restored is not None:
        with open(os.path.join(restored, "epoch")) as f:
            start = int(f.read()) + 1
        print(f"rank {rank} resumes at epoch {start}")
    every = cfg.get("checkpoint_every")
    for epoch in range(start, cfg.get("epochs", 2)):
        if cfg.get("fail_at") == epoch and restored is None:
            print(1 / 0)
        t = Tensor.from_list([2], [float(rank), 1.0])
        t.all_reduce("mean")
        checkpoint = None
        if every and (epoch + 1) % every == 0:
            checkpoint = os.path.join(trainhost.scratch_dir(), "ckpt")
            os.makedirs(checkpoint, exist_ok=True)
            with open(os.path.join(checkpoint, "epoch"), "w") as f:
                f.write(str(epoch))
        trainhost.report(
            {"epoch": epoch, "mean_rank": t.to_list()[0], "ranks": trainhost.world_size()},
            checkpoint,
        )
