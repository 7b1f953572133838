"""How FedUV's terms change the scale of the CNN's features on one skewed CIFAR-10 client.

One client's local training, without federation: the CCVR/MOON CNN on a label-skewed subset
of CIFAR-10 (``--major`` images of each of classes 0 and 1, ``--minor`` of each other class;
a Dirichlet-0.1-like client), SGD lr 0.01, momentum 0.9, weight decay 1e-5, batch 64, no
augmentation, ``--epochs`` epochs, four losses from the same initial model and batch order:
CE alone (FedAvg), CE + mu L_U, CE + lambda L_V, and FedUV's full loss (mu = 0.5,
lambda = D/4). After each epoch it prints the mean feature norm ||z|| and the largest
|logit| of the last batch, the CE, L_U and L_V values.

    python benchmarks/probes/feduv_scale.py --data CIFAR10_DIR [--epochs 8] [--major 2000] [--minor 60]

L_U's sigma (the median of the non-zero squared pairwise distances) is differentiated, as in
the authors' code, so L_U is scale-invariant; an earlier L_U with sigma detached pushed every
pairwise distance up against the current sigma, which on a model without normalisation
layers nothing held back (docs/results/fidelity.md has both measurements).
"""

from __future__ import annotations

import argparse

import torch
import torch.nn.functional as F

from privfedcal.algorithms.feduv import FedUV, uniformity_loss, variance_loss
from privfedcal.data.datasets import load_dataset
from privfedcal.models import create_model


def client_subset(data: str, major: int, minor: int) -> tuple[torch.Tensor, torch.Tensor]:
    ds = load_dataset(f"imagefolder:{data}")
    idx = torch.cat([torch.nonzero(ds.y_train == c).flatten()[: major if c < 2 else minor]
                     for c in range(len(ds.classes))])
    return ds.x_train[idx].float(), ds.y_train[idx]


def run(x: torch.Tensor, y: torch.Tensor, terms: str, epochs: int, seed: int) -> None:
    torch.manual_seed(seed)
    model = create_model("cnn", num_classes=10, in_channels=3, image_size=32)
    feduv = FedUV(num_classes=10)
    opt = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9, weight_decay=1e-5)
    order = torch.Generator().manual_seed(seed)
    for epoch in range(epochs):
        perm = torch.randperm(x.shape[0], generator=order)
        for start in range(0, x.shape[0] - 63, 64):
            b = perm[start:start + 64]
            z = model.features(x[b])
            logits = model.classifier(z)
            ce = F.cross_entropy(logits, y[b])
            lu, lv = uniformity_loss(z), variance_loss(logits, feduv.c)
            loss = ce + ("U" in terms) * feduv.params.mu * lu + ("V" in terms) * feduv.lam * lv
            opt.zero_grad()
            loss.backward()
            opt.step()
        print(f"{terms:>6} epoch {epoch + 1}: |z| {z.norm(dim=1).mean():6.1f}  max|logit| "
              f"{logits.abs().max():6.1f}  CE {ce:.3f}  L_U {lu:.3f}  L_V {lv:.3f}", flush=True)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--data", required=True, help="CIFAR-10 image folders (train/, test/)")
    p.add_argument("--epochs", type=int, default=8)
    p.add_argument("--major", type=int, default=2000)
    p.add_argument("--minor", type=int, default=60)
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args()
    torch.set_num_threads(1)
    x, y = client_subset(args.data, args.major, args.minor)
    for terms in ("CE", "CE+U", "CE+V", "CE+U+V"):
        run(x, y, terms, args.epochs, args.seed)


if __name__ == "__main__":
    main()
