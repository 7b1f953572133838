"""An attack's records: the list `privfedcal.attack(...)` returns and `attack.json` holds.

Three kinds of record, told apart by ``target``:

- ``InversionRecord``: an image reconstruction (``attack invert``; ``attacks/reconstruction/runner.py``
  ``inversion_job``, ``gradients_attack.py``, ``updates_attack.py``), scored by
  ``attacks/reconstruction/scoring.py`` ``score`` where the clients' data are at hand;
- ``ClassSetRecord``: a client's inferred class set (``attack classes``;
  ``attacks/reconstruction/uploads.py`` ``infer_class_sets``, scored by ``class_inference.score_class_sets``);
- ``DisaggregationRecord``: a client's value differenced out of secure sums
  (``attack disaggregate``; ``attacks/reconstruction/disaggregate_attack.py``).

In memory a score that could not be computed is NaN (``count_mae`` without uploaded counts);
``attack.json`` writes it as null (strict JSON), so those keys are typed ``float | None``.
An interrupted ``attack invert`` leaves a ``PartialAttack`` object in ``attack.json``
(``attacks/reconstruction/resume.py``).

The key ``class`` is a Python keyword, so each record type takes it from a base made with
the functional ``TypedDict`` syntax.
"""

from typing import Annotated, Any, Literal, NotRequired, TypedDict

_Class = TypedDict("_Class", {
    "class": Annotated[int | None, "the attacked class (None: the record is about no one class)"],
})

#: what each ``view`` value means (the server's view of the attacked payload)
View = Literal["plain-upload", "aggregate", "hypothetical", "simulated-update"]


