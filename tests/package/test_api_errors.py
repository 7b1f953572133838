"""The Python API speaks Python (privfedcal/api/__init__.py, docs/api.md): its errors name keywords,
never the CLI's flags; numpy scalars are taken wherever Python numbers are; every bad input
is a one-line UsageError. The CLI's own lists of bad input are fed through the API."""

from __future__ import annotations

import ast
import inspect
import re
from pathlib import Path

import numpy as np
import pytest
import torch

import privfedcal
from privfedcal import api
from privfedcal.api import arguments as pysurface
from privfedcal.api.arguments import flag_keywords
from privfedcal.errors import PrivacyBudgetError, UsageError
from privfedcal.settings.messages import SettingText, render_message

ROOT = Path(__file__).resolve().parents[2]
FAST = dict(clients=3, rounds=2, local_epochs=1, device="cpu", threads=1, alpha=0.5)
#: a flag left in a message (``--dp-eps``), not a ``--`` inside a word or range
FLAG = re.compile(r"(?<![\w-])--[a-z]")
#: a value of each type, for the settings whose default is None
SAMPLE = {int: 1, float: 0.5, str: "x", bool: True}


def settings_table():
    from privfedcal.settings.catalogue import cli_settings

    return cli_settings()


def public_functions():
    """Every public function of the API, with the methods of ``Run`` that take arguments."""
    funcs = [getattr(api, n) for n in api.__all__
             if inspect.isfunction(getattr(api, n))]
    return funcs + [api.Run.experiment]


#: a flag in the CLI's text, or a flag's name alone as a message lists several (a name
#: with a hyphen, which prose does not use)
_WORD = re.compile(r"(?<![\w-])(?:--)?[a-z][a-z0-9]*(?:-[a-z0-9]+)*(?![\w-])")
#: a flag's value in the CLI's text: a number, or a placeholder (N, DIR)
_VALUE = re.compile(r"[-+]?(?:\d+(?:\.\d*)?(?:e[-+]?\d+)?|inf|nan)|[A-Z]+")


def _named_values(name: str) -> set[str]:
    """The values a string setting takes by name (its choices or its registry)."""
    from privfedcal.data.datasets import DATASETS
    from privfedcal.experiment import method_choices
    from privfedcal.federation.hooks import CALIBRATORS
    from privfedcal.models import MODELS
    from privfedcal.settings.catalogue import all_settings

    registries = {"method": method_choices, "calibrate": lambda: [*CALIBRATORS.names(), "none"],
                  "dataset": lambda: DATASETS, "model": MODELS.names}
    choices = next((s.choices for s in all_settings() if s.name == name and s.choices), None)
    return set(choices or (registries[name]() if name in registries else ()))


def keyword_form(text: str) -> str:
    """The expected keyword form of a CLI test's text (its needle), worked out from the
    flags table independently of the package's rendering: ``--dp-eps must`` ->
    ``dp_eps must``, ``--secagg-min-clients 2`` -> ``secagg_min_clients=2``, ``--secagg``
    -> ``secagg=True``, ``--method fedavg`` -> ``method='fedavg'``, ``match-steps`` ->
    ``match_steps``; other flags as they are."""
    table, out, pos = flag_keywords(), [], 0
    for m in _WORD.finditer(text):
        flag = m.group()
        bare = not flag.startswith("--")
        kw = table.get("--" + flag if bare else flag)
        if kw is None or (bare and "-" not in flag):
            continue
        out.append(text[pos:m.start()])
        pos = m.end()
        if bare or kw.type is bool:
            out.append(kw.name if bare else f"{kw.name}={kw.value}")
            continue
        after = re.match(r" ('[^']*'|[^\s,;()]+)", text[pos:])
        token = after.group(1).rstrip(":.") if after else ""
        if text[pos + 1 + len(token):].startswith(" |"):  # a list of choices, not a value
            token = ""
        if kw.type is str and token and (token[0] == "'" or token.isupper()
                                         or token.split(":")[0] in _named_values(kw.name)):
            shown = token if token[0] == "'" or token.isupper() else repr(token)
            out.append(f"{kw.name}={shown}")
            pos += 1 + len(token)
        elif kw.type is not str and token and _VALUE.fullmatch(token):
            out.append(f"{kw.name}={token}")
            pos += 1 + len(token)
        else:
            out.append(kw.name)
    return "".join(out) + text[pos:]


