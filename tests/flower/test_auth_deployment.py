"""An authenticated deployment on loopback: TLS and SuperNode authentication (Flower 1.41).

The SuperLink runs with a certificate from a CA made by ``privfedcal.flower.deploy.credentials``
and ``--enable-supernode-auth``; the SuperNode whose key was registered
(``flwr supernode register``) comes online; one with an unregistered key and one with no
key (which would register itself) are refused and exit; one without TLS never connects. The processes are Flower's own commands
(``LocalDeployment(secure=True)``); no run is started, so it takes seconds, not minutes.
"""

from __future__ import annotations

import time

import pytest

pytest.importorskip("flwr")

from privfedcal.flower.deploy.credentials import make_node_key  # noqa: E402
from privfedcal.flower.deploy.localdeploy import LocalDeployment  # noqa: E402

WAIT = 45  # seconds for a node to come online or be refused


@pytest.mark.flower
def test_only_registered_supernodes_connect_over_tls(tmp_path):
    dep = LocalDeployment(1, tmp_path, secure=True)
    try:
        with dep:
            # node 0 is registered (flwr supernode register) and started by the deployment
            registered = [n["node-id"] for n in dep.nodes()]
            assert len(registered) == 1
            intruder_key, _ = make_node_key(tmp_path / "keys" / "intruder")  # never registered
            intruder = dep.start_node(0, intruder_key, name="intruder")
            # TLS but no key: it would register itself, which --enable-supernode-auth forbids
            keyless = dep.start_node(0, None, name="no-key")
            plain = dep.start_node(0, None, tls=False, name="no-tls")  # no TLS, no key
            deadline = time.monotonic() + WAIT
            online = False
            while time.monotonic() < deadline and not (
                    online and intruder.poll() is not None and keyless.poll() is not None):
                online = any(n["status"] == "online" for n in dep.nodes())
                time.sleep(1)
            assert online, f"the registered SuperNode never came online\n{dep.log_tail()}"
            # Flower's refusals: an unknown key is not activated; a node without a key may
            # not register itself under --enable-supernode-auth
            for proc, name, reason in (
                    (intruder, "intruder", "Failed to activate SuperNode"),
                    (keyless, "no-key", "All SuperNodes must be registered via the CLI")):
                log = (tmp_path / "logs" / f"{name}.log").read_text(errors="replace")
                assert proc.poll() not in (None, 0), f"{name} was not refused\n{log}"
                assert reason in log, log[-3000:]
            nodes = dep.nodes()
            # only the registered node is known to the SuperLink: neither the intruder nor
            # the node without TLS got in
            assert [n["node-id"] for n in nodes] == registered
            assert nodes[0]["status"] == "online"
            assert plain.poll() is None  # still retrying: the TLS port refuses it
    finally:
        dep.stop()
    assert dep.alive() == []
    # private keys are the owner's only
    for key in (tmp_path / "tls" / "server.key", tmp_path / "tls" / "ca.key", intruder_key,
                tmp_path / "keys" / "supernode-0"):
        assert key.stat().st_mode & 0o077 == 0, key
