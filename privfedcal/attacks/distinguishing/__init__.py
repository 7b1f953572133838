"""The distinguishing audit of ``privfedcal audit dp``: games between a client's data D and
D' = D plus a canary on each privacy channel of a run (``games`` plays and tabulates them,
``channels``, ``clip_channel`` and ``user_dp_channel`` build the channels), and the one-run
audits with many canaries (``one_run`` on the calibration uploads, ``one_run_training`` on
DP-SGD training): empirical lower bounds on epsilon beside the claimed one.
"""