class InversionRecord(_Class):
    """One image reconstruction: what was attacked, how the inversion ran and, where the
    clients' data are at hand, how close it came (the score keys, from `psnr` to
    `psnr_per_image`; absent, with `scored` False, on a server view alone)."""

    target: Annotated[Literal["raw-feature", "class-mean", "class-stats", "class-gradient",
                              "class-gradient-rounds", "model-update"],
                      "what was inverted: real features one by one (`raw-feature`, a "
                      "hypothetical baseline), a CCVR class mean or class statistics, a CReFF "
                      "class gradient (one release, or several rounds combined), a model "
                      "update"]
    client: Annotated[int | None, "the attacked client (None: the whole federation)"]
    round: Annotated[int, "the round of the attacked release"]
    rounds: NotRequired[Annotated[list[int], "class-gradient-rounds: the rounds combined"]]
    view: Annotated[View, "what the server saw: the client's plain upload, the aggregate "
                          "(secure aggregation; scored against the attacked client's "
                          "images), nothing (`hypothetical` baseline), or a model update the "
                          "attack simulated"]
    dp: Annotated[bool, "whether the attacked payload carried DP noise"]
    n: Annotated[int, "images the target stands for (the true count where known, else the "
                      "uploaded or estimated one)"]
    n_true: NotRequired[Annotated[int | None, "the client's true image count of the class "
                                              "(None: unscored)"]]
    n_observed: NotRequired[Annotated[float | None, "class-gradient: the uploaded (noisy) "
                                                    "count (None: no count uploaded)"]]
    n_used: NotRequired[Annotated[int | None, "class gradients: the n the recovery used (None: "
                                              "unknown, weighted-mean feature)"]]
    images: NotRequired[Annotated[int, "raw-feature: real images whose features were "
                                       "inverted"]]
    class_inferred: NotRequired[Annotated[bool, "whether the upload showed the class present "
                                                "(False: attacked as side knowledge, "
                                                "`known_classes=True`)"]]
    needed: NotRequired[Annotated[list[str], "side knowledge the attack took beyond the "
                                             "server's view"]]
    labels: NotRequired[Annotated[list[int], "simulated model update: the true labels of its "
                                             "batch"]]
    scored: NotRequired[Annotated[Literal[False], "present (False) only when nothing could be "
                                                  "scored: a server view alone"]]
    psnr: NotRequired[Annotated[float, "mean PSNR (dB) of the reconstructions against their "
                                       "matched true images"]]
    ssim: NotRequired[Annotated[float, "mean SSIM of the same pairs"]]
    feature_cosine: NotRequired[Annotated[float, "mean cosine between the reconstructions' "
                                                 "features and the true ones"]]
    nearest_is_true: NotRequired[Annotated[float, "share of reconstructions whose nearest "
                                                  "training image is their matched true one"]]
    nearest_chance: NotRequired[Annotated[float, "the same share for a random image of the "
                                                 "right class"]]
    prior_psnr: NotRequired[Annotated[float, "mean PSNR of the data-free prior (the class's "
                                             "test-set mean image), matched by the same rule"]]
    psnr_best: NotRequired[Annotated[float, "PSNR of the best reconstruction (the worst case "
                                            "over individuals)"]]
    nearest_of_best: NotRequired[Annotated[bool, "whether the best one's nearest training "
                                                 "image is its matched true one"]]
    prior_psnr_best: NotRequired[Annotated[float, "the prior's best PSNR"]]
    matching: NotRequired[Annotated[Literal["paired", "best", "hungarian"],
                                    "how reconstructions were matched to true images"]]
    candidates: NotRequired[Annotated[int, "true images they were matched against"]]
    psnr_per_image: NotRequired[Annotated[list[float], "PSNR of each reconstruction, 3 "
                                                       "digits"]]
    mode: Annotated[str, "the inversion that ran (e.g. `class-stats-direct`, `rank-n+...`, "
                         "`update-simulated-training`)"]
    target_cosine: Annotated[float, "cosine between the reconstructions' target (features or "
                                    "gradient) and the attacked one"]
    recovered_label: NotRequired[Annotated[int, "class-gradient: the label read off the "
                                                "gradient"]]
    label_correct: NotRequired[Annotated[bool, "class-gradient: whether it is the class"]]
    fit_residual: NotRequired[Annotated[float, "class-gradient: residual of the analytic fit"]]
    single_sample: NotRequired[Annotated[bool, "class-gradient: whether the gradient looks "
                                               "like one sample's"]]
    gradient_rank: NotRequired[Annotated[int, "class-gradient: numerical rank of the weight "
                                              "gradient"]]
    rank_n_residual: NotRequired[Annotated[float, "class-gradient: residual of the rank-n "
                                                  "feature recovery"]]
    features_of: NotRequired[Annotated[str, "class-gradient: what the features were scored "
                                            "against (DSA's augmented images)"]]
    recovered_cosine: NotRequired[Annotated[float, "class-gradient: cosine of the recovered "
                                                   "features with the true ones, before any "
                                                   "image is inverted"]]
    recovered_labels: NotRequired[Annotated[list[int], "model-update: the labels recovered "
                                                       "first"]]
    label_count_error: NotRequired[Annotated[int | None, "model-update: sum over classes of "
                                             "the recovered count's error (None: unscored)"]]
    steps_run: NotRequired[Annotated[int, "optimisation steps the inversion ran"]]
    feature_error: NotRequired[Annotated[float, "its final relative target error"]]
    converged: NotRequired[Annotated[bool, "whether it converged"]]
    stopped: NotRequired[Annotated[Literal["converged", "plateau", "cap"],
                                   "why it stopped: converged, no more progress, or the step "
                                   "cap (`steps`)"]]
    seconds: Annotated[float, "wall time of the target (a share of its batch's when "
                              "inversions were batched)"]


