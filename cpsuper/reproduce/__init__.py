"""``cpsuper reproduce``: the JuICE paper's analyses on one model, as a self-contained HTML report.

- :mod:`.settings`: the grids of a full and a ``--quick`` run, argument checks;
- :mod:`.steps`: the analyses, one function per cached step;
- :mod:`.cache` (with :mod:`.codec`): the resumable step cache, also used by ``scripts/``;
- :mod:`.pipeline`: :func:`reproduce`, which runs the steps through the cache;
- :mod:`.outputs` and :mod:`.render`: result files and the HTML page from
  ``templates/report.html.j2``.
"""

from .cache import StepCache, StepCacheError, StepRecord
from .pipeline import print_locations, reproduce
from .settings import FULL, QUICK, Settings, check_arguments

__all__ = [
    "FULL",
    "QUICK",
    "Settings",
    "StepCache",
    "StepCacheError",
    "StepRecord",
    "check_arguments",
    "print_locations",
    "reproduce",
]
