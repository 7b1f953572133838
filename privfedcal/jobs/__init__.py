"""Every job of the CLI besides training and attacking, as a function of the Python API:
compare runs, analyze a run, audit protection settings (the reconstruction sweep and the DP
distinguishing games), show a partition, write a report page (docs/api.md, "Every job").

Each public function takes its command's flags as keywords (``--max-clients`` is
``max_clients``), checks its arguments by their annotations (``pysurface.python_surface``),
raises ``UsageError`` whose message names keywords, returns its results as Python values and
writes files only where its docstring says. Each has an unwrapped half (``_compare``, ...)
that the CLI's command calls after parsing its flags; its messages name the flags, and the
command prints what it returns (``privfedcal/cli/``). One module per kind of job:
``run_folder_jobs.py`` (compare, analyze, write_report), ``audit_jobs.py`` (audit,
audit_dp), ``partition_job.py``; what they share is in ``job_surface.py``. The heavy code
lives below: ``report/`` (comparison, pages), ``analysis/run_analysis.py``,
``attacks/reconstruction/leakage_sweep.py`` and ``attacks/distinguishing/games.py``,
``data/partition.py``.
"""

# besides the public names: what the CLI's commands use (the unwrapped halves they call
# after parsing their flags, and the checks and names they share with the jobs)
from privfedcal.jobs.audit_jobs import Audit, DPAudit, audit, audit_dp
from privfedcal.jobs.audit_jobs import _audit as _audit
from privfedcal.jobs.audit_jobs import _audit_dp as _audit_dp
from privfedcal.jobs.audit_jobs import check_methods as check_methods
from privfedcal.jobs.job_surface import Stage
from privfedcal.jobs.partition_job import PARTITION_KEYS as PARTITION_KEYS
from privfedcal.jobs.partition_job import Partition, partition
from privfedcal.jobs.partition_job import _partition as _partition
from privfedcal.jobs.run_folder_jobs import Comparison, analyze, compare, write_report
from privfedcal.jobs.run_folder_jobs import _analyze as _analyze
from privfedcal.jobs.run_folder_jobs import _compare as _compare
from privfedcal.jobs.run_folder_jobs import _write_report as _write_report
from privfedcal.jobs.run_folder_jobs import page_path as page_path

__all__ = ["Audit", "Comparison", "DPAudit", "Partition", "Stage", "analyze", "audit",
           "audit_dp", "compare", "partition", "write_report"]
