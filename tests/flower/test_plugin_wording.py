"""privfedcal.flower.plugin.wording: a plugin user meets the plugin's keys (``privfedcal.dp-eps``)
and keywords, never ``privfedcal train``'s flags: every flag of the settings table, the CLI's own
lists of bad privacy settings fed through the plugin's settings, and every text a node's
preflight code prints on the server."""

from __future__ import annotations

import ast
import re
from pathlib import Path

import pytest

pytest.importorskip("flwr")

from privfedcal.api.arguments import flag_keywords  # noqa: E402
from privfedcal.errors import PrivacyBudgetError, UsageError  # noqa: E402
from privfedcal.flower.plugin.plugin_settings import CALIBRATION, KEYS, gather, resolve  # noqa: E402
from privfedcal.flower.plugin.preflight import _plan  # noqa: E402
from privfedcal.flower.plugin.preflight_codes import FIX  # noqa: E402
from privfedcal.flower.plugin.wording import plugin_key, plugin_message, speaks_plugin  # noqa: E402
from privfedcal.settings.messages import SettingError, SettingText  # noqa: E402

ROOT = Path(__file__).resolve().parents[2]
#: a flag of privfedcal's (``--dp-eps``) left in a message
FLAG = re.compile(r"(?<![\w-])--[a-z][a-z0-9-]*")


def privfedcal_flags(text: str) -> list[str]:
    """The flags of ``privfedcal train`` in ``text`` (Flower's own, ``--node-config``, are a
    Flower user's words)."""
    return [f for f in FLAG.findall(text) if f in flag_keywords()]


def test_every_setting_the_plugin_takes_reads_as_its_key():
    plugin = set(KEYS) | {"secagg-key-holder"}
    for flag, kw in flag_keywords().items():
        key = flag[2:]
        if key not in plugin and "flower." + key not in KEYS:
            continue
        said = plugin_message(SettingError("{" + kw.name + "} must be"))
        assert not privfedcal_flags(said), said
        assert said.startswith("privfedcal."), said
        name = said.split()[0].split("=")[0].removeprefix("privfedcal.")
        assert name in KEYS, (flag, said)
    given = SettingText("give {secagg_key_holder=}", secagg_key_holder=5)
    assert str(given) == "give --secagg-key-holder 5"
    assert plugin_message(given) == "give privfedcal.flower.key-holder=5"
    assert plugin_key("virtual_per_class") == f"privfedcal.{CALIBRATION}virtual-per-class"
    # text that names no setting through its declaration is left alone
    assert plugin_message("set privfedcal.dp-eps or privfedcal.dp-clip") == \
        "set privfedcal.dp-eps or privfedcal.dp-clip"


def _cli_cases(test: str) -> list[tuple[list[str], str]]:
    """The parameters of ``test`` in tests/cli/test_privacy_cli.py, read from its source."""
    tree = ast.parse((ROOT / "tests" / "cli" / "test_privacy_cli.py").read_text())
    (node,) = [n for n in tree.body if isinstance(n, ast.FunctionDef) and n.name == test]
    (deco,) = [d for d in node.decorator_list if ast.unparse(d.func).endswith("parametrize")]
    return ast.literal_eval(deco.args[1])


def run_config_of(argv: list[str]) -> dict[str, object] | None:
    """``privfedcal train`` flags as the plugin's run config, or None where a flag is not
    one of the plugin's settings (``--dp-train``, ``--method moon``)."""
    table, out, i = flag_keywords(), {}, 0
    while i < len(argv):
        kw = table.get(argv[i])
        key = plugin_key(kw.name).removeprefix("privfedcal.") if kw else None
        if key is None or key not in KEYS:
            return None
        if kw.type is bool:
            out["privfedcal." + key], i = kw.value, i + 1
        else:
            out["privfedcal." + key], i = kw.type(argv[i + 1]), i + 2
    if out.get("privfedcal.method", "ccvr") not in ("ccvr", "creff"):
        return None
    return out


CLI_CASES = (_cli_cases("test_settings_that_weaken_a_guarantee_are_refused")
             + _cli_cases("test_bad_privacy_settings_one_line"))


@pytest.mark.parametrize("argv,needle", CLI_CASES)
def test_the_clis_bad_privacy_settings_speak_the_plugin(argv, needle):
    run_config = run_config_of(argv)
    if run_config is None:
        pytest.skip("not a setting of the plugin")
    try:
        with speaks_plugin():
            s = resolve(gather({}, run_config), clients=3)
            _plan(s, 1000)
    except (UsageError, PrivacyBudgetError) as exc:
        message = str(exc)
        assert "\n" not in message and not privfedcal_flags(message), message
        return
    # refused by the CLI for its own reasons (a FedAvg run with nothing to calibrate)
    assert needle in ("nothing to protect", "--secagg-updates", "hide-counts")


def test_most_of_the_clis_cases_reach_the_plugin():
    assert sum(run_config_of(a) is not None for a, _ in CLI_CASES) >= 12


@pytest.mark.parametrize("code", sorted(FIX))
def test_every_node_code_says_what_to_change_in_the_users_words(code):
    text = FIX[code]
    assert not privfedcal_flags(text), text
    what, _, fix = text.partition(": ")
    assert what and fix, text


def test_a_node_error_log_speaks_the_plugin(caplog):
    """A handler's error: its code to the server, its text in the node's log in plugin keys."""
    from flwr.app import Message, RecordDict
    from flwr.clientapp import ClientApp
    from plugin_app import Net, node_data

    from privfedcal.flower.grid import NODE_BASE, InProcessGrid
    from privfedcal.flower.plugin import CalibrationClient

    app = CalibrationClient(Net, node_data, head="fc3").attach(ClientApp())
    grid = InProcessGrid(app, {"privfedcal.dp-eps": 0.0}, 3)
    msg = Message(RecordDict(), dst_node_id=NODE_BASE, message_type="query.hello",
                  group_id="g")
    (reply,) = grid.send_and_receive([msg])
    assert reply.error.reason == "bad-config"
    logged = caplog.text
    assert "privfedcal.dp-eps must be in (0, 100]" in logged and "--dp-eps" not in logged


def test_a_lost_nodes_code_says_what_to_change():
    from privfedcal.flower.link import FlowerRoundError
    from privfedcal.flower.plugin.preflight_codes import ERROR_FIX
    from privfedcal.flower.plugin.wording import user_words
    from privfedcal.privacy.error_codes import ErrorCode

    assert set(ERROR_FIX) == set(ErrorCode)
    for code, fix in ERROR_FIX.items():
        assert not privfedcal_flags(fix), fix
        exc = user_words(FlowerRoundError(f"lost: client 1 (node 1001: {code.value})"))
        assert str(exc).endswith(f"; {code.value}: {fix}")
    # a code is named as a word, not inside another
    assert str(user_words(FlowerRoundError("no-bad-config-here"))) == "no-bad-config-here"
