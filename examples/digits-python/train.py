"""Data-parallel training of a digit classifier, in Python on host kernels.

The same training as ``examples/digits-mlp`` with ``"kernels": true``:
the UCI handwritten digits (1797 images of 8x8 pixels, built into the
guest), a multilayer perceptron (64 -> ``hidden`` ReLU units -> 10),
softmax cross-entropy, SGD with momentum. Every rank holds the same model
in host tensors; each global minibatch of ``batch_size`` images is dealt out
to the ranks (rank r takes every ``world_size``-th image from the r-th on),
the gradient sums are all-reduced in one round and divided by the batch
size, so every rank takes the same step whatever the number of ranks. The
images go to the host once, as one tensor, and each minibatch is gathered
there (``gather_rows``); a layer's forward and backward pass and the
optimizer step are one kernel each (``dense``, ``dense_backward``,
``sgd_momentum_list``), and the step's kernels are recorded once as a
``Program`` and run with one call a step. The maths and the data's bytes
stay in the host at native speed, and Python only orchestrates.

Data split, initial weights, data order, kernels and files are those of the
Rust example, so the two reach the same parameters bit for bit, and each can
resume the other's checkpoints (``model.safetensors``,
``optimizer.safetensors``, ``state.json``).

Config (all optional): ``num_epochs`` (30), ``hidden`` (64), ``batch_size``
(32), ``lr`` (0.1), ``momentum`` (0.9), ``seed`` (0), ``checkpoint_every``
(5), ``validation_per_mille`` (200), ``fail_at_epoch`` (none: the last rank
raises at that epoch unless the run resumed), ``bench_steps`` (none: time
that many steps on the first batch and report ``step_seconds``).
"""

import json
import os
import shutil
import struct
import sys
import time

import trainhost
from trainhost import Program, Tensor

PIXELS = 64
CLASSES = 10
MASK = (1 << 64) - 1


def _read_digits():
    """The images (scaled to [0, 1]) and labels of digits.csv, found on
    the Python path (the build's ``-p examples/digits-mlp/data``). This runs
    when the component is built: the data are frozen into the guest."""
    found = [os.path.join(d, "digits.csv") for d in sys.path]
    found = [p for p in found if os.path.isfile(p)]
    if not found:
        raise FileNotFoundError(
            "digits.csv is not on the Python path; build with -p examples/digits-mlp/data")
    path = found[0]
    images, labels = [], []
    with open(path) as f:
        for n, line in enumerate(f, 1):
            values = [int(v) for v in line.split(",")]
            if len(values) != PIXELS + 1 or not 0 <= values[PIXELS] < CLASSES:
                raise ValueError(f"digits.csv line {n}: not 64 pixels and a digit")
            images.append([v / 16.0 for v in values[:PIXELS]])
            labels.append(values[PIXELS])
    return images, labels


IMAGES, LABELS = _read_digits()
PIXELS_FLAT = [p for image in IMAGES for p in image]


class Rng:
    """xorshift64*, the generator of the Rust example."""

    def __init__(self, seed):
        self.state = ((seed * 0x9E3779B97F4A7C15) & MASK) | 1

    def next(self):
        s = self.state
        s ^= s >> 12
        s ^= (s << 25) & MASK
        s ^= s >> 27
        self.state = s
        return (s * 0x2545F4914F6CDD1D) & MASK

    def symmetric(self):
        """Uniform in [-1, 1), exact in f32."""
        return (self.next() >> 40) / float(1 << 23) - 1.0


def permutation(n, seed):
    """Fisher-Yates on xorshift: the same on every rank and in every run."""
    rng = Rng(seed)
    order = list(range(n))
    for i in range(n - 1, 0, -1):
        j = rng.next() % (i + 1)
        order[i], order[j] = order[j], order[i]
    return order


def f32(x):
    """``x`` rounded to the nearest f32, as the Rust example computes it."""
    return struct.unpack("<f", struct.pack("<f", x))[0]


def split(seed, validation_per_mille):
    """Indexes of the training and validation images."""
    order = permutation(len(LABELS), seed)
    held_out = len(LABELS) * validation_per_mille // 1000
    return order[held_out:], order[:held_out]


NAMES = ("w1", "b1", "w2", "b2")


def shapes(hidden):
    return {"w1": [PIXELS, hidden], "b1": [hidden], "w2": [hidden, CLASSES], "b2": [CLASSES]}