def assert_speaks_python(exc: pytest.ExceptionInfo) -> str:
    message = str(exc.value)
    assert "\n" not in message and not FLAG.search(message), message
    return message


# ---- one table: every flag is its keyword --------------------------------------------------
def test_every_flag_of_the_settings_table_is_a_keyword_of_train():
    """Each ``privfedcal train`` flag (run settings, method hyperparameters, calibrator
    options) reads as its keyword, and ``train`` takes that keyword: whatever it refuses,
    it never calls it an unknown setting nor names a flag."""
    from privfedcal.settings.catalogue import cli_settings

    settings = cli_settings()
    assert len(settings) > 60
    for s in settings:
        field = "{" + s.name + "}"
        if s.type is bool:
            on, _, off = (s.param_decls or (s.flag_name,))[0].partition("/")
            given = SettingText(f"give {field}.")
            assert (str(given), given.render("python")) == (f"give {on}.", f"give {s.name}=True.")
            if off:
                given = SettingText("give {" + s.name + "=}.", **{s.name: False})
                assert (str(given), given.render("python")) == \
                    (f"give {off}.", f"give {s.name}=False.")
        else:
            said = SettingText(f"{field} must be")
            assert (str(said), said.render("python")) == \
                (f"{s.flag_name} must be", f"{s.name} must be"), s.name
        listed = SettingText("({" + s.name + ":name}, x)")  # a name alone, as lists name several
        assert (str(listed), listed.render("python")) == (f"({s.flag_name[2:]}, x)", f"({s.name}, x)")
        value = s.default if s.default is not None else SAMPLE.get(s.type, {})
        try:
            api.config_from(None, {s.name: value})
        except UsageError as exc:
            message = render_message(exc, "python")
            assert "unknown setting" not in message and not FLAG.search(message), message


def test_every_attack_option_is_a_keyword_of_attack():
    from privfedcal.attacks.attack_options import option_flags
    from privfedcal.attacks.reconstruction.stats_attack import StatsOptions
    from privfedcal.attacks.release_attacks import registered

    for attack in registered():
        for f in option_flags(attack.options):
            flag = (f.flag or "--" + f.name.replace("_", "-")).partition("/")[0]
            assert flag_keywords()[flag].name == f.name
            word = f.name + ("=True" if f.type is bool else "")
            said = SettingText("{" + f.name + "} must be")
            assert said.render("python") == f"{word} must be"
            if f.name not in {s.name for s in settings_table()}:  # a setting's flag wins
                assert str(said) == f"{flag} must be"
    assert pysurface.options_of(StatsOptions, {"raw_samples": np.int64(0)}, "x") == {"raw_samples": 0}


