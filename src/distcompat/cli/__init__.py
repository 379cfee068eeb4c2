"""The ``distcompat`` command: ``doctor``, ``diagnose``, ``demo``, ``bench``, ``run``.

The top layer, with the demo: it may import anything below it. ``_entry`` sends ``run`` to
``_run`` (no torch import) and the rest to ``_main``'s parser; ``_doctor`` builds doctor's report::

    distcompat doctor --device cpu
"""

from distcompat.cli._entry import main

__all__ = ["main"]
