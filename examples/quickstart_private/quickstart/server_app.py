"""The ServerApp: Flower's FedAvg over the nodes, then the final model on the test set."""

from __future__ import annotations

import torch
from flwr.app import ArrayRecord, ConfigRecord, Context, MetricRecord
from flwr.serverapp import Grid, ServerApp
from flwr.serverapp.strategy import FedAvg

from privfedcal.flower.plugin import PrivateUpdates, calibrate
from quickstart.task import Net, test, testloader

app = ServerApp()


@app.main()
def main(grid: Grid, context: Context) -> None:
    cfg = context.run_config
    torch.manual_seed(0)
    model = Net()
    strategy = PrivateUpdates(FedAvg(fraction_train=float(cfg["fraction-train"]),
                                     fraction_evaluate=float(cfg["fraction-evaluate"])),
                              context)
    result = strategy.start(grid=grid, initial_arrays=ArrayRecord(model.state_dict()),
                            train_config=ConfigRecord({"lr": float(cfg["lr"])}),
                            num_rounds=int(cfg["num-server-rounds"]))
    model.load_state_dict(result.arrays.to_torch_state_dict())
    _, accuracy = test(model, testloader())
    print(f"test accuracy: {accuracy:.3f}")
    context.state["quickstart"] = MetricRecord({"accuracy": accuracy})
    summary = calibrate(grid, model, context, head="fc3", test_data=testloader(),
                        updates=strategy)
    print(f"after calibration: {summary['accuracy']:.3f}")
    print(f"epsilon for training and calibration: {summary['privacy']['epsilon_spent']:.3f}")
    torch.save(model.state_dict(), "final_model.pt")
