"""``distcompat demo``: a nanochat-style training run on gloo that uses every piece of distcompat.

The two lines a user types::

    distcompat demo --out demo-out                 # 2 local gloo ranks, a minute or two
    python -m distcompat demo --nproc 2 --sweep    # also 1 rank, and scaling.png

The modules, in the order a reader meets them (docs/tutorial.md walks through them):
``_corpus`` (generated text, byte tokens), ``_model`` (the GPT), ``_optim`` (ZeRO AdamW over async
collective futures), ``_train`` (one rank's run), ``_checks`` (replicas, all-reduce latency),
``_report`` (manifest, timings, summary), ``_launch`` (starting and watching local ranks),
``_plot`` (the sweep's figure), ``_cli`` (flags). Importing this package runs nothing.
"""

from distcompat.demo._config import DemoConfig, DemoConfigError

__all__ = ["DemoConfig", "DemoConfigError"]
