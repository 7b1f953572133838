"""Messages name settings through their declaration (privfedcal/settings/messages.py): one
template, written as flags for the CLI, keywords for Python and run-config keys for a Flower
app; every template in the package names declared settings; no regex rewrites a message."""

from __future__ import annotations

import ast
import inspect
import pickle
from pathlib import Path

import pytest

from privfedcal.api.arguments import flag_keywords
from privfedcal.errors import UsageError
from privfedcal.settings.catalogue import all_settings
from privfedcal.settings.messages import (
    SettingError,
    SettingText,
    refuse_failed,
    render_message,
    template_fields,
)
from privfedcal.settings.run_config import RunConfig

PACKAGE = Path(__file__).resolve().parents[2] / "privfedcal"


def job_options() -> set[str]:
    """Every option of a job of the Python API (privfedcal/jobs/), whose spelling ``job``
    declares: the parameters of each job function."""
    from privfedcal import jobs

    functions = [getattr(jobs, n) for n in jobs.__all__ if inspect.isfunction(getattr(jobs, n))]
    return {name for f in functions for name, p in inspect.signature(f).parameters.items()
            if p.kind not in (p.VAR_KEYWORD, p.VAR_POSITIONAL)}


def declared_names() -> set[str]:
    """Every setting (run settings, method hyperparameters, calibrator options, Flower
    options), every attack option and every job option."""
    return ({s.name for s in all_settings()} | {kw.name for kw in flag_keywords().values()}
            | job_options())


def _pieces(node: ast.AST) -> list[str]:
    """The literal text of a template expression: a string, an f-string's literal parts,
    a concatenation's strings."""
    if isinstance(node, ast.Constant) and isinstance(node.value, str):
        return [node.value]
    if isinstance(node, ast.JoinedStr):
        return [v.value for v in node.values if isinstance(v, ast.Constant)]
    if isinstance(node, ast.BinOp):
        return _pieces(node.left) + _pieces(node.right)
    return []


def templates() -> list[tuple[str, str, set[str]]]:
    """(where, template text, keywords given) of every ``SettingError``/``SettingText`` made
    in the package, and of every ``(check, message)`` pair of a module that refuses with
    ``refuse_failed``."""
    out = []
    for path in sorted(PACKAGE.rglob("*.py")):
        source = path.read_text()
        tree = ast.parse(source)
        refuses = "refuse_failed" in source
        for node in ast.walk(tree):
            where = f"{path.relative_to(PACKAGE.parent)}:{getattr(node, 'lineno', 0)}"
            if (isinstance(node, ast.Call) and node.args
                    and ast.unparse(node.func).split(".")[-1] in ("SettingError", "SettingText")):
                given = {k.arg for k in node.keywords if k.arg}
                out += [(where, text, given) for text in _pieces(node.args[0])]
            elif refuses and isinstance(node, ast.Tuple) and len(node.elts) == 2:
                out += [(where, text, set()) for text in _pieces(node.elts[1]) if "{" in text]
    return out


def test_every_template_field_names_a_declared_setting():
    declared, found = declared_names(), templates()
    assert len(found) >= 80
    for where, text, given in found:
        for name, valued in template_fields(text):
            if valued:
                assert name in declared and name in given, (where, text, name)
            else:
                assert name in declared or name in given, (where, text, name)


@pytest.mark.parametrize("module", ["api/arguments.py", "flower/plugin/wording.py",
                                    "jobs/job_surface.py", "settings/messages.py"])
def test_no_regex_rewrites_a_message(module):
    """The modules that write messages for Python and Flower readers (the API's surface,
    the jobs', the plugin's boundary, the templates) render declarations; none rewrites
    text with a regex (``re.sub``, ``re.compile``)."""
    source = (PACKAGE / module).read_text()
    tree = ast.parse(source)
    imported = {a.name for n in ast.walk(tree) if isinstance(n, ast.Import) for a in n.names}
    imported |= {n.module for n in ast.walk(tree) if isinstance(n, ast.ImportFrom)}
    assert "re" not in imported and "regex" not in imported
    assert "re.sub" not in source and "re.compile" not in source and ".sub(" not in source
    names = {n.name for n in ast.walk(tree) if isinstance(n, ast.FunctionDef)}
    assert not names & {"python_message", "_named_values", "_keywords_of"}


def test_every_job_option_is_declared_by_the_job():
    """A job's options are spelled from their declaration: its flag for the CLI, its
    keyword (``overwrite=True`` for an option that turns on) for Python."""
    from privfedcal.settings.messages import SPELLINGS

    assert job_options() <= set(SPELLINGS)
    assert SettingText("pass {overwrite}, not {one_run=}", one_run=False).render("python") \
        == "pass overwrite=True, not one_run=False"
    text = SettingText("{budget_s} must be > 0, got {got}", got=0.0)
    assert (str(text), text.render("python")) == ("--budget-s must be > 0, got 0.0",
                                                  "budget_s must be > 0, got 0.0")


def test_one_template_three_readers():
    text = SettingText("{secagg_min_clients=} is too few for {hide_counts} (got {got!r}); "
                       "try {method=} or {hide_counts=}", secagg_min_clients=1, got="x",
                       method="fedavg", hide_counts=False)
    assert str(text) == ("--secagg-min-clients 1 is too few for --show-counts (got 'x'); "
                         "try --method fedavg or --show-counts")
    assert text.render("python") == ("secagg_min_clients=1 is too few for hide_counts=False "
                                     "(got 'x'); try method='fedavg' or hide_counts=False")
    assert text.render("flower") == ("secagg-min-clients=1 is too few for hide-counts=False "
                                     "(got 'x'); try method='fedavg' or hide-counts=False")
    assert SettingText("{hide_counts} needs {secagg}").render("python") == \
        "hide_counts=True needs secagg=True"
    assert SettingText("{fedprox_mu} and {virtual_per_class:name}").render("flower") == \
        "method-params.mu and calibration-params.virtual-per-class"
    assert SettingText("{round_timeout}").render("flower") == "flower.round-timeout"
    with pytest.raises(ValueError, match="reader must be one of"):
        text.render("yaml")


def test_a_setting_error_is_a_usage_error_that_keeps_its_template():
    err = SettingError("{rounds=} > {limit}", rounds="N", limit=4)
    assert isinstance(err, UsageError) and str(err) == "--rounds N > 4"
    assert err.render("python") == "rounds=N > 4"
    again = pickle.loads(pickle.dumps(err))  # errors cross worker processes
    assert type(again) is SettingError and again.render("python") == "rounds=N > 4"
    assert render_message(UsageError("plain text --resume"), "python") == "plain text --resume"
    with pytest.raises(SettingError, match=r"^--clients must be >= 1$"):
        refuse_failed([(True, "{rounds} fine"), (False, "{clients} must be >= 1")])


def test_the_sections_refuse_in_every_readers_words():
    with pytest.raises(SettingError) as exc:
        RunConfig.of(dp_delta=1e-6, accountant="prv")
    assert str(exc.value) == "--dp-delta, --accountant belong(s) to a DP budget: give --dp-eps"
    assert exc.value.render("python") == \
        "dp_delta, accountant belong(s) to a DP budget: give dp_eps"
    with pytest.raises(SettingError) as exc:
        RunConfig.of(method="ccvr", calibrate="creff")
    assert exc.value.render("python").endswith("use method='fedavg' calibrate='creff'")
    assert str(exc.value).endswith("use --method fedavg --calibrate creff")
