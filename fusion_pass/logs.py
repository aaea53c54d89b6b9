"""The ``h3_fused`` logger (``TORCH_LOGS="+h3_fused"`` or ``torch._logging.set_logs``) and counters.

Every replacement counts in ``torch._dynamo.utils.counters["h3_fused"]`` under the fused op's name;
refused candidates count under ``"refused"`` and are logged at DEBUG with the reason.
"""

from __future__ import annotations

import logging

import torch._logging._internal as torch_logging
from h3_fused.patterns.graph_view import source_of
from torch._dynamo.utils import counters

LOG_NAME = "h3_fused"
log = logging.getLogger(LOG_NAME)


# TORCH_LOGS="+h3_fused" makes torch import this package while it parses the variable, so registering
# at import is enough for torch to set up our handler (calling _init_logs here would add a second one).
torch_logging.register_log(LOG_NAME, LOG_NAME)


def count(key: str, n: int = 1) -> None:
    counters[LOG_NAME][key] += n


def refuse(node, why, kind: str = "a modulation site") -> None:
    """Count and log a candidate ``node`` that is not a site: what it looked like, the model's source line, the
    reason, and the hint where there is one."""
    count("refused")
    hint = getattr(why, "hint", None)
    log.debug("h3_fused: not fused: %s%s: %s%s", kind, source_of(node, " at "), why,
              f" (hint: {hint})" if hint else "")
