"""The federated round loop, local training, worker processes, checkpoints, transcript."""
