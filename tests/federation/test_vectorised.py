"""The vectorised trainer (--client-batch K) against the sequential one: the batched SGD
step against torch.optim.SGD, the step plan against train_client's batches, every supported
method's trained states, unequal client sizes (hypothesis), and what it refuses."""

from __future__ import annotations

import pytest
import torch
from hypothesis import example, given, settings
from hypothesis import strategies as st
from torch import nn

from privfedcal.algorithms import ALGORITHMS, create_algorithm
from privfedcal.algorithms._proximal import ProximalLoss
from privfedcal.algorithms.algorithm import Algorithm
from privfedcal.algorithms.vector_loss import VectorLoss
from privfedcal.errors import UsageError
from privfedcal.experiment import build_experiment
from privfedcal.federation.local import LocalSpec, clone_state
from privfedcal.federation.vector_losses import vector_loss_of
from privfedcal.federation.vectorised import (
    StackedSGD,
    VectorisedTrainer,
    check_vectorisable,
    client_steps,
    stack_clients,
)
from privfedcal.federation.workers import InProcessTrainer, TrainJob
from privfedcal.models import create_model
from privfedcal.seeding import make_generator
from privfedcal.settings.run_config import RunConfig
from privfedcal.settings.sections import DataSettings, TrainingSettings

ATOL, RTOL = 2e-5, 1e-4  # float32: sums in another order differ in the last bits
#: every registered method the vectorised trainer can train
VECTORISABLE = sorted(n for n in ALGORITHMS.names() if vector_loss_of(ALGORITHMS.get(n)))


# ---- the batched SGD step ---------------------------------------------------------------
@pytest.mark.parametrize("fused,layout", [(False, "contiguous"), (True, "contiguous"),
                                          (True, "transposed")])
@pytest.mark.parametrize("momentum,weight_decay", [(0.0, 0.0), (0.9, 0.0), (0.9, 1e-2),
                                                   (0.0, 1e-2)])
def test_stacked_sgd_is_torch_sgd_per_client(momentum, weight_decay, fused, layout):
    """Three clients with their own gradients; client 2 stops after 1 step, client 1 after
    3: each one's parameters are torch.optim.SGD's on its gradients, and a stopped client
    no longer moves. The matrix's gradient comes as a transposed view (as autograd returns
    it): with a contiguous stack it takes the op-by-op path, with a transposed one the
    fused kernel."""
    g = torch.Generator().manual_seed(0)
    shapes = [(4, 3), (3,)]
    start = [torch.randn(3, *s, generator=g) for s in shapes]
    grads = [[torch.randn(3, *s, generator=g) for s in shapes] for _ in range(4)]
    active = [3, 2, 2, 1]  # clients still training at each step (a prefix)
    stacked = [p.clone() for p in start]
    if layout == "transposed":  # the matrix stored as stack_clients lays it out
        stacked[0] = stack_clients(start[0][0], 3)
        stacked[0].copy_(start[0])
        assert stacked[0].stride() == (12, 1, 4)
    opt = StackedSGD(stacked, lr=0.1, momentum=momentum, weight_decay=weight_decay,
                     fused=fused)
    for t, k in enumerate(active):
        # the matrix's gradient as a transposed view, as autograd returns some
        step = [gr[:k].clone() for gr in grads[t]]
        step[0] = step[0].transpose(1, 2).contiguous().transpose(1, 2)
        assert not step[0].is_contiguous()
        opt.step(step, k)
    for c in range(3):
        ref = [nn.Parameter(p[c].clone()) for p in start]
        sgd = torch.optim.SGD(ref, lr=0.1, momentum=momentum, weight_decay=weight_decay)
        for t, k in enumerate(active):
            if c < k:
                for p, gr in zip(ref, grads[t], strict=True):
                    p.grad = gr[c].clone()
                sgd.step()
        for p, s in zip(ref, stacked, strict=True):
            # op by op: torch.optim.SGD's own operations; fused: one kernel, which may
            # contract a multiply and an add (a last-bit difference)
            torch.testing.assert_close(s[c], p.detach(), rtol=1e-6 if fused else 0,
                                       atol=1e-7)


