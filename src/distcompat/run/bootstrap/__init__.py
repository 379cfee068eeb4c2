"""The folder ``distcompat run`` puts first on ``PYTHONPATH``; its ``sitecustomize`` bootstraps.

A package only so that the wheel carries it; Python never imports it as ``bootstrap``.
"""