def test_values_after_a_flag_join_their_keyword():
    """A message names settings through their declaration: the CLI reads its flags (with a
    value after the flag), Python its keywords (the value joined to the keyword)."""
    cases = [
        (SettingText("fewer than {secagg_min_clients=}.", secagg_min_clients=2),
         "fewer than --secagg-min-clients 2.", "fewer than secagg_min_clients=2."),
        (SettingText("{dp_delta=} must be < 1/N", dp_delta=0.5),
         "--dp-delta 0.5 must be < 1/N", "dp_delta=0.5 must be < 1/N"),
        (SettingText("extend it with {rounds=} > 4", rounds="N"),
         "extend it with --rounds N > 4", "extend it with rounds=N > 4"),
        (SettingText("use {method=} {calibrate=}", method="fedavg", calibrate="ccvr"),
         "use --method fedavg --calibrate ccvr", "use method='fedavg' calibrate='ccvr'"),
        (SettingText("{calibrate=!r}: the argument", calibrate="oracle:x"),
         "--calibrate 'oracle:x': the argument", "calibrate='oracle:x': the argument"),
        (SettingText("pass {data_root=} (and {download}", data_root="DIR"),
         "pass --data-root DIR (and --download", "pass data_root=DIR (and download=True"),
        (SettingText("{hide_counts} needs {secagg}"),
         "--hide-counts needs --secagg", "hide_counts=True needs secagg=True"),
        (SettingText("trained with {transcript=}?", transcript=False),
         "trained with --no-transcript?", "trained with transcript=False?"),
        (SettingText("{hide_counts=}", hide_counts=False), "--show-counts", "hide_counts=False"),
        (SettingText("{method} must be one of"), "--method must be one of",
         "method must be one of"),
        (SettingText("add {calibrate} ccvr | creff"), "add --calibrate ccvr | creff",
         "add calibrate ccvr | creff"),
        (SettingText("option(s) {given} given",
                     given=SettingText.named(["match_steps", "tukey"], spec="name")),
         "option(s) match-steps, tukey given", "option(s) match_steps, tukey given"),
        (SettingText("{dp_delta=:g} and {got!r}", dp_delta=1e-5, got="x"),
         "--dp-delta 1e-05 and 'x'", "dp_delta=1e-05 and 'x'"),
        (SettingText("rounds 1--2, --resume {run}", run="RUN"),  # not a setting: kept
         "rounds 1--2, --resume RUN", "rounds 1--2, --resume RUN"),
    ]
    for text, flags, words in cases:
        assert (str(text), text.render("python")) == (flags, words)
        assert keyword_form(flags) == words  # the tests' own reading agrees


# ---- numbers: numpy scalars as Python's, never a bool or a fraction for an int ---------------
def test_numpy_scalars_are_taken_as_python_numbers():
    cfg = api.config_from(None, dict(rounds=np.int64(3), dp_eps=np.float64(8), method="ccvr",
                                 secagg=np.bool_(True), clients=np.int32(4),
                                 participation=np.float32(1.0), mu=np.float64(0.1),
                                 virtual_per_class=np.int64(50), lr=torch.tensor(0.05)))
    assert (cfg.training.rounds, cfg.privacy.dp_eps, cfg.privacy.secagg, cfg.data.clients) == (3, 8.0, True, 4)
    assert [type(v) for v in (cfg.training.rounds, cfg.privacy.dp_eps, cfg.privacy.secagg, cfg.training.lr)] == \
        [int, float, bool, float]
    assert cfg.method_params == {"mu": 0.1} and type(cfg.method_params["mu"]) is float
    assert cfg.calibration_params == {"virtual_per_class": 50}
    assert api.config_from({"rounds": np.int16(2)}, {}).training.rounds == 2
    assert api.config_from(None, {"rounds": 4.0}).training.rounds == 4


@pytest.mark.parametrize("value", [True, np.bool_(True), 2.5, np.float64(2.5), "3",
                                   float("nan"), torch.tensor([1, 2])])
def test_an_int_setting_refuses_bools_fractions_and_strings(value, tmp_path):
    with pytest.raises(UsageError, match=r"^rounds must be an integer") as exc:
        privfedcal.train(rounds=value, out=tmp_path / "run", device="cpu")
    assert_speaks_python(exc)


def test_every_public_function_checks_and_coerces_its_arguments():
    """Each is wrapped (so no parameter goes unchecked) and each annotated int/float
    parameter takes numpy scalars as Python numbers."""
    for func in public_functions():
        assert hasattr(func, "__wrapped__"), func.__name__
    stats = {"count": torch.ones(3, dtype=torch.float64), "sum": torch.ones(3, 4, dtype=torch.float64),
             "outer": torch.eye(4, dtype=torch.float64).repeat(3, 1, 1)}
    noisy = privfedcal.privatize_statistics(stats, epsilon=np.float64(4), delta=np.float32(1e-5),
                                            clip=np.int64(2))
    assert set(noisy) == set(stats)
    from privfedcal.models import create_model

    torch.manual_seed(0)
    model = create_model("mlp", num_classes=3, in_channels=1, image_size=8)
    x, y = torch.randn(12, 1, 8, 8), torch.arange(12) % 3
    up = privfedcal.ccvr_statistics(model, x, y, np.int64(3), clip=np.float32(4.0),
                                    batch_size=np.int64(5))
    assert up["count"].tolist() == [4.0, 4.0, 4.0]
    model = privfedcal.calibrate_head(model, up, virtual_per_class=np.int64(5),
                                      seed=np.int64(0), steps=np.int64(2), lr=np.float64(0.1))
    with pytest.raises(UsageError, match="num_classes must be an integer") as exc:
        privfedcal.ccvr_statistics(model, x, y, 3.5)
    assert_speaks_python(exc)