# ---- the step plan -------------------------------------------------------------------------
def _sequential_batches(n: int, spec: LocalSpec, g: torch.Generator) -> list[list[int]]:
    """The batches (positions) train_client forms, written out independently."""
    from privfedcal.data.augment import draw_augmentation

    out = []
    for _ in range(spec.training.local_epochs):
        order = torch.randperm(n, generator=g)
        if spec.data.augment:
            draw_augmentation(n, g)
        for s in range(0, n, spec.training.batch_size):
            b = order[s:s + spec.training.batch_size]
            if b.numel() < 2 and n >= 2:
                continue
            out.append(b.tolist())
    return out


@pytest.mark.parametrize("n,batch", [(1, 4), (2, 4), (9, 4), (8, 4), (5, 1), (3, 8)])
def test_client_steps_are_train_clients_batches(n, batch):
    spec = LocalSpec(TrainingSettings(local_epochs=2, batch_size=batch, lr=0.1, momentum=0.0,
                                      weight_decay=0.0, seed=0), DataSettings(augment=True))
    want = _sequential_batches(n, spec, make_generator(0, 1, 3, 1))
    width = min(batch, n)
    pos, w, draws = client_steps(n, spec, make_generator(0, 1, 3, 1), width)
    got = [p[m.bool()].tolist() for p, m in zip(pos, w, strict=True)]
    assert got == want
    assert draws[0].shape == (2, len(want), width) and draws[1].shape == (len(want), width)


# ---- every supported method: vectorised == sequential --------------------------------------
#: large regulariser weights, so a wrong proximal or contrastive term shows
_PARAMS = {"fedprox": {"mu": 2.0}, "clsprox": {"mu": 2.0}, "moon": {"mu": 5.0}}


def _assert_results_close(seq, vec) -> None:
    for a, b in zip(seq, vec, strict=True):
        assert set(a.state) == set(b.state)
        for k in a.state:
            torch.testing.assert_close(b.state[k], a.state[k], rtol=RTOL, atol=ATOL)
        assert b.loss == pytest.approx(a.loss, rel=1e-5, abs=1e-6)
        assert (a.client_state is None) == (b.client_state is None)
        for k in a.client_state or {}:
            torch.testing.assert_close(b.client_state[k], a.client_state[k], rtol=RTOL,
                                       atol=ATOL)


@pytest.mark.parametrize("method", VECTORISABLE)
def test_vectorised_trains_as_sequential(tiny_cfg, method):
    """Two rounds (the second with the clients' kept states: MOON's previous models),
    augmentation on, 5 clients in groups of 3 (a full and a partial group)."""
    cfg = tiny_cfg(method=method, clients=5, client_batch=3, augment=True, local_epochs=2,
                   method_params=_PARAMS.get(method, {}))
    exp = build_experiment(cfg)
    start = clone_state(exp.model)
    seq = InProcessTrainer(exp.model, exp.algo, exp.data.x_train, exp.data.y_train, exp.spec)
    vec = VectorisedTrainer(exp.model, exp.algo, exp.data.x_train, exp.data.y_train, exp.spec,
                            3)
    kept: list = [None] * 5
    for round_ in (1, 2):
        jobs = [TrainJob(c, exp.parts[c], kept[c]) for c in range(5)]
        a = seq.train(start, jobs, round_)
        b = vec.train(start, jobs, round_)
        _assert_results_close(a, b)
        kept = [r.client_state for r in a]


def test_simulator_with_client_batch_ends_with_the_same_model(tiny_cfg, tmp_path):
    """The whole run (server momentum of fedavgm included) with --client-batch 2 and 1."""
    from privfedcal.experiment import build_simulator

    states = []
    for k in (1, 2):
        sim = build_simulator(tiny_cfg(method="fedavgm", client_batch=k), tmp_path / str(k))
        summary = sim.run()
        states.append((sim.global_state, summary["accuracy"]))
    for key, v in states[0][0].items():
        torch.testing.assert_close(states[1][0][key], v, rtol=RTOL, atol=ATOL)
    assert states[0][1] == pytest.approx(states[1][1], abs=1e-3)


# ---- unequal client sizes ------------------------------------------------------------------
@settings(max_examples=12, deadline=None)
@given(sizes=st.lists(st.integers(1, 23), min_size=1, max_size=5),
       batch=st.integers(1, 9), epochs=st.integers(1, 2),
       momentum=st.sampled_from([0.0, 0.9]), method=st.sampled_from(["fedavg", "fedprox", "feduv"]))
