"""The ``h3_fused`` logger (``TORCH_LOGS="+h3_fused"`` or ``torch._logging.set_logs``) and counters.

Every replacement counts in ``torch._dynamo.utils.counters["h3_fused"]`` under the fused op's name;
refused candidates count under ``"refused"`` and are logged at DEBUG with the reason.
"""

from __future__ import annotations

import logging

import torch._logging._internal as torch_logging
from torch._dynamo.utils import counters

LOG_NAME = "h3_fused"
log = logging.getLogger(LOG_NAME)


# TORCH_LOGS="+h3_fused" makes torch import this package while it parses the variable, so registering
# at import is enough for torch to set up our handler (calling _init_logs here would add a second one).
torch_logging.register_log(LOG_NAME, LOG_NAME)


def count(key: str, n: int = 1) -> None:
    counters[LOG_NAME][key] += n


def refuse(node, why) -> None:
    """Count and log a candidate that is not a site."""
    count("refused")
    log.debug("h3_fused: refused candidate %s: %s", node, why)
