"""mirrax's experimental API: tools whose interface may still change between versions.

`scaling_report(step_or_model, batch, ...)` tells what training a step on 1, 2, 4 ... N
replicas will cost (collectives and bytes, per-device memory, predicted step time and speedup
on a link) before paying for the devices; `mirrax report` prints it for the bundled examples.
The model and its assumptions: docs/report.md.
"""

from mirrax._src.report.links import PRESETS as LINK_PRESETS
from mirrax._src.report.links import LinkModel as LinkModel
from mirrax._src.report.report import Memory as Memory
from mirrax._src.report.report import ScalingReport as ScalingReport
from mirrax._src.report.report import ScalingRow as ScalingRow
from mirrax._src.report.scaling import scaling_report as scaling_report

__all__ = ["LINK_PRESETS", "LinkModel", "Memory", "ScalingReport", "ScalingRow", "scaling_report"]
