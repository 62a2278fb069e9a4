"""The Python test guest: what it does comes from the run's config.

Config keys: ``epochs`` (reports, one an epoch; 2), ``fail_at`` (raise
ZeroDivisionError at that epoch unless resumed), ``checkpoint_every``
(report a checkpoint holding the epoch every n epochs; none). Every epoch
all-reduces a host tensor of the rank's number (mean) and reports it.
"""

import os

import trainhost
from trainhost import Tensor


@trainhost.entry
def train():
    cfg = trainhost.config()
    rank = trainhost.world_rank()
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
