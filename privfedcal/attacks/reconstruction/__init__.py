"""Attacks that reconstruct what a client holds from what the server saw: feature and
gradient inversion of calibration uploads and model updates (``stats_attack``,
``gradients_attack``, ``updates_attack`` plan them, ``runner`` runs and ``scoring`` scores
them), class-set inference (``class_inference``, ``uploads``), disaggregation of secure sums
across rounds (``disaggregate``, ``disaggregate_attack``), and the leakage sweep of
``privfedcal audit`` (``leakage_sweep``). The server's view they read is ``attacks/view.py``.
"""
