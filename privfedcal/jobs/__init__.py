"""Every job of the CLI besides training and attacking, as a function of the Python API:
compare runs, analyze a run, audit protection settings (the reconstruction sweep and the DP
distinguishing games), show a partition, write a report page (docs/api.md, "Every job").

Each public function takes its command's flags as keywords (``--max-clients`` is
``max_clients``), checks its arguments by their annotations (``api.arguments.python_surface``),
raises ``UsageError`` whose message names keywords, returns its results as Python values and
writes files only where its docstring says. Each has a half for the CLI (``compare_for_cli``,
...) that its command calls after parsing its flags: it takes parsed values, its messages
name the flags, and the command prints what it returns (``privfedcal/cli/``). A long job
reports its progress as ``JobStep`` records. One module per kind of job:
``run_folder_jobs.py`` (compare, analyze, write_report), ``audit_jobs.py`` (audit,
audit_dp), ``partition_job.py``; what they share is in ``job_surface.py``. The heavy code
lives below: ``report/`` (comparison, pages), ``analysis/run_analysis.py``,
``attacks/reconstruction/leakage_sweep.py`` and ``attacks/distinguishing/games.py``,
``data/partition.py``.
"""

# besides the public names: what the CLI's commands use (the halves they call after parsing
# their flags, and the checks and names they share with the jobs)
from privfedcal.jobs.audit_jobs import Audit, DPAudit, audit, audit_dp
from privfedcal.jobs.audit_jobs import audit_dp_for_cli as audit_dp_for_cli
from privfedcal.jobs.audit_jobs import audit_for_cli as audit_for_cli
from privfedcal.jobs.audit_jobs import check_methods as check_methods
from privfedcal.jobs.job_surface import JobStep
from privfedcal.jobs.partition_job import PARTITION_KEYS as PARTITION_KEYS
from privfedcal.jobs.partition_job import Partition, partition
from privfedcal.jobs.partition_job import partition_for_cli as partition_for_cli
from privfedcal.jobs.run_folder_jobs import Comparison, analyze, compare, write_report
from privfedcal.jobs.run_folder_jobs import analyze_for_cli as analyze_for_cli
from privfedcal.jobs.run_folder_jobs import compare_for_cli as compare_for_cli
from privfedcal.jobs.run_folder_jobs import page_path as page_path
from privfedcal.jobs.run_folder_jobs import write_report_for_cli as write_report_for_cli

__all__ = ["Audit", "Comparison", "DPAudit", "JobStep", "Partition", "analyze", "audit",
           "audit_dp", "compare", "partition", "write_report"]
