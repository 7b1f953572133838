"""A Flower app of one's own: a small CNN trained with Flower's FedAvg on digits."""
