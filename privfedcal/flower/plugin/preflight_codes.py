"""What a node's ``query.preflight`` reply may say: a fixed vocabulary of checks, each with
the text the server prints (what is wrong on that node and what to change).

A node never sends an error's text (``privacy/error_codes.py``: text can hold anything the
failing code had at hand). Its preflight answer is one of these codes, chosen by which of
the plugin's checks failed (``preflight.check_node``), and, for a setting, the name of the
setting: a name from the plugin's own list (``plugin_settings.KEYS``), never its value. The
checks read the node's configuration, its model and the form of one batch of its data
(types, keys, that the model accepts it), not the data's values.
"""

from __future__ import annotations

from enum import StrEnum

from privfedcal.privacy.error_codes import ErrorCode

__all__ = ["ERROR_FIX", "FIX", "PreflightCode"]


class PreflightCode(StrEnum):
    """The outcome of a node's preflight: ``ok`` or the first check that failed."""

    OK = "ok"
    NO_PARTITION = "no-partition-id"
    UNKNOWN_SETTING = "unknown-setting"
    BAD_SETTING = "bad-setting"
    BAD_MODEL = "bad-model"
    BAD_HEAD = "bad-head"
    BAD_DATA = "bad-data"
    EMPTY_DATA = "empty-data"
    BATCH_KEYS = "batch-keys"
    BAD_BATCH = "bad-batch"
    DATA_DOES_NOT_FIT = "data-does-not-fit-model"
    HEAD_NOT_OUTPUT = "head-not-output"
    INTERNAL = "internal-error"


#: the server's text for each code: what is wrong on the node, then what to change
FIX: dict[PreflightCode, str] = {
    PreflightCode.NO_PARTITION: "the node has no partition-id in its node config: start it "
                                "with --node-config 'partition-id=K num-partitions=N'",
    PreflightCode.UNKNOWN_SETTING: "its run config or node config has a privfedcal.* key the "
                                   "plugin does not know: remove it or correct its spelling "
                                   "(the node's log names it)",
    PreflightCode.BAD_SETTING: "its privfedcal setting {key} is not valid on the node: give "
                               "it the value the server has, in the run config's {key} or "
                               "CalibrationClient's {keyword}= (the node's log says why)",
    PreflightCode.BAD_MODEL: "CalibrationClient could not build its model: pass a "
                             "torch.nn.Module, its class, or a function returning one",
    PreflightCode.BAD_HEAD: "the model has no Linear head by CalibrationClient's head= (or "
                            "its outputs differ from num_classes=): give head= the name of "
                            "the model's output Linear layer",
    PreflightCode.BAD_DATA: "CalibrationClient could not load the node's data: data= must be "
                            "a DataLoader or Dataset, or a function of the node's Context "
                            "returning one",
    PreflightCode.EMPTY_DATA: "the node's data is empty: give it its training partition",
    PreflightCode.BATCH_KEYS: "a batch of the node's data is a mapping whose keys name no "
                              "inputs or no labels: give CalibrationClient batch_keys=(inputs "
                              "key, labels key), e.g. batch_keys=('image', 'character')",
    PreflightCode.BAD_BATCH: "a batch of the node's data is not (inputs, labels) tensors with "
                             "one integer label per sample in 0..C-1 (C the head's outputs): "
                             "give the loader a ToTensor transform, or batch_keys=",
    PreflightCode.DATA_DOES_NOT_FIT: "the model's forward fails on a batch of the node's data "
                                     "(the inputs' shape or type does not fit the model): "
                                     "give the node the data the model trains on",
    PreflightCode.HEAD_NOT_OUTPUT: "the model's output is not its head's (or the head gets "
                                   "no row of features per sample): give head= the name of "
                                   "the Linear layer the model predicts with",
    PreflightCode.INTERNAL: "the node's check failed unexpectedly: its log holds the error",
}


#: what to change when a node answers a calibration message with an error code
#: (``privacy/error_codes.py``) after the preflight passed: added to the server's message
ERROR_FIX: dict[ErrorCode, str] = {
    ErrorCode.BAD_CONFIG: "a node's settings, model or data do not fit the message: call "
                          "preflight(...) before training to have the node and the fix named",
    ErrorCode.REFUSED: "the node's own privacy settings refuse the request: give the server "
                       "the node's privfedcal.* settings",
    ErrorCode.UNKNOWN_MESSAGE: "the node's ClientApp has no privfedcal handlers: attach "
                               "CalibrationClient(...) to it",
    ErrorCode.BUDGET_EXHAUSTED: "the node's ledger has made this run's planned releases "
                                "already: start a new Flower run (a new run id)",
    ErrorCode.UPLOAD_REJECTED: "the node's own check refused an upload or a sum: see its log",
    ErrorCode.RELEASE_SKIPPED: "the release was not made: see the node's log",
    ErrorCode.DIVERGED: "non-finite numbers in the node's model or data: check the trained "
                        "model and the node's inputs",
    ErrorCode.OUT_OF_MEMORY: "the node ran out of memory: give CalibrationClient a smaller "
                             "batch_size=",
    ErrorCode.INTERNAL: "the node failed unexpectedly: its log holds the error",
}