def initial(hidden, seed):
    """Uniform Glorot weights and zero biases, as the Rust example draws them."""
    rng = Rng(seed ^ 0x5EED)
    params = {}
    for name, shape in shapes(hidden).items():
        n = shape[0] * (shape[1] if len(shape) > 1 else 1)
        if name.startswith("w"):
            bound = f32(f32(6.0 / (shape[0] + shape[1])) ** 0.5)
            params[name] = Tensor.from_list(shape, [bound * rng.symmetric() for _ in range(n)])
        else:
            params[name] = Tensor.zeros(shape)
    return params


class Model:
    """Parameters, momentum and gradients in host tensors, and the
    programs of the steps taken so far."""

    def __init__(self, hidden, params, velocity):
        self.hidden = hidden
        self.params = [params[n] for n in NAMES]
        self.velocity = [velocity[n] for n in NAMES]
        self.grads = [Tensor.zeros(p.shape) for p in self.params]
        # (rows, batch, lr, momentum) -> the program of such a step and the
        # activations it writes: a full batch, the last one, validation.
        self.steps = {}

    @staticmethod
    def load(directory, hidden):
        """The model of a checkpoint written by ``save`` (or by the Rust
        example), read by the host."""
        found = []
        for file in ("model.safetensors", "optimizer.safetensors"):
            path = os.path.join(directory, file)
            tensors = Tensor.load(path)
            for name, shape in shapes(hidden).items():
                if name not in tensors or tensors[name].shape != shape:
                    raise ValueError(f"{path}: no tensor {name} of shape {shape}")
            found.append(tensors)
        return Model(hidden, *found)

    def save(self, directory):
        Tensor.save(os.path.join(directory, "model.safetensors"), dict(zip(NAMES, self.params)))
        Tensor.save(os.path.join(directory, "optimizer.safetensors"), dict(zip(NAMES, self.velocity)))

    def record(self, images, rows, batch, lr, momentum):
        """The program of a step over ``rows`` images: gathered, one call a
        layer each way, the loss; for training (``batch`` not None) the
        gradients, their all-reduce and the SGD step too."""
        x = Tensor.zeros([rows, PIXELS])
        h = Tensor.zeros([rows, self.hidden])
        z = Tensor.zeros([rows, CLASSES])
        dz = Tensor.zeros([rows, CLASSES])
        dh = Tensor.zeros([rows, self.hidden])
        w1, b1, w2, b2 = self.params
        p = Program()
        p.gather_rows(x, images)
        p.dense(h, x, w1, b1, "relu")
        p.dense(z, h, w2, b2)
        p.softmax_cross_entropy(z, LABELS, dz)
        if batch is not None:
            gw1, gb1, gw2, gb2 = self.grads
            p.dense_backward(dz, h, w2, gw2, gb2, grad_x=dh, x_f="relu")
            p.dense_backward(dh, x, w1, gw1, gb1)
            p.all_reduce_list(self.grads, "sum")
            p.sgd_momentum_list(self.params, self.velocity, self.grads, lr, momentum,
                                grad_scale=1.0 / batch)
        return p, (x, h, z, dz, dh)

    def run(self, images, indexes, batch=None, lr=0.0, momentum=0.0):
        """Run the program of this kind of step (recorded at its first);
        returns the loss and the correct predictions over ``indexes``."""
        key = (len(indexes), batch, lr, momentum)
        found = self.steps.get(key)
        if found is None:
            found = self.steps[key] = self.record(images, len(indexes), batch, lr, momentum)
        [(loss, correct)] = found[0].run(indexes)
        return loss, correct

    def evaluate(self, images, indexes):
        """The loss and the correct predictions over ``indexes``."""
        return self.run(images, indexes)

    def step(self, images, batch, rank, world, lr, momentum):
        """This rank's share of ``batch``, the gradients summed over the
        ranks in one all-reduce, and one SGD step along their mean."""
        share = batch[rank::world]
        if share:
            return self.run(images, share, len(batch), lr, momentum)
        for g in self.grads:
            g.scale(0.0)
        Tensor.all_reduce_list(self.grads, "sum")
        Tensor.sgd_momentum_list(self.params, self.velocity, self.grads, lr, momentum,
                                 grad_scale=1.0 / len(batch))
        return 0.0, 0

    def digest(self):
        """The parameters' bits, to check that every rank holds the same."""
        flat = [x for p in self.params for x in p.to_list()]
        return struct.pack(f"<{len(flat)}f", *flat)


DEFAULTS = {
    "num_epochs": 30, "hidden": 64, "batch_size": 32, "lr": 0.1, "momentum": 0.9,
    "seed": 0, "checkpoint_every": 5, "validation_per_mille": 200,
    "fail_at_epoch": None, "bench_steps": None,
}