@example(sizes=[1], batch=1, epochs=1, momentum=0.0, method="feduv")  # one row: no pair for L_U
def test_unequal_client_sizes(sizes, batch, epochs, momentum, method):
    """Random client sizes, 1-sample clients included, any batch size (a last batch of one
    skipped, clients without any step): the states are the sequential trainer's."""
    g = torch.Generator().manual_seed(len(sizes) * 100 + batch)
    n = sum(sizes)
    x = torch.randn(n, 1, 8, 8, generator=g)
    y = torch.randint(0, 10, (n,), generator=g)
    model = create_model("mlp", num_classes=10, in_channels=1, image_size=8,
                         generator=make_generator(0, 0, 0, 7))
    algo = create_algorithm(method, num_classes=10, **({"mu": 1.0} if method == "fedprox" else {}))
    spec = LocalSpec(TrainingSettings(local_epochs=epochs, batch_size=batch, lr=0.05,
                                      momentum=momentum, weight_decay=1e-3, seed=3),
                     DataSettings(augment=False))
    bounds = torch.tensor([0, *sizes]).cumsum(0)
    jobs = [TrainJob(c, torch.arange(int(bounds[c]), int(bounds[c + 1])), None)
            for c in range(len(sizes))]
    start = clone_state(model)
    a = InProcessTrainer(model, algo, x, y, spec).train(start, jobs, 1)
    b = VectorisedTrainer(model, algo, x, y, spec, 3).train(start, jobs, 1)
    _assert_results_close(a, b)


# ---- refusals ------------------------------------------------------------------------------
class _OwnLoss(Algorithm):
    """A method with a loss of its own (not registered)."""

    name = "own-loss"

    def local_loss(self, model, x, y):
        return super().local_loss(model, x, y) * 2


class _Declared(_OwnLoss):
    name = "declared-loss"
    vector_loss = ProximalLoss("model.classifier.")


class _ServerRuleOnly(Algorithm):
    name = "server-rule-only"

    def server_update(self, global_state, averaged, server_state):
        return averaged, server_state


def test_the_vectorised_loss_comes_from_the_method():
    """Declared on the class, built in by name, FedAvg's for FedAvg's client hooks; none
    for a loss of its own that declares no form."""
    assert vector_loss_of(_Declared) is _Declared.vector_loss
    assert vector_loss_of(create_algorithm("moon", num_classes=10)) is vector_loss_of(
        ALGORITHMS.get("moon"))
    assert type(vector_loss_of(_ServerRuleOnly)) is VectorLoss
    assert vector_loss_of(_OwnLoss) is None
    assert "balsoftmax" not in VECTORISABLE and {"fedavg", "moon", "freeze"} <= set(VECTORISABLE)


def test_refuses_a_method_without_a_vectorised_loss():
    model = create_model("mlp", num_classes=10, in_channels=1, image_size=8)
    with pytest.raises(UsageError, match="'own-loss' declares no vectorised loss"):
        check_vectorisable(model, _OwnLoss(num_classes=10))
    assert check_vectorisable(model, _Declared(num_classes=10)) is _Declared.vector_loss


def test_refuses_batchnorm_and_dropout_models():
    resnet = create_model("resnet8", num_classes=10, in_channels=3, image_size=32)
    fedavg = create_algorithm("fedavg", num_classes=10)
    with pytest.raises(UsageError, match="BatchNorm"):
        check_vectorisable(resnet, fedavg)
    with pytest.raises(UsageError, match="Dropout"):
        check_vectorisable(nn.Sequential(nn.Linear(2, 2), nn.Dropout(0.5)), fedavg)


def test_convolutional_model_on_cpu_gets_a_note(tiny_cfg):
    assert any("more slowly" in w for w in
               build_experiment(tiny_cfg(model="digits-cnn", client_batch=2)).warnings)
    assert not any("more slowly" in w for w in
                   build_experiment(tiny_cfg(model="digits-cnn")).warnings)
    assert not any("more slowly" in w for w in build_experiment(tiny_cfg(client_batch=2)).warnings)


def test_run_with_a_refused_model_stops_before_training(tiny_cfg):
    with pytest.raises(UsageError, match="BatchNorm"):
        build_experiment(tiny_cfg(model="resnet8", client_batch=2))


@pytest.mark.parametrize("changes,message", [
    ({"client_batch": 0}, "--client-batch must be >= 1"),
    ({"client_batch": 2, "workers": 2}, "--workers 1"),
    ({"client_batch": 2, "dp_train": True}, "--dp-train"),
])
def test_config_refusals(changes, message):
    with pytest.raises(UsageError, match=message):
        RunConfig.of(**changes)
