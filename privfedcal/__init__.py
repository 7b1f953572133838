"""privfedcal: federated learning with classifier calibration, hardened uploads and audits."""

__version__ = "0.1.0"