def settings():
    """The run's config over the defaults; unknown keys are refused."""
    given = trainhost.config()
    unknown = sorted(set(given) - set(DEFAULTS))
    if unknown:
        raise ValueError(f"unknown config keys {unknown}; the keys are {sorted(DEFAULTS)}")
    cfg = dict(DEFAULTS, **given)
    if cfg["batch_size"] < 1 or cfg["hidden"] < 1 or cfg["checkpoint_every"] < 1:
        raise ValueError("batch_size, hidden and checkpoint_every must be at least 1")
    if not 0 <= cfg["validation_per_mille"] < 1000:
        raise ValueError("validation_per_mille must be below 1000")
    return cfg


@trainhost.entry
def train():
    cfg = settings()
    rank, world = trainhost.world_rank(), trainhost.world_size()
    hidden, seed = cfg["hidden"], cfg["seed"]
    training, validation = split(seed, cfg["validation_per_mille"])

    restored = trainhost.get_checkpoint()
    start = 0
    if restored is not None:
        with open(os.path.join(restored, "state.json")) as f:
            state = json.load(f)
        if state["hidden"] != hidden:
            raise ValueError(
                f"the checkpoint has {state['hidden']} hidden units and the config asks for "
                f"{hidden}; resume with \"hidden\": {state['hidden']}")
        model = Model.load(restored, hidden)
        start = state["epoch"] + 1
        if rank == 0:
            print(f"resuming after epoch {state['epoch']}")
    else:
        params = initial(hidden, seed)
        model = Model(hidden, params, {n: Tensor.zeros(p.shape) for n, p in params.items()})

    # Every image, in the host: minibatches are gathered there.
    images = Tensor.from_list([len(LABELS), PIXELS], PIXELS_FLAT)
    lr, momentum, size = cfg["lr"], cfg["momentum"], cfg["batch_size"]
    if cfg["bench_steps"] is not None:
        batch = training[:size]
        model.step(images, batch, rank, world, lr, momentum)
        started = time.perf_counter()
        for _ in range(cfg["bench_steps"]):
            model.step(images, batch, rank, world, lr, momentum)
        per_step = (time.perf_counter() - started) / max(cfg["bench_steps"], 1)
        trainhost.report({"step_seconds": per_step})
        return

    for epoch in range(start, cfg["num_epochs"]):
        if cfg["fail_at_epoch"] == epoch and restored is None and rank + 1 == world:
            raise RuntimeError(f"injected failure at epoch {epoch} (fail_at_epoch)")
        started = time.perf_counter()
        order = permutation(len(training), (seed + 1 + epoch) & MASK)
        loss = correct = 0
        for at in range(0, len(order), size):
            batch = [training[k] for k in order[at:at + size]]
            l, c = model.step(images, batch, rank, world, lr, momentum)
            loss += l
            correct += c
        seconds = time.perf_counter() - started
        val_loss, val_correct = model.evaluate(images, validation[rank::world])
        totals = trainhost.all_reduce([loss, correct, val_loss, val_correct], "sum", "f64")
        train_loss, train_correct, val_loss, val_correct = totals
        digests = trainhost.all_gather(model.digest())
        if any(d != digests[0] for d in digests):
            raise RuntimeError(f"the ranks' parameters differ after epoch {epoch}")

        n, v = len(training), len(validation)
        metrics = {
            "epoch": epoch,
            "train_loss": train_loss / n,
            "train_accuracy": train_correct / n,
            "val_loss": val_loss / v,
            "val_accuracy": val_correct / v,
            "samples_per_second": n / seconds,
        }
        if rank == 0:
            print(f"epoch {epoch}: train loss {train_loss / n:.4f}, validation loss "
                  f"{val_loss / v:.4f}, accuracy {100 * val_correct / v:.2f}%")
        last = epoch + 1 == cfg["num_epochs"]
        due = (epoch + 1) % cfg["checkpoint_every"] == 0 or last

        def save():
            # Every rank holds the same model: rank 0 saves it.
            if rank != 0:
                return None
            directory = os.path.join(trainhost.scratch_dir(), "checkpoint")
            shutil.rmtree(directory, ignore_errors=True)
            os.makedirs(directory)
            model.save(directory)
            with open(os.path.join(directory, "state.json"), "w") as f:
                json.dump({"epoch": epoch, "hidden": hidden, "world_size": world}, f)
            return directory

        trainhost.report(metrics, save() if due else None)
        # Preemption turns true on every rank after the same report.
        if trainhost.preemption_requested():
            if not due:
                trainhost.report(metrics, save())
            if rank == 0:
                print(f"preempted after epoch {epoch}; its checkpoint is committed")
            return