class ClassSetRecord(_Class):
    """A client's class set (and class counts, where uploaded) inferred from one
    calibration release; under secure aggregation the federation's."""

    target: Annotated[Literal["class-set"], "`class-set`"]
    client: Annotated[int | None, "the client (None: the federation, from the aggregate)"]
    n: Annotated[int | None, "the client's true image count (None: unscored)"]
    round: Annotated[int, "the round of the release"]
    label: Annotated[str, "the release (`ccvr-stats`, `creff-grad`)"]
    view: Annotated[View, "`plain-upload` or `aggregate`"]
    dp: Annotated[bool, "whether the payload carried DP noise"]
    scored: NotRequired[Annotated[Literal[False], "present (False) only when nothing could be "
                                                  "scored: a server view alone"]]
    accuracy: NotRequired[Annotated[float, "share of classes whose presence was inferred "
                                           "right"]]
    precision: NotRequired[Annotated[float, "precision of the inferred set (1: nothing "
                                            "inferred)"]]
    recall: NotRequired[Annotated[float, "recall of the inferred set (1: nothing held)"]]
    count_mae: NotRequired[Annotated[float | None, "mean absolute error of the inferred "
                                     "counts (NaN in memory, None in attack.json: no counts)"]]
    present: Annotated[list[int], "the classes inferred present"]
    true_classes: Annotated[list[int] | None, "the classes held (None: unscored)"]
    counts: Annotated[list[float] | None, "the inferred counts, 2 digits (None: the payload "
                                          "carries none)"]
    true_counts: Annotated[list[int] | None, "the true counts (None: unscored)"]


class DisaggregationRecord(_Class):
    """One client's value of one payload key, solved from the run's secure sums."""

    target: Annotated[Literal["disaggregate"], "`disaggregate`"]
    label: Annotated[str, "the release (`ccvr-stats`, `creff-grad`, `model-update`)"]
    key: Annotated[str, "the payload key (`count`, `sum`, a parameter, `__weight`)"]
    view: Annotated[Literal["aggregate"], "`aggregate`"]
    kind: Annotated[Literal["constant", "time-varying"],
                    "whether the value is the same in every release (solved exactly) or "
                    "assumed constant within windows"]
    releases: Annotated[int, "secure releases of the label"]
    rounds: Annotated[list[int], "their rounds"]
    participants: Annotated[list[list[int]], "the clients summed in each"]
    public_total: Annotated[str | None, "the public total that joined the system (None: "
                                        "none)"]
    rank: Annotated[int, "rank of the participation system"]
    groups: Annotated[list[list[int]], "the finest groups of clients the sums determine"]
    groups_complete: Annotated[bool, "whether those groups cover every client"]
    finest_group: Annotated[int | None, "size of the smallest group (None: no group)"]
    windows: Annotated[int, "windows solved (1: the whole run)"]
    fit_residual: Annotated[float, "the largest residual of the solves"]
    dp: Annotated[bool, "whether the sums carried DP noise"]
    client: Annotated[int, "the client"]
    determined: Annotated[bool, "whether the client's own value is determined"]
    windows_determined: Annotated[int, "windows in which it is"]
    group: Annotated[list[int] | None, "the smallest determined group holding the client"]
    value: Annotated[list[float] | None, "the estimate, 4 digits (None: too large to store)"]
    norm: Annotated[float, "its L2 norm"]
    truth: Annotated[list[float] | None, "the true value (None: unscored or too large)"]
    scored: Annotated[bool, "whether the estimate was scored"]
    max_abs_error: Annotated[float | None, "largest absolute error (None: unscored)"]
    rel_error: Annotated[float | None, "relative L2 error (None: unscored)"]
    exact: Annotated[bool | None, "whether every entry rounds to the truth (None: unscored)"]


#: one record of any attack (``target`` tells which)
AttackRecord = InversionRecord | ClassSetRecord | DisaggregationRecord


class PartialAttack(TypedDict):
    """`attack.json` of an interrupted `attack invert` (a finished one is a list of
    records); `--resume` finishes it."""

    partial: Annotated[Literal[True], "always True"]
    targets_done: Annotated[int, "targets finished"]
    targets_planned: Annotated[int, "targets the attack planned"]
    settings: Annotated[dict[str, Any], "the attack, run folder and options it ran with "
                                        "(compared on `--resume`; open-ended: every option of "
                                        "the attack)"]
    done: Annotated[list[str], "the finished targets' keys"]
    records: Annotated[list[AttackRecord], "their records"]


__all__ = ["AttackRecord", "ClassSetRecord", "DisaggregationRecord", "InversionRecord",
           "PartialAttack", "View"]
