"""Privacy hardening of calibration uploads and local training.

``dp`` (clipping, Gaussian mechanism), ``accounting`` (composition over opacus, noise
planning), ``dpsgd`` (DP-SGD over opacus), ``secagg`` (CKKS secure aggregation), ``uplink``
(the bound -> noise -> encrypt pipeline). Import the submodules directly; this package
imports nothing heavy.
"""
