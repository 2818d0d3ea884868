"""The miniature study (docs/miniature.md): a small base trained here, ACRE on top, the comparison.

``acre-train reproduce mini [--smoke]`` runs it (``studies.mini.cli``); ``study.Study`` is the driver,
``data`` builds the tokenizer and the training streams,
``report`` the tables and plot, ``diagnostics`` the answer-likelihood and drill-accuracy checks.
"""
