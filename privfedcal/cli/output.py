"""The commands' output folders: the helpers live in ``privfedcal/report/output.py``, where
the jobs of the Python API (``privfedcal/jobs.py``) use them too."""

from privfedcal.report.output import (  # noqa: F401
    all_or_nothing,
    check_fresh,
    check_writable,
    partial_path,
)