# ---- wrong input of any kind: one UsageError naming the keyword -------------------------------
def test_an_unwritable_out_is_a_usage_error(tmp_path):
    afile = tmp_path / "file"
    afile.write_text("")
    for out in ("/proc/privfedcal-x", afile / "run"):
        with pytest.raises(UsageError, match="cannot write to out") as exc:
            privfedcal.train(out=out, **FAST)
        assert_speaks_python(exc)
    assert not Path("/proc/privfedcal-x").exists()


@pytest.mark.parametrize(("call", "needle"), [
    (lambda p: privfedcal.train(out=3, **FAST), "out must be a path"),
    (lambda p: privfedcal.train(p / "c.toml", out=p / "r"), "does not exist"),
    (lambda p: privfedcal.train([1], out=p / "r"), "config must be a RunConfig"),
    (lambda p: privfedcal.train(nope=1, out=p / "r"), "unknown setting(s) nope"),
    (lambda p: privfedcal.train(progress=1, out=p / "r", **FAST), "progress must be callable"),
    (lambda p: privfedcal.train(None, None, out=p / "r"), "train(): too many positional"),
    (lambda p: privfedcal.load_run(3), "path must be a path"),
    (lambda p: privfedcal.resume(p, rounds="2"), "rounds must be an integer"),
    (lambda p: privfedcal.resume_simulator(p), "not a run folder"),
    (lambda p: privfedcal.privatize_statistics([1], epsilon=1, delta=0.1, clip=1),
     "stats must be a mapping"),
    (lambda p: privfedcal.privatize_statistics({}, epsilon="1", delta=0.1, clip=1),
     "epsilon must be a number"),
    (lambda p: privfedcal.ccvr_statistics(None, torch.ones(1), torch.ones(1), 2),
     "model must be a torch.nn.Module"),
    (lambda p: privfedcal.calibrate_head(torch.nn.Linear(1, 1), {}), "stats must have the keys"),
])
def test_wrong_types_and_names_are_usage_errors(call, needle, tmp_path):
    with pytest.raises(UsageError) as exc:
        call(tmp_path)
    assert needle in assert_speaks_python(exc)


def test_resume_speaks_python(tmp_path):
    run = privfedcal.train(out=tmp_path / "run", **FAST)
    with pytest.raises(UsageError) as exc:
        privfedcal.resume(run)
    assert "extend it with rounds=N > 2" in assert_speaks_python(exc)
    with pytest.raises(UsageError) as exc:
        privfedcal.resume_simulator(run.path, rounds=np.int64(1))
    assert "rounds must be >= 2" in assert_speaks_python(exc)


def test_the_cli_keeps_its_flags_where_it_calls_the_api(tmp_path, capsys):
    """``train --resume`` runs ``api.resume_simulator_for_cli``: its user typed flags and
    reads flags."""
    from privfedcal.cli.main import main

    privfedcal.train(out=tmp_path / "run", **FAST)
    for argv, needle in ((["--rounds", "1"], "; --rounds must be >= 2"),
                         ([], "extend it with --rounds N > 2")):
        with pytest.raises(SystemExit):
            main(["train", "--resume", str(tmp_path / "run"), *argv])
        assert needle in capsys.readouterr().err


def test_a_divergence_hint_names_keywords():
    from privfedcal.errors import Diverged

    exc = Diverged(3, "the loss is not finite", hint=SettingText("lower {lr}"))
    assert str(exc) == "diverged at round 3: the loss is not finite; lower --lr"
    pysurface.speak_python(exc)
    assert exc.hint == "lower lr" and str(exc) == "diverged at round 3: the loss is not finite; lower lr"


