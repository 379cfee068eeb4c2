"""The distcompat version, defined here and nowhere else.

pyproject.toml reads it at build time (``[tool.setuptools.dynamic]``), so the package metadata,
``distcompat.__version__`` and ``distcompat --version`` all come from this one line::

    >>> from distcompat._version import __version__
    >>> __version__
    '0.1.0'
"""

__version__ = "0.1.0"
