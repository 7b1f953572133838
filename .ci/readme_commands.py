"""Print the README's Quickstart commands, one fenced ``bash`` block per line, in order.

``.ci/run`` executes exactly these, so CI follows the README whenever its commands change.
"""

import re
import sys
from pathlib import Path

text = Path(__file__).resolve().parent.parent.joinpath("README.md").read_text()
section = re.search(r"^## Quickstart\n(.*?)(?=^## )", text, re.S | re.M)
if section is None:
    sys.exit("README.md has no '## Quickstart' section")
blocks = re.findall(r"```bash\n(.*?)```", section.group(1), re.S)
if len(blocks) < 2:
    sys.exit("README.md's Quickstart needs two bash blocks: install + run, install + test")
for block in blocks:
    print(" ".join(line.strip() for line in block.strip().splitlines() if line.strip()))