@pytest.fixture(scope="module")
def ccvr_run(tmp_path_factory):
    return privfedcal.train(method="ccvr", out=tmp_path_factory.mktemp("api") / "ccvr", **FAST)


def test_attack_options_are_checked_by_name_and_type(ccvr_run):
    with pytest.raises(UsageError, match="unknown attack option.* bogus; valid names: .*raw_samples"):
        privfedcal.attack(ccvr_run, "stats", bogus=1)
    with pytest.raises(UsageError, match="raw_samples must be an integer"):
        privfedcal.attack(ccvr_run, "stats", raw_samples="3")
    with pytest.raises(UsageError, match=r"clients\[1\] must be an integer"):
        privfedcal.attack(ccvr_run, "stats", clients=[0, 0.5])
    with pytest.raises(UsageError, match="clients must be a list of integers, got 9"):
        privfedcal.attack(ccvr_run, "stats", clients=9)
    with pytest.raises(UsageError, match="known_classes must be True or False"):
        privfedcal.attack(ccvr_run, "stats", known_classes="yes")
    with pytest.raises(UsageError, match=r"^rounds_combined must be >= 1"):
        privfedcal.attack(ccvr_run, "gradients", rounds_combined=np.int64(0))
    with pytest.raises(UsageError, match="unknown re-training option.* epoch;"):
        privfedcal.calibrate_head(ccvr_run.experiment().model, {}, epoch=3)
    records = privfedcal.attack(ccvr_run, "classes", seed=np.int64(1),
                                false_positive_rate=np.float64(0.01))
    assert len(records) == 3
    records = privfedcal.attack(ccvr_run, "stats", steps=np.int64(2), restarts=np.int64(1),
                                clients=np.array([0]), classes=torch.tensor([1]),
                                raw_samples=np.int64(0))
    assert records and {r["client"] for r in records} == {0}


# ---- the CLI's lists of bad input, through the API ---------------------------------------------
def _cli_cases(file: str, test: str | None) -> tuple[list[str], list[tuple]]:
    """The module's ``FAST`` argv and the parameters of ``test``'s parametrize, read from
    the CLI test file's source (literals), so that a case added there is checked here."""
    tree = ast.parse((ROOT / "tests" / "cli" / file).read_text())
    fast, cases = [], None
    for node in tree.body:
        if isinstance(node, ast.Assign) and [ast.unparse(t) for t in node.targets] == ["FAST"]:
            fast = ast.literal_eval(node.value)
        if isinstance(node, ast.FunctionDef) and node.name == test:
            (deco,) = [d for d in node.decorator_list if ast.unparse(d.func).endswith("parametrize")]
            cases = ast.literal_eval(deco.args[1])
    assert cases or test is None, (file, test)
    return fast, [c if isinstance(c, tuple) else (c,) for c in cases or ()]


def keywords_of(argv: list[str]) -> dict[str, object]:
    """``privfedcal train`` flags as ``train`` keywords, typed by the settings table."""
    table, out, i = flag_keywords(), {}, 0
    while i < len(argv):
        kw = table[argv[i]]
        if kw.type is bool:
            out[kw.name], i = kw.value, i + 1
        else:
            out[kw.name], i = kw.type(argv[i + 1]), i + 2
    return out


def expected(needle: str) -> str:
    """The CLI test's needle as the API says it: its flags as keywords (a bare flag name,
    ``hide-counts``, as its keyword too)."""
    kw = flag_keywords().get("--" + needle)
    words = kw.name if kw else keyword_form(needle)
    assert not FLAG.search(words), needle
    return words


def _train_cases():
    fast, weaken = _cli_cases("test_privacy_cli.py", "test_settings_that_weaken_a_guarantee_are_refused")
    yield from ((fast[:4] + args + ["--device", "cpu"], needle, True) for args, needle in weaken)
    _, bad = _cli_cases("test_privacy_cli.py", "test_bad_privacy_settings_one_line")
    yield from ((args + ["--device", "cpu"], needle, False) for args, needle in bad)
    fast, calibrate = _cli_cases("test_calibration_cli.py", "test_bad_calibrate_is_one_line_exit_2")
    yield from ((fast + ["--calibrate", spec], needle, True) for spec, needle in calibrate)
    fast, alias = _cli_cases("test_run_contract.py", "test_alias_with_another_calibrator_is_refused")
    yield from ((fast + args, "--method fedavg --calibrate", True) for (args,) in alias)


