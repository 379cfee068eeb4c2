"""The ``distcompat`` command: ``doctor``, ``diagnose``, ``demo``, ``bench`` (parser in ``_main``).

The top layer, with the demo: it may import anything below it. ``_doctor`` builds doctor's report::

    distcompat doctor --device cpu
"""

from distcompat.cli._main import main

__all__ = ["main"]
