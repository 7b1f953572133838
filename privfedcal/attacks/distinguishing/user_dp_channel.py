"""The user-level channel of ``privfedcal audit dp``: one round of DP-FedAvg (``--dp-updates``).

The game (``attacks/distinguishing/games.py``): D is a federation in which client 0 takes part with no
data (its update is zero: zero-out adjacency, docs/privacy/dp-updates.md "User-level DP on model
updates"), D' the same federation with client 0 holding a canary whose update is
``16 S`` along one coordinate, far outside the clip. The view is the server's released sum
along that coordinate (the other coordinates carry independent noise that the canary does
not move, with weight zero in the optimal projection test, so they are left out, as the
payload channels leave theirs out). The other participants' clipped updates are the same
in D and D' and known to the distinguisher; they shift both sides equally and are left out
too.

The release is the real code, trials as a leading dimension: ``UserDP.client_update`` for
each of the ``m`` participants (under ``--secagg-updates`` each adds its noise share; a zero
update passes the clip unchanged), the canary's update clipped by it, ``UserDP.server_noise``
for the central noise, from OS entropy. The claim is the accountant's charge for one round
(multiplier ``z`` at q = 1); with ``--dp-adaptive-clip`` the round's count shares that
charge and this view holds the updates alone, so the claim is an upper bound of their part.
"""

from __future__ import annotations

import torch

from privfedcal.attacks.distinguishing.games import Channel, Views
from privfedcal.privacy.releases import USER_DP_RELEASE

#: the client fields (privacy/client_fields.py) the view carries
FIELDS = ("train/local/*",)


def user_dp_channel(cfg, noise, faults, claim: tuple[float, float], scale: float) -> Channel:
    """The channel of ``cfg``'s model updates under ``--dp-updates``; ``noise`` is the run's
    noise stage broken as ``faults`` says (``channels.run_parts``), ``claim`` the correct
    run's (epsilon, delta) for one round, ``scale`` the canary's size in clips."""
    from privfedcal.privacy import user_dp as mechanism
    from privfedcal.privacy.planner import user_dp_of
    from privfedcal.settings.floors import PrivacyOptions

    udp = user_dp_of(PrivacyOptions.of(cfg), noise.dp)
    clip = udp.clip
    canary = {"w": torch.tensor([scale * clip], dtype=torch.float64)}
    # the clip client_update applies (its noise share is drawn below with the others');
    # clipping off (a fault): the canary's whole update reaches the sum
    moved = float((mechanism.clip_update(canary, clip) if faults.clip else canary)["w"][0])

    def draw(n: int, with_canary: bool) -> Views:
        zero = {"w": torch.zeros(n, dtype=torch.float64)}
        total = torch.zeros(n, dtype=torch.float64)
        for client in range(udp.denominator):  # each participant's share (distributed)
            total += udp.client_update(zero, zero, 1, client)[0]["w"]
        if with_canary:
            total += moved
        return {"update": udp.server_noise({"w": total}, 1)["w"].unsqueeze(1)}

    reference = ({"update": torch.zeros(1, 1, dtype=torch.float64)},
                 {"update": torch.full((1, 1), clip, dtype=torch.float64)})
    return Channel(USER_DP_RELEASE, FIELDS, *claim,
                   f"one client's whole data: an update of {scale:g} x clip against "
                   "none, one round", draw, reference=reference)


__all__ = ["FIELDS", "user_dp_channel"]