def _usage_error_calls():
    """Every ``assert_usage_error(["train", ...], capsys, *needles)`` of tests/cli whose argv
    is literal (``*FAST`` included) and made of settings only: an ``--out`` the test builds
    is dropped, and a case about the output folder or an option of the command rather than
    a setting (``--resume``, ``--config``) is left to its own test."""
    table = flag_keywords()
    for file in sorted((ROOT / "tests" / "cli").glob("test_*.py")):
        fast, _ = _cli_cases(file.name, None)
        for node in ast.walk(ast.parse(file.read_text())):
            if not (isinstance(node, ast.Call) and ast.unparse(node.func) == "assert_usage_error"
                    and isinstance(node.args[0], ast.List)):
                continue
            argv, elts = [], node.args[0].elts
            for i, e in enumerate(elts):
                if isinstance(e, ast.Starred) and ast.unparse(e.value).startswith("FAST"):
                    argv += eval(ast.unparse(e.value), {"FAST": fast})  # FAST or a slice of it
                elif isinstance(e, ast.Constant):
                    argv.append(e.value)
                elif i and argv[-1] == "--out":
                    argv.pop()
                else:
                    argv = None
                    break
            needles = [ast.literal_eval(n) for n in node.args[2:] if isinstance(n, ast.Constant)]
            if (argv and argv[0] == "train" and len(needles) == len(node.args) - 2
                    and not any("out" in n or "writ" in n for n in needles)
                    and all(a in table for a in argv[1:] if a.startswith("--"))):
                yield argv[1:], needles


TRAIN_CASES = list(_train_cases())
CALL_CASES = list(_usage_error_calls())


@pytest.mark.parametrize(("argv", "needle", "usage"), TRAIN_CASES,
                         ids=[" ".join(a) for a, _, _ in TRAIN_CASES])
def test_the_clis_bad_settings_are_refused_in_keywords(argv, needle, usage, tmp_path):
    """The CLI's refusals, given as keywords: the same error in keywords (the CLI's needle
    with its flags as keywords), one line, no folder written."""
    out = tmp_path / "run"
    with pytest.raises(UsageError if usage else (UsageError, PrivacyBudgetError)) as exc:
        privfedcal.train(out=out, **keywords_of(argv))
    message = assert_speaks_python(exc)
    assert expected(needle) in message
    if usage:
        assert not out.exists()


@pytest.mark.parametrize(("argv", "needles"), CALL_CASES,
                         ids=[" ".join(a) for a, _ in CALL_CASES])
def test_the_clis_refused_trainings_are_refused_in_keywords(argv, needles, tmp_path):
    """The CLI tests' other refusals of ``train`` (``assert_usage_error``), as keywords."""
    with pytest.raises(UsageError) as exc:
        privfedcal.train(out=tmp_path / "run", **keywords_of(argv))
    message = assert_speaks_python(exc)
    for needle in needles:
        assert expected(needle) in message


def test_the_cli_lists_are_all_fed_through():
    assert len(CALL_CASES) >= 10
    assert len(TRAIN_CASES) >= 30
    assert any("nan" in a for a, _, _ in TRAIN_CASES)
    assert sum(bool(FLAG.search(needle)) for _, needle, _ in TRAIN_CASES) >= 15


@pytest.mark.parametrize(("flags", "needle"),
                         _cli_cases("test_attack_cli.py", "test_meaningless_budgets_are_refused")[1])
def test_the_clis_meaningless_attack_budgets_are_refused_in_keywords(flags, needle, ccvr_run,
                                                                     tmp_path):
    with pytest.raises(UsageError) as exc:
        privfedcal.attack(ccvr_run, "stats", clients=[0], **keywords_of(flags))
    assert expected(needle) in assert_speaks_python(exc)
